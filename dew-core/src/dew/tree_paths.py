"""How dew names a leaf of a pytree: its keys joined by slashes (``params/dense/kernel``).

Parameter groups, host-parameter patterns and the starting weights' checks
all read a leaf's path this way, so one glob means the same leaves
everywhere.

>>> import jax
>>> path_name((jax.tree_util.DictKey("params"), jax.tree_util.SequenceKey(0),
...            jax.tree_util.GetAttrKey("kernel")))
'params/0/kernel'
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

__all__ = ["key_name", "path_name"]


def key_name(entry: object) -> str:
    """One step of a key path as its name: a key, an index or an attribute's name."""
    if isinstance(entry, DictKey | FlattenedIndexKey):
        return str(entry.key)
    if isinstance(entry, GetAttrKey):
        return entry.name
    if isinstance(entry, SequenceKey):
        return str(entry.idx)
    return str(entry)


def path_name(path: Sequence[object]) -> str:
    """A tree path (``tree_flatten_with_path``'s keys) as the ``/``-joined name globs match."""
    return "/".join(key_name(entry) for entry in path)
