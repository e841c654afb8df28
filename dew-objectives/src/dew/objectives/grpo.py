"""Group relative policy optimization: completions of one prompt compete for their reward.

Each step's batch comes from a ``CompletionRollout`` (``GRPOObjective.rollout()``):
``group_size`` completions sampled per prompt with the live policy, their
rewards, and their tokens' log-probabilities under the policy that sampled
them. Rows are grouped in consecutive runs of ``group_size``; each row's
advantage is its reward less its group's mean, divided by the group's
standard deviation (``scale_rewards``). The loss per completion token is

    -(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) - beta * k3)

with ratio = pi / pi_old and k3 = exp(ref - logp) - (ref - logp) - 1, the
KL estimator against a frozen reference (a copy of the starting policy). It
is averaged over all completion tokens of the batch (``normalize="token"``)
or over each completion, then over completions (``"sequence"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

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
from dew.objectives.policy import (
    REFERENCE,
    PolicyFrom,
    policy_pipeline,
    policy_variables,
    reference_variables,
    token_logprobs,
    with_reference,
)
from dew.objectives.rollouts import CompletionRollout, RewardMetric, greedy_outputs
from dew.rewards import resolve
from dew.sampling import Sampling, TextGeneration

if TYPE_CHECKING:
    from dew.training.initializers import WeightSource

__all__ = ["GRPOObjective", "GroupSizeError", "group_advantages", "clipped_policy_loss"]


class GroupSizeError(ValueError):
    """The group size does not divide the number of rows in the batch."""


def group_advantages(reward: jax.Array, group_size: int, *, scale: bool = True, eps: float = 1e-4) -> jax.Array:
    """Each reward less its group's mean (over consecutive runs of group_size), over the group's std.

    >>> [round(float(a), 3) for a in group_advantages(jnp.array([1.0, 0.0, 2.0, 2.0]), 2)]
    [1.0, -1.0, 0.0, 0.0]
    """
    rows = reward.shape[0]
    if rows % group_size:
        raise GroupSizeError(
            f"group_size={group_size} does not divide the batch of {rows} rows; each prompt's "
            f"{group_size} completions must sit together. Make the batch a multiple of {group_size} "
            "(prompts x group_size) or change group_size."
        )
    groups = reward.reshape(rows // group_size, group_size).astype(jnp.float32)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (groups.std(axis=1, keepdims=True) + eps)
    return centred.reshape(rows)


def clipped_policy_loss(logp: jax.Array, old_logp: jax.Array, advantage: jax.Array,
                        clip: float) -> tuple[jax.Array, jax.Array]:
    """Minus the clipped surrogate per token, and where the ratio was clipped (1.0) or not."""
    ratio = jnp.exp(logp - old_logp)
    advantage = advantage[:, None] if advantage.ndim == 1 else advantage
    surrogate = jnp.minimum(ratio * advantage, jnp.clip(ratio, 1.0 - clip, 1.0 + clip) * advantage)
    clipped = (jnp.abs(ratio - 1.0) > clip).astype(jnp.float32)
    return -surrogate, clipped


def token_mean(values: jax.Array, mask: jax.Array, normalize: str) -> Mean:
    """values averaged over the mask: over all tokens, or per row then over rows."""
    if normalize == "sequence":
        per_row = jnp.sum(values * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
        return Mean(jnp.sum(per_row), jnp.asarray(per_row.shape[0], jnp.float32))
    return Mean(jnp.sum(values * mask), jnp.sum(mask))


@dataclass(frozen=True)
class GRPOObjective(Objective):
    """GRPO over completions a rollout samples (see the module docstring).

    reward is a registered reward's name, ``{"name": ..., **fields}``, or a
    callable. metrics: ``reward`` (its mean over the batch), ``kl`` (k3, per
    token), ``clip_fraction`` (tokens whose ratio was clipped) and
    ``entropy`` (of the policy's next-token distribution, per token).
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})

    model: nn.Module
    reward: Any = "exact_match"
    _: KW_ONLY
    group_size: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    clip: float = 0.2
    beta: float = 0.04
    scale_rewards: bool = True
    normalize: Literal["token", "sequence"] = "token"
    stop_token: int | None = None
    prompt_key: str = "prompt"
    prompt_length_key: str = "prompt_length"
    tokenizer: Any = None

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"GRPOObjective.group_size must be at least 2 (a group compares "
                             f"completions), got {self.group_size}.")

    @property
    def reference_collection(self) -> str | None:
        """The collection holding the frozen copy of the starting policy (None: no copy is kept).

        ``adapters_only`` reads it to keep no copy: with LoRA the reference is the base model.
        """
        return REFERENCE if self.beta > 0 else None

    @property
    def frozen(self) -> LeafFilter | None:  # type: ignore[override]
        return under(REFERENCE) if self.beta > 0 else None

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The policy's variables (given ones pass through) and, when beta > 0, the reference's copy."""
        if variables is None:
            variables = self.model.init(key, jnp.zeros((1, 1), jnp.int32))
        return with_reference(variables) if self.beta > 0 else policy_variables(variables)

    def starting_weights(self, source: WeightSource) -> PolicyFrom:
        """What a recipe's init section reads narrowed to the policy's parameters (the reference copies them)."""
        return PolicyFrom(source)

    def rollout(self) -> CompletionRollout:
        """The rollout that samples and scores this objective's completions."""
        return CompletionRollout(
            self.model, resolve(self.reward), group_size=self.group_size,
            max_new_tokens=self.max_new_tokens, sampling=Sampling(temperature=self.temperature),
            tokenizer=self.tokenizer, stop_token=self.stop_token, prompt_key=self.prompt_key,
            prompt_length_key=self.prompt_length_key,
        )

    def required_keys(self) -> Sequence[str]:
        return ("tokens", "mask", "reward", "old_logp")

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, Any]:
        """Held-out prompts continued greedily by the policy, for ``metrics`` to score."""
        return greedy_outputs(self.model, policy_variables(variables), batch, step.key,
                              self.max_new_tokens, self.prompt_key, self.prompt_length_key)

    def metrics(self) -> tuple[Metric, ...]:
        """The mean reward of the greedy completions of the validation prompts."""
        return (RewardMetric(resolve(self.reward), tokenizer=self.tokenizer, stop_token=self.stop_token),)

    def pipeline(self, state: Any, *, sampling: Sampling | Mapping[str, Any] | None = None
                 ) -> TextGeneration:
        """The policy as text generation (greedy unless sampling says otherwise), stopping at stop_token."""
        return policy_pipeline(self.model, state, self.tokenizer, sampling=sampling,
                               stop_token=self.stop_token)

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        tokens, reward = batch["tokens"], jnp.asarray(batch["reward"], jnp.float32)
        mask = jnp.asarray(batch["mask"], jnp.float32)[:, 1:]
        advantage = group_advantages(reward, self.group_size, scale=self.scale_rewards)
        logp, entropy = token_logprobs(self.model, policy_variables(variables), tokens)
        per_token, clipped = clipped_policy_loss(logp, batch["old_logp"], advantage, self.clip)
        metrics: dict[str, Any] = {
            "reward": Mean.of(reward),
            "clip_fraction": Mean(jnp.sum(clipped * mask), jnp.sum(mask)),
            "entropy": Mean(jnp.sum(entropy * mask), jnp.sum(mask)),
        }
        if self.beta > 0:
            ref_logp, _ = token_logprobs(self.model, reference_variables(variables), tokens)
            delta = jax.lax.stop_gradient(ref_logp) - logp
            k3 = jnp.exp(delta) - delta - 1.0
            per_token = per_token + self.beta * k3
            metrics["kl"] = Mean(jnp.sum(k3 * mask), jnp.sum(mask))
        return token_mean(per_token, mask, self.normalize), Aux(metrics=metrics)


