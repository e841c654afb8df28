"""GRPO for a flow-matching image model, over its denoising trajectory (Flow-GRPO).

The model is a velocity field: ``model.apply(variables, x, t)`` (and a
condition as a third argument when ``condition_key`` is set) returns v with
x's shape, for x_t = (1 - t) x_0 + t noise, so sampling runs t from 1 down
to 0. An ordinary-differential sampler has no probabilities to ratio, so the
rollout samples with the SDE that shares the ODE's marginals:

    mean = x - dt * (v + sigma_t^2 / (2 t) * (x + (1 - t) v)),  std = sigma_t * sqrt(dt)
    sigma_t = noise_level * sqrt(t / max(1 - t, dt))

over ``steps`` equal steps, so each step is a Gaussian whose log-density
the rollout records (``old_logp`` [B, steps]). A group of ``group_size``
images per condition (or per row, unconditioned) is scored by the reward;
the loss per step is GRPO's clipped ratio with the group-normalized
advantage, plus beta times the exact KL of that step's Gaussian to the
frozen reference's, ||mean - mean_ref||^2 / (2 std^2), averaged over steps
and images.

A model trained by ``DiffusionObjective`` with the flow schedule and the
velocity target (the digits-diffusion recipe's DiT) is such a model once
its input is scaled as that objective scaled it: set ``data_std`` to the
objective's (0.5 by default) and FlowGRPO feeds it the same. The
flow-grpo-digits recipe starts from that run's weights (its ``init``
section) and raises the brightness of the digits it draws.

What the trained weights are for is drawing images: ``pipeline`` samples
with the ODE the SDE shares its marginals with (Euler over ``steps`` steps,
no noise after the first draw), optionally with classifier-free guidance
through the model's null label; validation draws the held-out labels that
way and reports the mean ``reward`` of the images.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from dew.data.base import Batch as HostBatch
from dew.errors import BatchKeyError
from dew.nn.kinds import PixelDenoiser, VideoModel
from dew.objectives.base import (
    Aux,
    Batch,
    LeafFilter,
    Mean,
    Metric,
    Objective,
    Step,
    Variables,
    under,
)
from dew.objectives.diffusion_pipeline import PixelPipeline, draw_in_chunks
from dew.objectives.grpo import clipped_policy_loss, group_advantages
from dew.objectives.inference import variables_of
from dew.objectives.policy import REFERENCE, PolicyFrom, policy_variables, with_reference
from dew.objectives.rollouts import RewardMetric
from dew.rewards import Reward, resolve, score
from dew.training.runtime.whole_batch import host_value
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.inputs import Conditioning
    from dew.training.initializers import WeightSource
    from dew.training.state import TrainState

__all__ = ["FlowGRPOObjective", "FlowPipeline", "FlowRollout", "sde_step", "timesteps"]


def timesteps(steps: int) -> jax.Array:
    """The times the sampler visits, from 1 (noise) to 0 (data): steps + 1 of them."""
    return jnp.linspace(1.0, 0.0, steps + 1, dtype=jnp.float32)


def sde_step(velocity: jax.Array, x: jax.Array, t: jax.Array, dt: float,
             noise_level: float) -> tuple[jax.Array, jax.Array]:
    """The mean and standard deviation of one SDE step from x at time t to t - dt."""
    t = jnp.reshape(t, (-1,) + (1,) * (x.ndim - 1))
    sigma = noise_level * jnp.sqrt(t / jnp.maximum(1.0 - t, dt))
    drift = velocity + sigma**2 / (2.0 * t) * (x + (1.0 - t) * velocity)
    return x - dt * drift, sigma * math.sqrt(dt)


def gaussian_logp(x: jax.Array, mean: jax.Array, std: jax.Array) -> jax.Array:
    """log N(x; mean, std^2 I), summed over all but the first axis."""
    z = (x - mean) / std
    per = -0.5 * z**2 - jnp.log(std) - 0.5 * math.log(2 * math.pi)
    return jnp.sum(per.reshape(x.shape[0], -1), axis=-1)


def _velocity(model: nn.Module, variables: Variables, x: jax.Array, t: jax.Array,
              condition: jax.Array | None, data_std: float | None = None) -> jax.Array:
    """The model's velocity at x, t; with data_std, x is scaled as a DiffusionObjective feeds it."""
    if data_std is not None:
        from dew.diffusion import Diffusion, RectifiedFlow

        x, t = Diffusion(RectifiedFlow(), target="velocity", data_std=data_std).model_input(x, t)
    if condition is None:
        return model.apply(variables, x, t)
    return model.apply(variables, x, t, condition)


class FlowRollout:
    """Sample group_size images per row with the live parameters, recording each step's log-density."""

    def __init__(self, objective: FlowGRPOObjective, reward: Reward) -> None:
        self.objective = objective
        self.reward = reward
        self.reward_seconds = 0.0
        model, steps, noise = objective.model, objective.steps, objective.noise_level
        data_std = objective.data_std
        shape = tuple(objective.image_shape)

        def sample(variables, condition, key):
            rows = condition.shape[0]
            times = timesteps(steps)
            dt = 1.0 / steps
            key, first = jax.random.split(key)
            x = jax.random.normal(first, (rows, *shape), jnp.float32)

            def one(x, inputs):
                t, k = inputs
                t_rows = jnp.full((rows,), t)
                velocity = _velocity(model, variables, x, t_rows,
                                     condition if objective.condition_key else None, data_std)
                mean, std = sde_step(velocity, x, t_rows, dt, noise)
                following = mean + std * jax.random.normal(k, x.shape)
                return following, (following, gaussian_logp(following, mean, std))

            _, (path, logp) = jax.lax.scan(one, x, (times[:-1], jax.random.split(key, steps)))
            trajectory = jnp.concatenate([x[None], path], axis=0)  # [steps + 1, rows, ...]
            return jnp.moveaxis(trajectory, 0, 1), logp.T

        self._sample = jax.jit(sample)

    def __call__(self, state: TrainState, batch: HostBatch, key: jax.Array) -> dict[str, ArrayLike]:
        objective, g = self.objective, self.objective.group_size
        if objective.condition_key is not None:
            if objective.condition_key not in batch:
                raise BatchKeyError(
                    f"FlowGRPO reads conditions under {objective.condition_key!r} (the class labels its "
                    f"model draws), but the batch holds {sorted(batch)}. Give it labelled images (the "
                    "digits reader), or set condition_key to the key that holds the labels.")
            condition = np.repeat(np.asarray(batch[objective.condition_key]), g, axis=0)
        else:
            rows = len(next(iter(batch.values())))
            condition = np.zeros((rows * g,), np.int32)
        trajectory, logp = self._sample({"params": state.params["params"]}, jnp.asarray(condition), key)
        images = host_value(trajectory[:, -1])
        if objective.pixels:  # what a pipeline would show: a sample past [-1, 1] earns nothing more
            images = np.clip(np.round((images + 1.0) * 127.5), 0, 255).astype(np.uint8)
        # A reward reads the batch's other keys, repeated per sample, as whatever they hold.
        context: dict[str, Any] = {k: np.repeat(np.asarray(v), g, axis=0) for k, v in batch.items()}
        began = time.perf_counter()
        rewards = score(self.reward, list(images), context)
        self.reward_seconds += time.perf_counter() - began
        return {"trajectory": trajectory, "old_logp": logp, "reward": rewards, "condition": condition}


@dataclass(frozen=True)
class FlowGRPOObjective(Objective):
    """GRPO over an SDE sampler's steps of a flow-matching model (see the module docstring).

    The reward scores each trajectory's last image: as sampled, or with
    pixels as uint8 [0, 255] (samples in [-1, 1] rounded and clipped, as a
    DiffusionPipeline returns them), so an image pushed past the range earns
    nothing for it. data_std: see the module docstring.

    metrics: ``reward``, ``kl`` (per step), ``clip_fraction``.
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model"})
    trains: ClassVar[type[Any] | None] = PixelDenoiser
    tokenizer = None  # labels in, images out: its pipeline saves no tokenizer (not a field)

    model: nn.Module
    reward: Any = "brightness"
    _: KW_ONLY
    image_shape: tuple[int, ...] = (28, 28, 1)
    group_size: int = 4
    steps: int = 10
    noise_level: float = 0.7
    clip: float = 0.2
    beta: float = 0.01
    condition_key: str | None = None
    data_std: float | None = None
    pixels: bool = False

    def __post_init__(self) -> None:
        """An image_shape the model does not draw, refused as the objective is built (the first
        trace would fail inside the model)."""
        if not isinstance(self.model, PixelDenoiser):  # a plugin's model: its own shape
            return
        frames = (self.model.frames,) if isinstance(self.model, VideoModel) and self.model.frames else ()
        drawn = [*frames, self.model.image_size, self.model.image_size, self.model.channels]
        if list(self.image_shape) != drawn:
            raise ValueError(f"image_shape={list(self.image_shape)} is not the shape the model draws: "
                             f"{type(self.model).__name__} with image_size={self.model.image_size} and "
                             f"channels={self.model.channels} draws {drawn}; set image_shape={drawn}.")

    @property
    def frozen(self) -> LeafFilter | None:  # type: ignore[override]
        return under(REFERENCE) if self.beta > 0 else None

    @property
    def reference_collection(self) -> str | None:
        """The frozen copy of the starting model when beta > 0 (a LoRA run keeps none: its base is it)."""
        return REFERENCE if self.beta > 0 else None

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The velocity model's variables (given ones pass through) and, when beta > 0, the reference."""
        if variables is None:
            x = jnp.zeros((1, *self.image_shape), jnp.float32)
            t = jnp.zeros((1,), jnp.float32)
            args = (x, t) if self.condition_key is None else (x, t, jnp.zeros((1,), jnp.int32))
            variables = self.model.init(key, *args)
        return with_reference(variables) if self.beta > 0 else policy_variables(variables)

    def starting_weights(self, source: WeightSource) -> PolicyFrom:
        """What a recipe's init section reads narrowed to the policy's parameters (the reference copies them)."""
        return PolicyFrom(source)

    def rollout(self) -> FlowRollout:
        return FlowRollout(self, resolve(self.reward))

    def required_keys(self) -> Sequence[str]:
        return ("trajectory", "old_logp", "reward", "condition")

    @property
    def conditioning(self) -> Conditioning:
        """What the model reads beside x and t (``dew.inputs``): its labels, or nothing."""
        from dew.inputs import Unconditional, conditioning_of

        return conditioning_of(self.model, label_key=self.condition_key) if self.condition_key \
            else Unconditional()

    def sample(self, variables: Variables, key: jax.Array, condition: jax.Array | None, rows: int, *,
               steps: int | None = None, guidance: float = 1.0) -> jax.Array:
        """Images [rows, *image_shape] in [-1, 1] by the ODE from noise (Euler, t from 1 to 0).

        condition is the model's input (None: the null condition); with
        guidance != 1 the velocity is guided away from the null condition's.
        """
        steps = steps or self.steps
        params = {"params": variables["params"]}
        null = self.conditioning.null(rows)
        condition = null if condition is None else condition
        x = jax.random.normal(key, (rows, *self.image_shape), jnp.float32)
        dt = 1.0 / steps

        def step(x: jax.Array, t: jax.Array) -> tuple[jax.Array, None]:
            times = jnp.full((rows,), t)
            velocity = _velocity(self.model, params, x, times, condition, self.data_std)
            if guidance != 1.0:
                unguided = _velocity(self.model, params, x, times, null, self.data_std)
                velocity = unguided + guidance * (velocity - unguided)
            return x - dt * velocity, None

        return jax.lax.scan(step, x, timesteps(steps)[:-1])[0]

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        """The held-out conditions (or rows) drawn by the ODE, for ``metrics`` to score."""
        rows = int(next(iter(batch.values())).shape[0])
        condition = self.conditioning.read(batch, traced_check=False) if self.condition_key else None
        x = self.sample(policy_variables(variables), step.key, condition, rows)
        # What the rollout's reward sees: uint8 pixels (as a pipeline returns them) or the samples.
        image = jnp.clip(jnp.round((x + 1.0) * 127.5), 0, 255).astype(jnp.uint8) if self.pixels else x
        return {"image": image, **{k: v for k, v in batch.items() if k != "image"}}

    def metrics(self) -> tuple[Metric, ...]:
        """The mean reward of the images drawn for the validation conditions."""
        return (_ImageReward(resolve(self.reward), output="image"),)

    def pipeline(self, state: TrainState | Variables, *, ema: bool = True) -> FlowPipeline:
        """Images for labels (or unconditioned) from the policy in state, by the ODE."""
        return FlowPipeline(self, policy_variables(variables_of(state, ema)))


    def _means(self, variables: Variables, trajectory: jax.Array, condition: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every step's mean [B, steps, ...] under variables, and the steps' standard deviations."""
        rows = trajectory.shape[0]
        times = timesteps(self.steps)[:-1]
        x = trajectory[:, :-1].reshape(rows * self.steps, *trajectory.shape[2:])
        t = jnp.tile(times, rows)
        cond = jnp.repeat(condition, self.steps, axis=0) if self.condition_key else None
        velocity = _velocity(self.model, variables, x, t, cond, self.data_std)
        mean, std = sde_step(velocity, x, t, 1.0 / self.steps, self.noise_level)
        return mean, std

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        trajectory = jnp.asarray(batch["trajectory"], jnp.float32)
        rows = trajectory.shape[0]
        reward = jnp.asarray(batch["reward"], jnp.float32)
        advantage = group_advantages(reward, self.group_size, ddof=0)  # as Flow-GRPO's code: np.std
        mean, std = self._means(policy_variables(variables), trajectory, batch["condition"])
        following = trajectory[:, 1:].reshape(rows * self.steps, *trajectory.shape[2:])
        logp = gaussian_logp(following, mean, std).reshape(rows, self.steps)
        per_step, clipped = clipped_policy_loss(logp, batch["old_logp"], advantage, self.clip)
        metrics: dict[str, Mean | jax.Array] = {"reward": Mean.of(reward), "clip_fraction": Mean.of(clipped)}
        if self.beta > 0:
            ref_mean, _ = self._means({"params": jax.lax.stop_gradient(variables[REFERENCE])}, trajectory,
                                      batch["condition"])
            kl = jnp.sum(((mean - ref_mean) ** 2 / (2 * std**2)).reshape(rows * self.steps, -1), axis=-1)
            kl = kl.reshape(rows, self.steps)
            per_step = per_step + self.beta * kl
            metrics["kl"] = Mean.of(kl)
        return Mean.of(per_step), Aux(metrics=metrics)


class _ImageReward(RewardMetric):
    """RewardMetric over images: the reward reads the arrays themselves."""

    def completions(self, outputs: Mapping[str, Any]) -> list[Any]:
        return list(np.asarray(outputs[self.output]))


@dataclass(frozen=True, repr=False)  # _Saved's repr
class FlowPipeline(PixelPipeline):
    """Images from a FlowGRPO policy: labels (or nothing) in, uint8 images out."""

    @property
    def conditioning(self) -> Conditioning:
        return self.objective.conditioning

    @property
    def video(self) -> bool:
        return len(self.objective.image_shape) == 4

    def __call__(self, conditions: Sequence[int | str] | None = None, *, rows: int | None = None,
                 key: jax.Array | None = None, steps: int | None = None,
                 guidance: float | None = None) -> np.ndarray:
        """uint8 images [N, ...]: one per condition (a label), or rows unconditioned (drawn
        CHUNK_ROWS at a time)."""
        from dew.objectives.diffusion import check_guidance

        objective = self.objective
        condition = None if conditions is None else objective.conditioning.of(list(conditions))
        count = rows if condition is None else int(condition.shape[0])
        if count is None:
            raise ValueError("Give conditions (labels) or rows for unconditional samples.")
        scale = 1.0 if guidance is None else float(guidance)
        check_guidance(scale, objective.conditioning, objective.model)
        draw = jax.jit(lambda v, k, c, n: objective.sample(v, k, c, n, steps=steps, guidance=scale),
                       static_argnums=3)
        return draw_in_chunks(draw, self.variables, key if key is not None else jax.random.key(0), condition,
                              count)

    def sample(self, conditions: Sequence[int | str] | None, rows: int, key: jax.Array,
               steps: int | None, guidance: float | None) -> np.ndarray:
        return self(conditions, rows=rows, key=key, steps=steps, guidance=guidance)
