"""The pieces the GRPO family is written in: group baselines, importance ratios, policy losses, aggregation.

Each is a pure function of arrays (rewards [B], log-probabilities and masks
[B, T]), so the objectives in ``grpo.py`` and ``grpo_family.py`` compose
them and a test can hold each against the paper's formula. Rows come in
consecutive groups of ``group_size`` completions of one prompt.

- baselines: the group mean (GRPO, Dr.GRPO, DAPO) or the mean of the group's
  other rows (RLOO), optionally divided by the group's standard deviation;
- ratios: per token (GRPO), per sequence with a length-normalized log-ratio
  (GSPO), or the sequence's value with each token's gradient (GSPO-token);
- losses: PPO's clipped surrogate with asymmetric bounds (DAPO's clip-higher),
  or CISPO's stop-gradient clipped weight on each token's log-probability;
- aggregation: over all tokens, per sequence then over sequences, or a sum
  over tokens under a constant length (Dr.GRPO).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from dew.errors import DewError
from dew.objectives.base import Mean

__all__ = [
    "Aggregation",
    "Baseline",
    "GroupSizeError",
    "PolicyLoss",
    "RatioLevel",
    "aggregate",
    "clipped_policy_loss",
    "group_advantages",
    "importance_log_ratio",
    "policy_loss",
]

Baseline = Literal["mean", "leave_one_out"]
RatioLevel = Literal["token", "sequence", "sequence_token"]
PolicyLoss = Literal["clip", "cispo"]
Aggregation = Literal["token", "sequence", "constant"]


class GroupSizeError(DewError, ValueError):
    """The group size does not divide the number of rows in the batch."""


def group_advantages(reward: jax.Array, group_size: int, *, scale: bool = True, eps: float = 1e-4,
                     baseline: Baseline = "mean", ddof: int = 1) -> jax.Array:
    """Each reward less its group's baseline, over the group's std when scale.

    The baseline is the group's mean, or (``leave_one_out``, RLOO) the mean
    of the group's other rewards: r_i - (sum_j r_j - r_i) / (G - 1). The
    std is the sample std (divided by G - ddof, G - 1 by default), as TRL's
    GRPOTrainer takes it, so the same rewards give the same advantages there
    and here; Flow-GRPO's reference code divides by G (ddof=0).

    >>> [round(float(a), 3) for a in group_advantages(jnp.array([1.0, 0.0, 2.0, 2.0]), 2)]
    [0.707, -0.707, 0.0, 0.0]
    >>> [round(float(a), 3) for a in group_advantages(jnp.array([3.0, 0.0, 0.0]), 3, scale=False,
    ...                                               baseline="leave_one_out")]
    [3.0, -1.5, -1.5]
    """
    rows = reward.shape[0]
    if rows % group_size:
        raise GroupSizeError(
            f"group_size={group_size} does not divide the batch of {rows} rows; each prompt's "
            f"{group_size} completions must sit together. Make the batch a multiple of {group_size} "
            "(prompts x group_size) or change group_size."
        )
    groups = reward.reshape(rows // group_size, group_size).astype(jnp.float32)
    total = groups.sum(axis=1, keepdims=True)
    if baseline == "leave_one_out":
        centred = groups - (total - groups) / max(group_size - 1, 1)
    else:
        centred = groups - total / group_size
    if scale:
        centred = centred / (groups.std(axis=1, ddof=ddof if group_size > ddof else 0, keepdims=True) + eps)
    return centred.reshape(rows)


def importance_log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array,
                         level: RatioLevel = "token") -> jax.Array:
    """log(pi / pi_old) for each token [B, T], at the level the ratio is taken.

    ``sequence`` (GSPO): every token of row i carries
    s_i = mean over the row's masked tokens of log pi - log pi_old, so the
    ratio exp(s_i) is one number per sequence and its gradient is the mean
    of the tokens'. ``sequence_token`` (GSPO-token): the value of s_i, with
    each token's own gradient: sg(s_i) + log pi_t - sg(log pi_t).
    """
    delta = logp - old_logp
    if level == "token":
        return delta
    per_row = jnp.sum(delta * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    if level == "sequence":
        return jnp.broadcast_to(per_row[:, None], delta.shape)
    return jax.lax.stop_gradient(per_row)[:, None] + logp - jax.lax.stop_gradient(logp)


def policy_loss(logp: jax.Array, old_logp: jax.Array, advantage: jax.Array, mask: jax.Array, *,
                clip_low: float, clip_high: float, level: RatioLevel = "token",
                loss: PolicyLoss = "clip") -> tuple[jax.Array, jax.Array]:
    """The policy's loss per token [B, T], and where the ratio left [1 - clip_low, 1 + clip_high] (1.0).

    ``clip``: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) with r the
    ratio at ``level``. ``cispo``: -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi,
    every token's gradient kept, its weight bounded.
    """
    ratio = jnp.exp(importance_log_ratio(logp, old_logp, mask, level))
    advantage = advantage[:, None] if advantage.ndim == 1 else advantage
    bounded = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    if loss == "cispo":
        per_token = -jax.lax.stop_gradient(bounded) * advantage * logp
    else:
        per_token = -jnp.minimum(ratio * advantage, bounded * advantage)
    clipped = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).astype(jnp.float32)
    return per_token, clipped


def clipped_policy_loss(logp: jax.Array, old_logp: jax.Array, advantage: jax.Array,
                        clip: float, clip_high: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Minus PPO's clipped surrogate per token, and where the ratio was clipped (1.0) or not."""
    high = clip if clip_high is None else clip_high
    return policy_loss(logp, old_logp, advantage, jnp.ones_like(logp), clip_low=clip, clip_high=high)


def aggregate(values: jax.Array, mask: jax.Array, how: Aggregation, length: float = 1.0) -> Mean:
    """values averaged over the mask, as a Mean that adds up over microbatches and shards.

    ``token``: over all masked tokens (DAPO's token-level loss). ``sequence``:
    per row over its tokens, then over rows (GRPO, GSPO). ``constant``: each
    row's sum over its tokens divided by ``length``, then averaged over rows
    (Dr.GRPO, with the generation budget as the length).
    """
    if how == "sequence":
        per_row = jnp.sum(values * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
        return Mean(jnp.sum(per_row), jnp.asarray(per_row.shape[0], jnp.float32))
    if how == "constant":
        return Mean(jnp.sum(values * mask) / length, jnp.asarray(values.shape[0], jnp.float32))
    return Mean(jnp.sum(values * mask), jnp.sum(mask))
