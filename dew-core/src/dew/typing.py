"""Names for the few values dew types loosely on purpose.

A pytree is arbitrary by design: nested mappings, sequences and registered
dataclasses of arrays, shaped by whatever model or optimizer made it, so no
static type describes its structure. Writing `PyTree` instead of a bare
`Any` says that this value is such a tree (and nothing else was meant);
where a value is a mapping of named arrays (`Variables`, a batch) or one
array, the annotations say so instead. This module imports no JAX, so the
JAX-free protocols may use it.

>>> from dew.typing import PyTree, JSONObject
>>> tree: PyTree = {"params": {"kernel": [1.0, 2.0]}}
>>> row: JSONObject = {"step": 3, "loss": 0.5}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

__all__ = ["JSONObject", "PyTree"]

PyTree: TypeAlias = Any
"""A pytree of arrays (or of their shapes, shardings, boxes): arbitrary structure."""

JSONObject: TypeAlias = Mapping[str, object]
"""A JSON-ish record read back or about to be written: names to plain values."""
