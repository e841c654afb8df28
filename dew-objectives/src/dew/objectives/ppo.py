"""Proximal policy optimization of a language model against a reward, with a learned value.

A ``PPORollout`` (``PPOObjective.rollout()``) samples one completion per
prompt with the live policy, scores it with the reward, and turns it into
per-token rewards: minus ``kl_coef`` times the log-ratio of the sampling
policy to the frozen reference at every completion token, plus the reward
at the last one. GAE(gamma, lambda) over those and the value head's
estimates gives each token's advantage (whitened over the rollout) and
return. The rollout then serves that one sample as ``minibatches``
minibatches for ``epochs`` epochs, one per step, reshuffled each epoch, and
only then samples again (the steps that serve read no prompts from the
stream, so every prompt drawn is sampled from); its position, the sample
included, is saved with checkpoints, so a resumed run continues inside the
same sample.

``kl_coef`` adapts (Ziegler et al. 2019): after each sample it moves by
``clip(kl / kl_target - 1, -0.2, 0.2) * rows / kl_horizon`` of itself.

The value head is a linear map of the policy's last hidden state (the
output of its ``features_module``, ``final_norm`` in dew's transformers),
under ``params/value_head``. The loss per completion token is

    clipped policy loss + value_coef * 0.5 * max((V - R)^2, (V_old + clip(V - V_old, ±value_clip) - R)^2)
    - entropy_coef * entropy

Validation continues held-out prompts greedily and reports their mean
``reward``; the trained policy, without its value head, is text generation
(``pipeline``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.data.base import Batch as HostBatch
from dew.errors import DewError
from dew.nn.features import check_features_module, with_features
from dew.nn.kinds import CausalDecoder
from dew.objectives.advantages import gae
from dew.objectives.base import (
    Aux,
    Batch,
    LeafFilter,
    Mean,
    Objective,
    Step,
    Variables,
    under,
)
from dew.objectives.grpo import clipped_policy_loss
from dew.objectives.policy import (
    REFERENCE,
    PolicyFrom,
    check_model_reach,
    chosen_logprobs,
    policy_pipeline,
    policy_variables,
    token_logprobs,
    with_reference,
)
from dew.objectives.rollouts import CompletionRollout, GreedyRewardValidation
from dew.rewards import resolve
from dew.sampling import Sampling, TextGeneration
from dew.training.runtime.whole_batch import host_value

if TYPE_CHECKING:
    from dew.training.initializers import WeightSource
    from dew.training.state import TrainState

__all__ = ["MinibatchSplitError", "PPOObjective", "PPORollout", "ValueHead", "policy_and_values"]


class MinibatchSplitError(DewError, ValueError):
    """PPO's minibatches do not divide a rollout's completions: the batch of prompts is no multiple of them."""

VALUE_HEAD = "value_head"


class ValueHead(nn.Module):
    """One number per position from the policy's hidden state."""

    @nn.compact
    def __call__(self, hidden: jax.Array) -> jax.Array:
        return nn.Dense(1, kernel_init=nn.initializers.zeros, name="dense")(hidden.astype(jnp.float32))[..., 0]


def policy_and_values(model: nn.Module, variables: Variables, tokens: jax.Array,
                      features_module: str = "final_norm",
                      temperature: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """log p of each next token [B, T-1] and the entropy of each prediction (both at the sampling
    temperature, as dew.objectives.policy.token_logprobs), and the value at each position."""
    params = dict(variables["params"])
    head = params.pop(VALUE_HEAD)
    logits, hidden = with_features(model, {**policy_variables(variables), "params": params}, tokens[:, :-1],
                                   features_module, head="the value head", field="PPOObjective(features_module=...)")
    values = ValueHead().apply({"params": head}, hidden)
    chosen, entropy = chosen_logprobs(logits, tokens, temperature)
    return chosen, entropy, values


class PPORollout:
    """One sample served as minibatches for several epochs, with an adaptive KL coefficient.

    Stateful: ``get_state``/``set_state`` carry the sample being served, where
    in it the next step is, and the KL coefficient.
    """

    def __init__(self, objective: PPOObjective, sampler: CompletionRollout) -> None:
        self.objective = objective
        self.sampler = sampler
        self.kl_coef = objective.kl_coef
        self.sample: dict[str, np.ndarray] | None = None
        self.order: np.ndarray | None = None
        self.served = 0
        model, features, temperature = objective.model, objective.features_module, objective.temperature
        # At the sampling temperature: old_logp is the policy that sampled, and the KL penalty compares
        # it with the reference at the same temperature.
        self._evaluate = jax.jit(lambda variables, tokens: policy_and_values(model, variables, tokens, features,
                                                                             temperature))
        self._reference = jax.jit(lambda ref, tokens: token_logprobs(model, ref, tokens, temperature)[0])

    @property
    def reward_seconds(self) -> float:
        return self.sampler.reward_seconds

    def transcript(self) -> list[dict[str, object]]:
        """What the sampler scored since the last transcript (nothing on the steps that serve a sample)."""
        return self.sampler.transcript()

    @property
    def steps_per_sample(self) -> int:
        return self.objective.epochs * self.objective.minibatches

    def reads_batch(self) -> bool:
        """Whether the next call samples (from the prompts it is given) rather than serving the sample
        it holds: the trainer draws prompts only for those steps (dew.training.protocols.Serving)."""
        return self.sample is None or self.served >= self.steps_per_sample

    def __call__(self, state: TrainState, batch: HostBatch, key: jax.Array) -> dict[str, np.ndarray]:
        if self.reads_batch():
            self._draw(state, batch, key)
        assert self.sample is not None and self.order is not None
        rows = self.sample["tokens"].shape[0]
        size = rows // self.objective.minibatches
        epoch, part = divmod(self.served, self.objective.minibatches)
        picked = self.order[epoch, part * size:(part + 1) * size]
        self.served += 1
        return {name: values[picked] for name, values in self.sample.items()}

    def _draw(self, state: TrainState, batch: HostBatch, key: jax.Array) -> None:
        objective = self.objective
        sample_key, order_key = jax.random.split(key)
        rolled = self.sampler(state, batch, sample_key)
        tokens = jnp.asarray(rolled["tokens"])
        old_logp, _, values = self._evaluate(state.params, tokens)
        reference = state.params.get(REFERENCE)
        if reference is None:  # a LoRA run keeps no copy: its reference is the base, adapters' B at zero
            from dew.adapters.lora import base_of

            reference = base_of({k: v for k, v in state.params["params"].items() if k != VALUE_HEAD})
        ref_logp = self._reference({"params": reference}, tokens)
        mask = np.asarray(rolled["mask"], np.float32)[:, 1:]
        old_logp, values, ref_logp = (host_value(x).astype(np.float32) for x in (old_logp, values, ref_logp))
        log_ratio = (old_logp - ref_logp) * mask
        rewards = -self.kl_coef * log_ratio
        last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
        rewards[np.arange(mask.shape[0]), last] += rolled["reward"]
        advantage, returns = gae(rewards, values, mask, gamma=objective.gamma, lam=objective.lam)
        on = mask > 0
        mean, std = advantage[on].mean(), advantage[on].std() + 1e-8
        advantage = np.where(on, (advantage - mean) / std, 0.0).astype(np.float32)
        kl = float(log_ratio.sum() / max(mask.sum(), 1.0))
        rows = mask.shape[0]
        objective.check_rows(rows)
        used = self.kl_coef  # the coefficient these rewards were shaped with, logged as such
        error = np.clip(kl / objective.kl_target - 1.0, -0.2, 0.2)
        self.kl_coef = float(self.kl_coef * (1.0 + error * rows / objective.kl_horizon))
        self.sample = {
            "tokens": np.asarray(rolled["tokens"], np.int32), "mask": np.asarray(rolled["mask"], np.float32),
            "reward": np.asarray(rolled["reward"], np.float32), "old_logp": old_logp, "old_values": values,
            "advantage": advantage, "returns": returns,
            "kl_coef": np.full((rows,), used, np.float32),
            # The sample's per-token mean log-ratio (the kl the coefficient adapts to) times each
            # completion's tokens: the logged kl, their sum over a minibatch's tokens, is then the
            # sample's, whichever minibatch a step trains on (its own minibatch's kl it was before).
            "kl": (kl * mask.sum(axis=1)).astype(np.float32),
        }
        rng = np.random.default_rng(np.asarray(jax.random.key_data(order_key)).ravel().tolist())
        self.order = np.stack([rng.permutation(rows) for _ in range(objective.epochs)])
        self.served = 0

    def get_state(self) -> bytes:
        buffer = io.BytesIO()
        arrays = {} if self.sample is None else {f"sample/{k}": v for k, v in self.sample.items()}
        if self.order is not None:
            arrays["order"] = self.order
        meta = json.dumps({"served": self.served, "kl_coef": self.kl_coef})
        np.savez(buffer, meta=np.frombuffer(meta.encode(), np.uint8), **arrays)  # type: ignore[arg-type]  # numpy's stub reads **arrays as its allow_pickle
        return buffer.getvalue()

    def set_state(self, state: bytes) -> None:
        with np.load(io.BytesIO(state)) as saved:
            meta = json.loads(saved["meta"].tobytes().decode())
            sample = {k.split("/", 1)[1]: saved[k] for k in saved.files if k.startswith("sample/")}
            self.order = saved["order"] if "order" in saved.files else None
        self.sample = sample or None
        self.served = int(meta["served"])
        self.kl_coef = float(meta["kl_coef"])


@dataclass(frozen=True)
class PPOObjective(GreedyRewardValidation, Objective):
    """PPO with a value head over completions a PPORollout serves (see the module docstring).

    metrics: ``reward`` (the sequence reward's mean), ``kl`` (the sampling
    policy's log-ratio to the reference, per token), ``kl_coef``,
    ``clip_fraction``, ``entropy``, ``value_loss``. Each step trains on one
    minibatch: a batch of P prompts gives steps of P / minibatches rows.
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = CausalDecoder
    heads: ClassVar[tuple[str, ...]] = (VALUE_HEAD,)

    model: nn.Module
    reward: Any = "exact_match"
    _: KW_ONLY
    max_new_tokens: int = 8
    temperature: float = 1.0
    epochs: int = 2
    minibatches: int = 2
    clip: float = 0.2
    value_clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.05
    kl_target: float = 0.1
    kl_horizon: float = 10000.0
    features_module: str = "final_norm"
    stop_token: int | None = None
    prompt_key: str = "prompt"
    prompt_length_key: str = "prompt_length"
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self.check_reward()
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError(f"PPOObjective needs epochs >= 1 and minibatches >= 1, got {self.epochs} "
                             f"and {self.minibatches}.")
        if not (self.clip >= 0 and self.value_clip >= 0):  # NaN too
            raise ValueError(f"PPOObjective.clip and value_clip must be at least 0 (ranges around a ratio of 1 and "
                             f"the old values), got {self.clip} and {self.value_clip}.")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):  # NaN too
            raise ValueError(f"PPOObjective.gamma and lam must lie in [0, 1] (GAE's discount and its "
                             f"smoothing), got {self.gamma} and {self.lam}.")
        if not (self.kl_target > 0 and self.kl_horizon > 0):
            raise ValueError(f"PPOObjective.kl_target and kl_horizon must be above 0 (the adaptive KL "
                             f"coefficient divides by both), got {self.kl_target} and {self.kl_horizon}.")
        check_model_reach("PPOObjective", self.model, stop_token=self.stop_token,
                          max_new_tokens=self.max_new_tokens)
        check_features_module(self.model, self.features_module, field="PPOObjective.features_module")
        if not self.temperature > 0:
            raise ValueError(
                f"PPOObjective.temperature must be above 0, got {self.temperature}: the rollout samples at it and "
                "scores each token by the logits divided by it, which greedy decoding (0) leaves undefined, so "
                "every loss would be NaN.")

    def check_rows(self, rows: int) -> None:
        """Refuse a rollout of rows completions that minibatches does not split (ChecksBatchRows)."""
        if rows % self.minibatches:
            raise MinibatchSplitError(
                f"PPOObjective(minibatches={self.minibatches}) does not divide the rollout of "
                f"{rows} completions; make the batch of prompts (data.batch) a multiple of minibatches."
            )

    @property
    def frozen(self) -> LeafFilter | None:  # type: ignore[override]
        return under(REFERENCE)

    @property
    def reference_collection(self) -> str | None:
        """The frozen copy of the starting policy (a LoRA run keeps none: its base is the reference)."""
        return REFERENCE

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The policy's variables (given ones pass through), a value head and the reference's copy."""
        model_key, head_key = jax.random.split(key)
        if variables is None:
            variables = self.model.init(model_key, jnp.zeros((1, 1), jnp.int32))
        variables = dict(variables)
        params = dict(variables["params"])
        if VALUE_HEAD not in params:
            _, hidden = with_features(self.model, variables, jnp.zeros((1, 1), jnp.int32), self.features_module,
                                      head="the value head", field="PPOObjective(features_module=...)")
            policy = {k: v for k, v in params.items()}
            variables = with_reference({**variables, "params": policy})
            head = ValueHead().init(head_key, hidden)["params"]
            return {**variables, "params": {**policy, VALUE_HEAD: head}}
        return with_reference(variables) if REFERENCE not in variables else variables

    def starting_weights(self, source: WeightSource) -> PolicyFrom:
        """What a recipe's init section reads narrowed to the policy (the value head starts fresh)."""
        return PolicyFrom(source, exclude=(VALUE_HEAD,))

    def rollout(self) -> PPORollout:
        """The rollout that samples, scores and serves this objective's minibatches."""
        sampler = CompletionRollout(
            self.model, resolve(self.reward), group_size=1, max_new_tokens=self.max_new_tokens,
            sampling=Sampling(temperature=self.temperature), tokenizer=self.tokenizer,
            stop_token=self.stop_token, prompt_key=self.prompt_key, prompt_length_key=self.prompt_length_key,
        )
        return PPORollout(self, sampler)

    def required_keys(self) -> Sequence[str]:
        return ("tokens", "mask", "reward", "old_logp", "old_values", "advantage", "returns")

    def pipeline(self, state: TrainState | Variables, *, sampling: Sampling | Mapping[str, Any] | None = None
                 ) -> TextGeneration:
        """The policy without its value head as text generation, stopping at stop_token."""
        return policy_pipeline(self.model, state, self.tokenizer, sampling=sampling,
                               stop_token=self.stop_token, leave_out=(VALUE_HEAD,))

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        tokens = batch["tokens"]
        mask = jnp.asarray(batch["mask"], jnp.float32)[:, 1:]
        logp, entropy, values = policy_and_values(self.model, variables, tokens, self.features_module,
                                                  self.temperature)
        policy_loss, clipped = clipped_policy_loss(logp, batch["old_logp"], batch["advantage"], self.clip)
        old_values, returns = batch["old_values"], batch["returns"]
        bounded = old_values + jnp.clip(values - old_values, -self.value_clip, self.value_clip)
        value_loss = 0.5 * jnp.maximum((values - returns) ** 2, (bounded - returns) ** 2)
        per_token = policy_loss + self.value_coef * value_loss - self.entropy_coef * entropy
        count = jnp.sum(mask)
        metrics: dict[str, Mean | jax.Array] = {
            "reward": Mean.of(batch["reward"]),
            "kl": Mean(jnp.sum(batch["kl"]), count),
            "clip_fraction": Mean(jnp.sum(clipped * mask), count),
            "entropy": Mean(jnp.sum(entropy * mask), count),
            "value_loss": Mean(jnp.sum(value_loss * mask), count),
        }
        if "kl_coef" in batch:
            metrics["kl_coef"] = Mean.of(batch["kl_coef"])
        return Mean(jnp.sum(per_token * mask), count), Aux(metrics=metrics)

