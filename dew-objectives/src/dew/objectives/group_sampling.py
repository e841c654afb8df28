"""DAPO's host-side filters around any group sampler: dynamic sampling and overlong shaping.

``GroupFilter`` wraps the call that samples and scores ``group_size``
completions per prompt (``CompletionRollout`` today, any callable
``sampler(state, batch, key) -> {"tokens", "mask", "reward", "old_logp", ...}``
with rows in consecutive groups), so it does not depend on how completions
are generated:

- overlong shaping (``OverlongShaping``) either adds DAPO's soft penalty to
  the reward of completions that come within ``buffer`` tokens of the budget,

      R_length(|y|) = 0                        if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                      -1                       if |y| > L_max

  (times ``penalty``, with L_max = max_new_tokens and L_cache = buffer), or
  removes truncated completions (no stop token) from the loss by zeroing
  their mask, while their reward still counts in their group's baseline;
- dynamic sampling drops every group whose (raw) rewards are all equal,
  since its advantages are all zero, and samples further prompts until the
  batch holds as many groups of varied rewards as its prompts, at most
  ``max_rounds`` samplings per step. The further prompts are the training
  stream's next batches (the Trainer hands the stream to a rollout that has
  ``draw_from``; called alone, the filter samples the same prompts again).
  If the rounds run out, groups of equal rewards fill the rest. In a pool of
  processes every process samples as many rounds as the one that needs most.

The counts are added to the batch, one value per row, so the objective logs
them as metrics: ``dropped_groups`` (left out, all equal), ``filler_groups``
(all equal, kept for want of others), ``sampling_rounds``, ``sampled_reward``
(the raw reward's mean over everything sampled) and ``truncated``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import jax
import numpy as np

from dew.data.base import Batch as HostBatch
from dew.errors import DewError
from dew.objectives.group_losses import GroupSizeError
from dew.training.protocols import RewardTimed, Transcribed

if TYPE_CHECKING:
    from dew.training.state import TrainState

__all__ = ["GroupFilter", "IncompatibleOptionsError", "OverlongShaping", "overlong_penalty"]


class IncompatibleOptionsError(DewError, ValueError):
    """Two options of an objective that cannot be used together (the message names both fields)."""


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int) -> np.ndarray:
    """DAPO's soft overlong punishment R_length for completions of the given lengths.

    >>> overlong_penalty(np.array([2, 6, 7, 8, 9]), max_new_tokens=8, buffer=4).tolist()
    [0.0, -0.5, -0.75, -1.0, -1.0]
    """
    lengths = np.asarray(lengths, np.float64)
    start = max_new_tokens - buffer
    ramp = (start - lengths) / buffer
    return np.where(lengths <= start, 0.0, np.where(lengths <= max_new_tokens, ramp, -1.0)).astype(np.float32)


@dataclass(frozen=True)
class OverlongShaping:
    """Shape the rewards (``penalty``) or the mask (``mask``) of completions near or past the budget."""

    mode: Literal["penalty", "mask"]
    max_new_tokens: int
    buffer: int
    penalty: float
    stops: tuple[int, ...]

    def __call__(self, tokens: np.ndarray, mask: np.ndarray, reward: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shaped reward [B] and mask [B, L], and which completions were truncated (1.0) [B]."""
        lengths = mask.sum(axis=1)
        last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)
        ends = tokens[np.arange(tokens.shape[0]), last]
        truncated = (~np.isin(ends, self.stops) & (lengths > 0)).astype(np.float32)
        if self.mode == "penalty":
            shaped = overlong_penalty(lengths, self.max_new_tokens, self.buffer)
            return (reward + self.penalty * shaped).astype(np.float32), mask, truncated
        return reward, (mask * (1.0 - truncated)[:, None]).astype(np.float32), truncated


def _everywhere(done: bool) -> bool:
    """Whether every process of the pool is done (alone: whether this one is).

    The sampler runs compiled programs over the pool's devices, so every
    process samples the same number of rounds: one that is full early
    samples on, and keeps the groups it needs.
    """
    if jax.process_count() == 1:
        return done
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(done))))


class GroupFilter:
    """Dynamic sampling and overlong shaping around a group sampler (see the module docstring)."""

    def __init__(self, sampler: Callable[[TrainState, HostBatch, jax.Array], HostBatch], *,
                 group_size: int, dynamic: bool, max_rounds: int = 4,
                 shaping: OverlongShaping | None = None, max_lag: int = 0) -> None:
        if dynamic and group_size < 2:
            raise IncompatibleOptionsError(
                f"dynamic sampling needs group_size >= 2, got {group_size}: a group of one always has "
                "equal rewards."
            )
        self.sampler = sampler
        self.group_size = group_size
        self.dynamic = dynamic
        self.max_rounds = max_rounds
        self.shaping = shaping
        self.max_lag = max_lag  # run ahead by the trainer (dew.training.protocols.Lagging), 0: on-policy
        self._more: Callable[[], HostBatch] | None = None

    @property
    def reward_seconds(self) -> float:
        """The seconds the sampler's reward took (the goodput split shows them apart)."""
        return float(self.sampler.reward_seconds) if isinstance(self.sampler, RewardTimed) else 0.0

    def transcript(self) -> list[dict[str, object]]:
        """What the sampler scored since the last transcript, every round of dynamic sampling included."""
        return self.sampler.transcript() if isinstance(self.sampler, Transcribed) else []

    def draw_from(self, more: Callable[[], HostBatch]) -> None:
        """Refill from more() (the training stream's next batch of prompts) instead of the same prompts."""
        self._more = more

    def __call__(self, state: TrainState, batch: HostBatch, key: jax.Array) -> dict[str, np.ndarray]:
        out = self._sample(state, batch, key)
        rows = out["reward"].shape[0]
        if rows % self.group_size:
            raise GroupSizeError(f"The sampler returned {rows} rows, not a multiple of group_size="
                                 f"{self.group_size}.")
        wanted = rows // self.group_size
        raw = [out.pop("raw")]
        if not self.dynamic:
            return {**out, "sampled_reward": np.full(rows, raw[0].mean(), np.float32)}
        varied: list[dict[str, np.ndarray]] = []
        equal: list[dict[str, np.ndarray]] = []
        rounds = 0
        while True:
            for group in self._groups(out, raw[-1]):
                (equal if group.pop("equal") else varied).append(group)
            rounds += 1
            if rounds >= self.max_rounds or _everywhere(len(varied) >= wanted):
                break
            source = self._more() if self._more is not None else batch
            out = self._sample(state, source, jax.random.fold_in(key, rounds))
            raw.append(out.pop("raw"))
        filler = max(wanted - len(varied), 0)
        chosen = varied[:wanted] + equal[:filler]
        result = {name: np.concatenate([g[name] for g in chosen]) for name in chosen[0]}
        stats = {"sampled_reward": float(np.concatenate(raw).mean()),
                 "dropped_groups": len(equal) - filler, "filler_groups": filler, "sampling_rounds": rounds}
        return {**result, **{name: np.full(rows, value, np.float32) for name, value in stats.items()}}

    def _sample(self, state: TrainState, batch: HostBatch, key: jax.Array) -> dict[str, np.ndarray]:
        out = {name: np.asarray(value) for name, value in self.sampler(state, batch, key).items()}
        out["raw"] = np.asarray(out["reward"], np.float32)
        if self.shaping is not None:
            out["reward"], out["mask"], out["truncated"] = self.shaping(out["tokens"], out["mask"], out["raw"])
        return out

    def _groups(self, out: Mapping[str, np.ndarray], raw: np.ndarray) -> list[dict[str, Any]]:
        g = self.group_size
        groups = []
        for start in range(0, raw.shape[0], g):
            group: dict[str, Any] = {name: value[start:start + g] for name, value in out.items()}
            group["equal"] = bool(np.all(raw[start:start + g] == raw[start]))
            groups.append(group)
        return groups
