"""Parts of a variables tree, picked by path: what trains, what the EMA keeps.

A Flax variables tree is nested mappings down to arrays. The trainer keeps
the whole tree once (``TrainState.params``) and works on pruned copies of
its structure that hold only some leaves: the trainable parameters (what
the optimizer and the accumulation window see) and the EMA's leaves. A
pruned tree shares no buffers with the whole one inside a compiled step,
and ``overlay`` puts its leaves back in place.

>>> tree = {"params": {"a": 1, "b": {"c": 2}}, "stats": {"n": 3}}
>>> part = select(tree, lambda path, leaf: path[-1] != "a")
>>> part
{'params': {'b': {'c': 2}}, 'stats': {'n': 3}}
>>> overlay(tree, {"params": {"b": {"c": 9}}})
{'params': {'a': 1, 'b': {'c': 9}}, 'stats': {'n': 3}}
>>> paths(part)
['params/b/c', 'stats/n']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dew.typing import PyTree

__all__ = ["Path", "leaves_at", "overlay", "overlay_as", "paths", "select", "trains"]

Path = tuple[str, ...]


def select(tree: Mapping[str, PyTree], keep: Callable[[Path, PyTree], bool], _path: Path = ()) -> dict[str, PyTree]:
    """The leaves of tree that keep accepts, in tree's nesting; empty branches dropped."""
    out: dict[str, PyTree] = {}
    for key, value in tree.items():
        path = (*_path, str(key))
        if isinstance(value, Mapping):
            part = select(value, keep, path)
            if part:
                out[key] = part
        elif keep(path, value):
            out[key] = value
    return out


def overlay(base: Mapping[str, PyTree], top: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """base with top's leaves in place (top's tree is a pruned copy of base's)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = overlay(out[key], value)
        else:
            out[key] = value
    return out


def overlay_as(base: Mapping[str, PyTree], top: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """overlay, with each of top's arrays in the dtype of the base leaf it replaces (an EMA kept in
    float32 over bfloat16 weights reads as bfloat16 weights do)."""
    import jax

    return overlay(base, jax.tree.map(lambda leaf, below: leaf if leaf.dtype == below.dtype else leaf.astype(below.dtype),
                                      top, leaves_at(top, base)))


def leaves_at(pattern: Mapping[str, PyTree], tree: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """tree's leaves at pattern's paths (pattern a pruned copy of tree's structure)."""
    return {key: leaves_at(value, tree[key]) if isinstance(value, Mapping) else tree[key]
            for key, value in pattern.items()}


def paths(tree: Mapping[str, PyTree], _path: Path = ()) -> list[str]:
    """Every leaf's path, joined with '/', in tree order."""
    out: list[str] = []
    for key, value in tree.items():
        path = (*_path, str(key))
        if isinstance(value, Mapping):
            out.extend(paths(value, path))
        else:
            out.append("/".join(path))
    return out


def trains(frozen: Callable[[Path, PyTree], bool] | None) -> Callable[[Path, PyTree], bool]:
    """The filter of trainable leaves: the ``params`` collection less what frozen names."""

    def accept(path: Path, leaf: PyTree) -> bool:
        return bool(path) and path[0] == "params" and not (frozen is not None and frozen(path, leaf))

    return accept
