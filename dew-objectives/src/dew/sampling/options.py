"""How the next token is chosen from the model's logits."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dew.errors import DewError

__all__ = ["InvalidSamplingError", "Sampling", "choose"]


class InvalidSamplingError(DewError, ValueError):
    """A Sampling setting is out of its range."""


@dataclass(frozen=True)
class Sampling:
    """Temperature, then top-k, then nucleus (top-p) filtering, then a random draw.

    temperature=0 is greedy: the most likely token every time, with no draw.
    top_k keeps the k most likely tokens; top_p keeps the smallest set of most
    likely tokens whose probability reaches top_p. None turns a filter off.

    >>> Sampling(temperature=0.7, top_k=40)
    Sampling(temperature=0.7, top_k=40, top_p=None)
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidSamplingError(
                f"Sampling.temperature must be >= 0 (0 is greedy), got {self.temperature}."
            )
        if self.top_k is not None and (isinstance(self.top_k, bool) or int(self.top_k) != self.top_k
                                       or self.top_k < 1):
            raise InvalidSamplingError(
                f"Sampling.top_k must be a positive integer or None, got {self.top_k!r}."
            )
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingError(
                f"Sampling.top_p must lie in (0, 1] or be None, got {self.top_p!r}."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choose(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Pick one token id per row of logits [B, V] as sampling says; returns int32 [B]."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    excluded = jnp.finfo(jnp.float32).min
    if sampling.top_k is not None:
        k = min(int(sampling.top_k), logits.shape[-1])
        kth = jax.lax.top_k(logits, k)[0][:, -1:]
        logits = jnp.where(logits < kth, excluded, logits)
    if sampling.top_p is not None:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probabilities = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probabilities, axis=-1) - probabilities
        kept = before < sampling.top_p  # the most likely token is always kept
        threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, excluded, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
