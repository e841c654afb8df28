"""The conditioning a generative model reads, described once for training, guidance and pipelines.

A conditioning spec says where the condition sits in a batch (``key``), checks
it (``read``), makes the null condition classifier-free guidance trains and
samples with (``null``), and turns what a person asks for into model input
(``of``). ``ClassLabels`` reads int labels [B]; ``TextTokens`` reads token
ids [B, length] for the model's trainable text encoder; ``Unconditional``
reads nothing. :func:`conditioning_of` derives the spec from a model's
fields (``num_classes``, ``text_vocab_size``, ``text_length``).

>>> import jax.numpy as jnp
>>> labels = ClassLabels(num_classes=10)
>>> [int(v) for v in labels.read({"label": jnp.asarray([3, 7])})], [int(v) for v in labels.null(2)]
([3, 7], [10, 10])
>>> labels.of([11])
Traceback (most recent call last):
...
dew.inputs.InvalidConditionError: Batch key 'label' holds 11, but the model was built for num_classes=10: labels must lie in [0, 9].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dew.errors import BatchKeyError, DewError

__all__ = [
    "ClassLabels",
    "Conditioning",
    "InvalidConditionError",
    "MissingConditionError",
    "TextTokens",
    "Unconditional",
    "conditioning_of",
]


class InvalidConditionError(DewError, ValueError):
    """A condition's values lie outside what the model was built for."""


# The batch lacks the key a conditional model reads its condition from: dew's one batch-key error.
MissingConditionError = BatchKeyError


class Conditioning(Protocol):
    """What objectives and pipelines need of a condition."""

    @property
    def key(self) -> str | None: ...

    def read(self, batch: Mapping[str, Any], *, traced_check: bool = True) -> jax.Array | None: ...

    def check_batch(self, batch: Mapping[str, Any]) -> None: ...

    def null(self, rows: int) -> jax.Array | None: ...

    def of(self, requests: Sequence[Any]) -> jax.Array | None: ...


def _check_on_host(check: Callable[[np.ndarray], None], values: jax.Array, low: int,
                   high: int, traced: bool = True) -> None:
    """Run check now on concrete values; on traced ones (when traced), call it from the
    compiled program only when a value falls outside [low, high].

    Even a callback that never fires makes a CPU program run synchronously
    with its caller, so a training step leaves it out (traced=False): the
    trainer refuses a bad batch on the host first (``check_batch``).
    """
    if isinstance(values, jax.core.Tracer):
        if not traced:
            return
        bad = jnp.any((values < low) | (values > high))
        jax.lax.cond(bad, lambda v: jax.debug.callback(lambda w: check(np.asarray(w)), v),
                     lambda v: None, values)
    else:
        check(np.asarray(values))


def _take(batch: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in batch:
        raise MissingConditionError(
            f"The model is conditioned on {what} under the batch key {key!r}, but the batch "
            f"has keys {sorted(batch)}; add {key!r} or build an unconditional model.")
    return batch[key]


@dataclass(frozen=True)
class Unconditional:
    """No condition: read, null and of all give None."""

    key: str | None = None

    def read(self, batch: Mapping[str, Any], *, traced_check: bool = True) -> None:
        return None

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        return None

    def null(self, rows: int) -> None:
        return None

    def of(self, requests: Sequence[Any]) -> None:
        if len(requests) and any(r is not None for r in requests):
            raise InvalidConditionError(
                f"The model is unconditional, but conditions {list(requests)[:4]} were asked "
                "for; sample without them or train a conditional model.")
        return None


@dataclass(frozen=True)
class ClassLabels:
    """Integer class labels [B] in [0, num_classes); num_classes itself is the null label.

    A batch may hold the null label (examples without a class); a request
    (``of``) may not.
    """

    num_classes: int
    key: str = "label"

    def __post_init__(self) -> None:
        if self.num_classes < 1:
            raise ValueError(f"ClassLabels.num_classes must be at least 1, got {self.num_classes}.")

    def check(self, labels: np.ndarray, *, allow_null: bool = False) -> None:
        """Raise InvalidConditionError naming the first label out of range."""
        top = self.num_classes if allow_null else self.num_classes - 1
        bad = labels[(labels < 0) | (labels > top)]
        if bad.size:
            raise InvalidConditionError(
                f"Batch key {self.key!r} holds {int(bad.flat[0])}, but the model was built for "
                f"num_classes={self.num_classes}: labels must lie in [0, {self.num_classes - 1}]"
                + (f" ({self.num_classes} is the null label)." if allow_null else "."))

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse, on the host, a batch whose labels lie outside [0, num_classes]."""
        if self.key in batch:
            self.check(np.asarray(batch[self.key]), allow_null=True)

    def read(self, batch: Mapping[str, Any], *, traced_check: bool = True) -> jax.Array:
        labels = _take(batch, self.key, "class labels")
        # A batch value is whatever the reader yields (an array, a tracer, a list): probed.
        if getattr(labels, "ndim", None) != 1 or not jnp.issubdtype(labels.dtype, jnp.integer):
            raise BatchKeyError(
                f"Batch key {self.key!r} must hold integer labels [batch], got "
                f"{getattr(labels, 'dtype', type(labels).__name__)} of shape "
                f"{tuple(getattr(labels, 'shape', ()))}.")
        _check_on_host(lambda v: self.check(v, allow_null=True), labels, 0, self.num_classes,
                       traced_check)
        return jnp.asarray(labels, jnp.int32)

    def null(self, rows: int) -> jax.Array:
        return jnp.full((rows,), self.num_classes, jnp.int32)

    def of(self, requests: Sequence[int]) -> jax.Array:
        labels = np.asarray(list(requests), np.int64).reshape(-1)
        self.check(labels)
        return jnp.asarray(labels, jnp.int32)


@dataclass(frozen=True)
class TextTokens:
    """Token ids [B, length] for the model's text encoder; id vocab_size is the null token.

    ``of`` encodes strings with tokenizer (anything with ``encode(str) -> ids``),
    cut to length and padded with pad_id.
    """

    vocab_size: int
    length: int
    key: str = "caption"
    pad_id: int = 0
    tokenizer: Any = None

    def check(self, ids: np.ndarray) -> None:
        bad = ids[(ids < 0) | (ids > self.vocab_size)]
        if bad.size:
            raise InvalidConditionError(
                f"Batch key {self.key!r} holds token id {int(bad.flat[0])}, but the text encoder "
                f"was built for text_vocab_size={self.vocab_size}: ids must lie in "
                f"[0, {self.vocab_size - 1}] ({self.vocab_size} is the null token).")

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse, on the host, a batch whose token ids lie outside [0, vocab_size]."""
        if self.key in batch:
            self.check(np.asarray(batch[self.key]))

    def read(self, batch: Mapping[str, Any], *, traced_check: bool = True) -> jax.Array:
        ids = _take(batch, self.key, "token ids")
        shape = tuple(getattr(ids, "shape", ()))  # whatever the reader yields: probed
        if len(shape) != 2 or shape[1] != self.length or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise BatchKeyError(
                f"Batch key {self.key!r} must hold integer token ids [batch, {self.length}], got "
                f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {shape}.")
        _check_on_host(self.check, ids, 0, self.vocab_size, traced_check)
        return jnp.asarray(ids, jnp.int32)

    def null(self, rows: int) -> jax.Array:
        return jnp.full((rows, self.length), self.vocab_size, jnp.int32)

    def of(self, requests: Sequence[str | Sequence[int]]) -> jax.Array:
        rows = []
        for request in requests:
            if isinstance(request, str):
                if self.tokenizer is None:
                    raise InvalidConditionError(
                        "Text prompts need a tokenizer; give TextTokens(tokenizer=...) or pass ids.")
                request = self.tokenizer.encode(request)
            ids = list(request)[: self.length]
            rows.append(ids + [self.pad_id] * (self.length - len(ids)))
        array = np.asarray(rows, np.int64).reshape(len(rows), self.length)
        self.check(array)
        return jnp.asarray(array, jnp.int32)


def conditioning_of(model: Any, *, label_key: str = "label", text_key: str = "caption",
                    tokenizer: Any = None) -> Conditioning:
    """The spec a model's fields imply: labels, text tokens or nothing."""
    # Any flax Module: what it is conditioned on is read from the fields it has.
    classes = int(getattr(model, "num_classes", 0) or 0)
    vocab = int(getattr(model, "text_vocab_size", 0) or 0)
    if classes:
        return ClassLabels(classes, key=label_key)
    if vocab:
        return TextTokens(vocab, int(model.text_length), key=text_key, tokenizer=tokenizer)
    return Unconditional()
