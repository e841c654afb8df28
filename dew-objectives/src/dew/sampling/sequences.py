"""The engine's host-side records: one per sample, one per prompt whose samples share it."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling.requests import Completion, Finish, Request, SequenceState

__all__ = ["PromptGroup", "Sample", "sample_keys"]


@dataclass(eq=False)
class Sample:
    """One sample on the host: what it produced, and the blocks its table points at."""

    id: int
    request: int
    sample: int
    spec: Request
    key: np.ndarray
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return list(self.spec.prompt) + self.generated

    @property
    def remaining(self) -> int:
        return self.spec.max_new_tokens - len(self.generated)

    def completion(self, reason: Finish) -> Completion:
        return Completion(self.id, self.request, self.sample, self.spec.prompt,
                          tuple(self.generated), tuple(self.logprobs), reason, self.preemptions)

    def state(self) -> SequenceState:
        return SequenceState(self.id, self.request, self.sample, self.spec,
                             tuple(int(x) for x in self.key), tuple(self.generated),
                             tuple(self.logprobs), self.preemptions)

    @classmethod
    def from_state(cls, state: SequenceState) -> Sample:
        return cls(state.id, state.request, state.sample, state.spec,
                   np.asarray(state.key, np.uint32), list(state.generated), list(state.logprobs),
                   preemptions=state.preemptions)


@dataclass(eq=False)
class PromptGroup:
    """Samples that continue the same tokens: written once, then each sample forks the blocks.

    Positions [0, written) are in the cache; all tokens but the last are
    written before the samples start (the last is each sample's first input).
    """

    tokens: list[int]
    members: collections.deque[Sample]
    blocks: list[int] = field(default_factory=list)
    written: int = 0

    @property
    def target(self) -> int:
        return len(self.tokens) - 1


@jax.jit
def _fold(key: jax.Array, indices: jax.Array) -> jax.Array:
    return jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(indices)


def sample_keys(key: jax.Array, count: int) -> np.ndarray:
    """The key data of ``fold_in(key, j)`` for j < count, in one call."""
    return np.asarray(_fold(key, jnp.arange(count, dtype=jnp.uint32)))
