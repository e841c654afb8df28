"""How the next token is chosen from the model's logits."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dew.errors import DewError

__all__ = ["InvalidSamplingError", "Sampling", "choose", "filter_logits"]


class InvalidSamplingError(DewError, ValueError):
    """A Sampling setting is out of its range: field, what it must be, and the value given."""

    def __init__(self, field: str, wanted: str, value: object) -> None:
        self.field, self.wanted, self.value = field, wanted, value
        optional = "" if field == "temperature" else " or None"
        super().__init__(f"Sampling.{field} must be {wanted}{optional}, got {value!r}.")

    def __reduce__(self) -> tuple[type, tuple[str, str, object]]:
        return type(self), (self.field, self.wanted, self.value)


_SMALLEST_TEMPERATURE = float(jnp.finfo(jnp.float32).tiny)  # 1.18e-38
_LARGEST_TOP_K = 2**31 - 1  # the engine holds top-k as int32; any k above the vocabulary keeps all of it


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    """Temperature, then top-k, top-p (nucleus) and min-p filtering, then a random draw.

    temperature=0 is greedy: the most likely token every time, with no draw.
    top_k keeps the k most likely tokens; top_p keeps the smallest set of most
    likely tokens whose probability reaches top_p; min_p keeps the tokens at
    least min_p times as likely as the most likely one. None turns a filter off.

    >>> Sampling(temperature=0.7, top_k=40)
    Sampling(temperature=0.7, top_k=40, top_p=None, min_p=None)
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        if not (_number(self.temperature)
                and (self.temperature == 0.0 or _SMALLEST_TEMPERATURE <= self.temperature < float("inf"))):
            # below float32's smallest normal number the device flushes it to 0: neither greedy nor a draw
            raise InvalidSamplingError("temperature", f"0 (greedy) or a finite number >= {_SMALLEST_TEMPERATURE:.3g}",
                                       self.temperature)
        if self.top_k is not None and not (_number(self.top_k) and float(self.top_k).is_integer()
                                           and self.top_k >= 1):
            raise InvalidSamplingError("top_k", "a whole number >= 1", self.top_k)
        if self.top_p is not None and not (_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidSamplingError("top_p", "above 0 and at most 1", self.top_p)
        if self.min_p is not None and not (_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidSamplingError("min_p", "between 0 and 1", self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """Whether a filter (top-k, top-p or min-p) is on, which costs a sort of the vocabulary."""
        return not self.greedy and (self.top_k is not None or self.top_p is not None
                                    or self.min_p is not None)

    def as_row(self) -> tuple[float, int, float, float]:
        """(temperature, top_k, top_p, min_p) with the filters that are off as 0, 0, 1 and 0."""
        return (float(self.temperature), min(int(self.top_k or 0), _LARGEST_TOP_K),
                1.0 if self.top_p is None else float(self.top_p), float(self.min_p or 0.0))


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, *, filtered: bool = True) -> jax.Array:
    """Scaled and filtered logits [B, V], one setting per row (Sampling.as_row's values).

    Each row is shifted so its largest logit is 0 and divided by its temperature
    (rows at 0 are left unscaled: they are greedy), so a temperature near float32's
    smallest normal number sends the others to -inf rather than the largest to +inf.
    Logits already at the lowest float (ids a caller excluded) stay there at any
    temperature. Then top-k, top-p and min-p set the tokens they drop to the
    lowest float, so a draw from the result never picks them. filtered=False
    skips the filters (and their sort) when no row uses one.
    """
    logits = logits.astype(jnp.float32)
    excluded = jnp.finfo(jnp.float32).min
    scale = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    logits = jnp.where(logits <= excluded, excluded, shifted / scale[:, None])
    if not filtered:
        return logits
    rows, vocab = logits.shape
    # likeliest first; of tied tokens the higher id first, so a top-p cut through a tie keeps the ids
    # transformers' TopPLogitsWarper keeps when its ascending sort is stable (it drops the lower ids first)
    order = vocab - 1 - jnp.argsort(-logits[:, ::-1], axis=-1)
    ordered = jnp.take_along_axis(logits, order, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.int32)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    survivors = ordered >= kth  # top-k keeps the tokens tied with the k-th, as transformers does
    ordered = jnp.where(survivors, ordered, excluded)
    probabilities = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probabilities, axis=-1) - probabilities
    # top-p keeps tokens by rank until their mass reaches top_p (a tie at the cut is not all kept,
    # as transformers' TopPLogitsWarper); the likeliest is always kept.
    kept_sorted = survivors & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    kept = jnp.zeros_like(kept_sorted).at[jnp.arange(rows)[:, None], order].set(kept_sorted)
    logits = jnp.where(kept, logits, excluded)
    floor = ordered[:, :1] + jnp.log(jnp.maximum(min_p, 1e-38))[:, None]  # p >= min_p * p_max
    return jnp.where((min_p[:, None] > 0) & (logits < floor), excluded, logits)


def choose(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Pick one token id per row of logits [B, V] as sampling says; returns int32 [B]."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    rows = logits.shape[0]
    temperature, top_k, top_p, min_p = (jnp.full((rows,), value) for value in sampling.as_row())
    logits = filter_logits(logits, temperature, top_k, top_p, min_p, filtered=sampling.filtered)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
