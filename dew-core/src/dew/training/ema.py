"""The exponential moving average of selected leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew.objectives.base import EMASpec, LeafFilter, Variables
from dew.training.trees import select
from dew.typing import PyTree

__all__ = ["ema_leaves", "ema_storage", "ema_update"]


def ema_update(ema: Variables, params: Variables, decay: jax.typing.ArrayLike) -> Variables:
    """Move ema towards params by (1 - decay), keeping each leaf's storage dtype.

    The arithmetic runs in at least float32 (float64 stays float64). A unit
    decay returns the old leaf exactly, so a frozen reference survives even
    when it holds non-finite values. An integer or boolean leaf (a counter a
    model keeps) has no average: it takes the live value, where truncating
    the average kept it at its first value.

    >>> import jax.numpy as jnp
    >>> ema_update({"w": jnp.zeros(2)}, {"w": jnp.ones(2)}, 0.75)["w"].tolist()
    [0.25, 0.25]
    >>> int(ema_update({"n": jnp.int32(0)}, {"n": jnp.int32(5)}, 0.9)["n"])
    5
    """
    decay = jnp.asarray(decay)

    def one(old: jax.Array, new: jax.Array) -> jax.Array:
        if not jnp.issubdtype(old.dtype, jnp.inexact):  # a count, a step: no average, the live value
            return jnp.where(decay == 1, old, new.astype(old.dtype))
        dtype = jnp.promote_types(old.dtype, jnp.float32)
        d = decay.astype(dtype)
        moved = (d * old.astype(dtype) + (1 - d) * new.astype(dtype)).astype(old.dtype)
        return jnp.where(decay == 1, old, moved)

    return jax.tree.map(one, ema, params)


def ema_storage(leaf: jax.Array) -> jax.Array:
    """A fresh copy of leaf for the EMA to keep, a bfloat16 or float16 one widened to float32: at a
    decay of 0.999 a step moves the average by a thousandth of its gap to the weights, below a
    bfloat16 value's resolution (1/128 of it), so an average kept in bfloat16 never moved.

    >>> ema_storage(jnp.ones(2, jnp.bfloat16)).dtype
    dtype('float32')
    """
    if jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.finfo(leaf.dtype).bits < 32:
        return jnp.asarray(leaf, jnp.float32)
    return jnp.copy(leaf)


def ema_leaves(spec: EMASpec, frozen: LeafFilter | None, variables: Variables) -> dict[str, PyTree]:
    """The leaves the EMA keeps: those spec selects, less the frozen ones (which never move).

    >>> from dew.objectives.base import under
    >>> tree = {"params": {"body": 1, "head": 2, "teacher": 3}}
    >>> ema_leaves(EMASpec(select=under("params")), under("params/teacher"), tree)
    {'params': {'body': 1, 'head': 2}}
    """

    def keep(path: tuple[str, ...], leaf: PyTree) -> bool:
        return bool(spec.select(path, leaf)) and not (frozen is not None and frozen(path, leaf))

    return select(variables, keep)
