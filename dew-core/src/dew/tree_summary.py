"""A model's variables in one line: how many arrays, how many values, of which types.

The objects a notebook prints (a ``TrainState``, a ``Pretrained``, an opened
run, a pipeline) hold whole variable trees. Their reprs show this line for each
tree instead of every array, so printing one reads in a glance rather than a
page of numbers.

>>> import jax.numpy as jnp
>>> summary({"params": {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)}})
'<2 arrays, 9 values: bfloat16, float32>'
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

__all__ = ["brief_repr", "summary"]

_ARRAY = (jax.Array, np.ndarray, jax.ShapeDtypeStruct)


def summary(tree: object) -> str:
    """The arrays of tree counted: ``<N arrays, M values: dtypes>`` (other leaves are counted too)."""
    leaves = jax.tree_util.tree_leaves(tree)
    arrays = [leaf for leaf in leaves if isinstance(leaf, _ARRAY)]
    values = sum(math.prod(leaf.shape) for leaf in arrays)
    kinds = ", ".join(sorted({str(leaf.dtype) for leaf in arrays}))
    text = f"{len(arrays)} array{'s' if len(arrays) != 1 else ''}, {values:,} value{'s' if values != 1 else ''}"
    others = len(leaves) - len(arrays)
    return f"<{text}{': ' + kinds if kinds else ''}{f', {others} other leaves' if others else ''}>"


def _brief(value: object) -> str:
    """A number for a concrete one-value array, a summary for a tree holding arrays, else repr."""
    if isinstance(value, jax.Array | np.ndarray) and value.size == 1 and _readable(value):
        return repr(value.item())
    if any(isinstance(leaf, _ARRAY) for leaf in jax.tree_util.tree_leaves(value)):
        return summary(value)
    return repr(value)


def _readable(value: jax.Array | np.ndarray) -> bool:
    """Whether value's number can be read here: not a tracer, not donated, all on this process."""
    if isinstance(value, np.ndarray):
        return True
    return (not isinstance(value, jax.core.Tracer) and not value.is_deleted()
            and value.is_fully_addressable)


def brief_repr(instance: object) -> str:
    """A dataclass's repr with every field that holds arrays summarized (``summary``).

    Assign it as a dataclass's ``__repr__``; the dataclass decorator keeps a
    ``__repr__`` the class defines itself.
    """
    assert dataclasses.is_dataclass(instance)
    shown = ", ".join(f"{field.name}={_brief(getattr(instance, field.name))}"
                      for field in dataclasses.fields(instance) if field.repr)
    return f"{type(instance).__name__}({shown})"
