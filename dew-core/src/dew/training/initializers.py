"""Where a fresh run's weights come from, when not from a random init.

A Trainer's ``initializer`` is a variables tree (nested mappings of numpy or
jax arrays: a model trained in this process, a converted checkpoint) or a
``WeightSource``, a callable that reads one given the abstract variables a
fresh init would make. ``ParamsFrom`` is the source for another run's
training checkpoint: it reads the parameters alone, without optimizer
state, counters or accumulation window.

The trainer puts the weights on the devices in the shardings the layout
gives the same paths, then passes them to the compiled initializer as an
argument, so they are never constants inside an executable.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jax.sharding import NamedSharding

from dew.errors import DewError
from dew.objectives.base import Variables
from dew.tree_paths import path_name
from dew.typing import PyTree

__all__ = [
    "IgnoringLeaves",
    "Initializer",
    "InitializerMismatchError",
    "ParamsFrom",
    "WeightSource",
    "compare_trees",
    "place_weights",
]


class InitializerMismatchError(DewError, ValueError):
    """The weights a run starts from do not fit the tree or shapes the objective's init makes.

    mismatch, when set, is what does not fit, without the advice that follows it (a reader who
    knows more of the run, a LoRA run's, words the advice anew)."""

    def __init__(self, message: str, *, mismatch: str | None = None) -> None:
        super().__init__(message)
        self.mismatch = mismatch


@runtime_checkable
class WeightSource(Protocol):
    """Reads the weights a run starts from, given the abstract variables of a fresh init."""

    def __call__(self, abstract: Variables) -> Variables: ...


Initializer = Variables | WeightSource | None


def _leaves(tree: PyTree) -> dict[str, PyTree]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {path_name(path): leaf for path, leaf in flat}




def ignored(path: str, ignore: tuple[str, ...]) -> bool:
    """Whether a '/'-joined leaf path matches one of the glob patterns in ignore."""
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in ignore)


def without(tree: PyTree, ignore: tuple[str, ...]) -> PyTree:
    """tree less the leaves whose paths match ignore (emptied mappings dropped too)."""
    if not ignore:
        return tree

    def prune(node: PyTree, prefix: str) -> PyTree:
        if not isinstance(node, Mapping):
            return node
        out = {}
        for key, value in node.items():
            path = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                kept = prune(value, path)
                if kept:
                    out[key] = kept
            elif not ignored(path, ignore):
                out[key] = value
        return out

    return prune(tree, "")


def compare_trees(expected: PyTree, given: PyTree, *, what: str, ignore: tuple[str, ...] = ()) -> None:
    """Refuse given unless it has expected's leaf paths, shapes and dtypes' kinds; name the first differences.

    Leaves whose paths match a pattern of ignore may be missing or left over.
    """
    want, got = _leaves(without(expected, ignore)), _leaves(without(given, ignore))
    problems = []
    for path in want:
        if path not in got:
            problems.append(f"{path}: missing (expected shape {tuple(want[path].shape)})")
        elif tuple(np.shape(got[path])) != tuple(want[path].shape):
            problems.append(f"{path}: shape {tuple(np.shape(got[path]))}, expected {tuple(want[path].shape)}")
    problems.extend(f"{path}: not in the objective's variables" for path in got if path not in want)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        mismatch = f"{what} do not fit the variables the objective's init makes: {shown}."
        raise InitializerMismatchError(
            f"{mismatch} Start from weights of the same architecture and configuration, change the model "
            "to match them, or name the leaves to leave at their fresh initialization (a recipe's "
            "init.ignore, glob patterns such as 'params/head/*').", mismatch=mismatch)


def _reader(array: np.ndarray) -> Callable[[tuple[slice, ...] | None], np.ndarray]:
    """The callback make_array_from_callback calls for each shard: array's slice at index."""
    return lambda index: array[index]


def place_weights(weights: Variables, shardings: Mapping[str, NamedSharding] | Callable[[str, PyTree], NamedSharding]) -> PyTree:
    """Put host or device weights on the mesh, each leaf in the sharding its path is given.

    shardings maps '/'-joined leaf paths to shardings, or is a function of
    (path, leaf). A numpy leaf reaches the devices in pieces: every process
    copies only the shards its devices hold.
    """
    flat, tree = jax.tree_util.tree_flatten_with_path(weights)
    placed = []
    for path, leaf in flat:
        name = path_name(path)
        sharding = shardings(name, leaf) if callable(shardings) else shardings[name]
        if isinstance(leaf, jax.Array):
            placed.append(jax.device_put(leaf, sharding))
        else:
            placed.append(jax.make_array_from_callback(np.shape(leaf), sharding, _reader(np.asarray(leaf))))
    return jax.tree_util.tree_unflatten(tree, placed)


@dataclass(frozen=True)
class ParamsFrom:
    """The parameters alone of another run's training checkpoint (its newest step, or step).

    field chooses the saved TrainState field: ``params`` (the live weights)
    or ``ema`` (the EMA's own leaves of a run that kept one, a pruned copy of
    params read in the tree the checkpoint records; ``overlay(params, ema)``
    is the averaged model); ``averaged`` reads both and gives that averaged
    model, in the params' dtypes (the weights the run's export holds). Only that field
    of the saved TrainState is read (an Orbax
    partial restore), after the step's files are checked against their
    recorded hashes and before each leaf is checked against its digest, so
    a damaged checkpoint is refused rather than trained from.
    """

    directory: str | os.PathLike
    step: int | None = None
    field: str = "params"
    ignore: tuple[str, ...] = ()  # glob patterns of leaf paths neither required nor read
    # The key under each collection where the model sits in a run that trained several side by
    # side (a distillation run's params/student and params/teacher); None: the whole tree.
    within: str | None = None

    def __call__(self, abstract: Variables) -> Variables:
        if self.field == "averaged":
            from dew.training.trees import overlay_as

            live = replace(self, field="params")(abstract)
            try:
                ema = replace(self, field="ema")(abstract)
            except InitializerMismatchError:
                raise InitializerMismatchError(
                    f"{self.directory} kept no EMA (its objective averages no weights), so there is no "
                    "EMA copy to start from: unset init.ema to start from its live weights.") from None
            return overlay_as(live, without(ema, self.ignore))
        import orbax.checkpoint as ocp

        from dew.checkpoints import integrity
        from dew.checkpoints.errors import CheckpointCorruptedError, CheckpointNotFoundError
        from dew.checkpoints.manager import Checkpoints

        checkpoints = Checkpoints(self.directory)
        step = checkpoints.latest if self.step is None else int(self.step)
        if step is None:
            what = "does not exist" if not checkpoints.directory.exists() else "holds no committed checkpoint"
            raise CheckpointNotFoundError(
                f"{checkpoints.directory} {what}, so there are no parameters to start from: train "
                "the run that writes it first, or name the checkpoint directory of a run that exists."
            )
        path = checkpoints.path(step)
        manifest = checkpoints.manifest(step)
        problem = integrity.verify_files(path, manifest["files"])
        if problem is not None:
            raise CheckpointCorruptedError(step, *problem)
        saved = {leaf["path"]: leaf for leaf in manifest["leaves"]}
        field = self.field
        if field not in ("params", "ema") or not any(n.startswith(f".{field}[") for n in saved):
            raise InitializerMismatchError(
                f"Step {step} of {checkpoints.directory} holds no {field!r} field to read "
                "parameters from; ask for 'params' (or 'ema' or 'averaged' of a run that kept an EMA)."
            )
        stored = _saved_params(saved, field)
        recorded = stored if self.within is None else _within(stored, self.within, path)
        if field == "params":  # the collections asked for: a preference or RL run's frozen reference is its own
            recorded = {collection: tree for collection, tree in recorded.items() if collection in abstract}
        if field == "ema":  # only the selected leaves were saved
            abstract = recorded
        else:  # every leaf the declared model has, and no other, of the same shape: never zero-filled
            abstract = without(abstract, self.ignore)
            _compare_or_point_within(abstract, recorded, stored, path, self)
            _check_float_kinds(abstract, without(recorded, self.ignore), path)
        template = jax.tree.map(lambda leaf: ocp.RestoreArgs(restore_type=np.ndarray), dict(abstract))
        item = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), dict(abstract))
        if self.within is not None:  # read the model's subtree where the run keeps it
            template, item = _nest(template, self.within), _nest(item, self.within)
        try:
            restored = ocp.PyTreeCheckpointer().restore(
                os.fspath(path / "state"),
                args=ocp.args.PyTreeRestore(item={field: item}, restore_args={field: template},
                                            partial_restore=True),
            )[field]
        except (KeyError, ValueError) as error:
            _compare_or_point_within(abstract, recorded, stored, path, self)
            raise InitializerMismatchError(f"The parameters of {path} cannot be read: {error}") from error
        flat, _ = jax.tree_util.tree_flatten_with_path({field: restored})
        digests = integrity.host_digests([np.asarray(x) for _, x in flat])  # no device copy of the weights
        for (leaf_path, _), digest in zip(flat, digests, strict=True):
            name = "." + jax.tree_util.keystr(leaf_path).removeprefix("['").replace("']", "", 1)
            if name in saved and saved[name]["digest"] != digest:
                raise CheckpointCorruptedError(step, path / "state", f"leaf {name} does not match its digest")
        read = restored if self.within is None else _within(restored, self.within, path)
        # In the dtypes the model declares (its param_dtype), as Pretrained.load reads weights: a
        # run trained in bfloat16 and started from by a float32 recipe trains in float32.
        return jax.tree.map(lambda leaf, want: np.asarray(leaf).astype(want.dtype, copy=False), read, dict(abstract))


def _nest(tree: Mapping[str, PyTree], within: str) -> dict[str, PyTree]:
    """Each collection's tree put under the key within."""
    return {collection: {within: subtree} for collection, subtree in tree.items()}


def _within(tree: Mapping[str, PyTree], within: str, path: object) -> dict[str, PyTree]:
    """Each collection's subtree under the key within (the collections that have one)."""
    found = {collection: subtree[within] for collection, subtree in tree.items()
             if isinstance(subtree, Mapping) and within in subtree}
    if not found:
        keys = sorted({str(k) for subtree in tree.values() if isinstance(subtree, Mapping) for k in subtree})
        raise InitializerMismatchError(
            f"The parameters of {path} hold nothing under {within!r} (init.within): their collections hold "
            f"{', '.join(keys)}. Name one of those, or leave init.within out to read the whole tree.")
    return found


def _compare_or_point_within(abstract: PyTree, recorded: PyTree, stored: PyTree, path: object,
                             source: ParamsFrom) -> None:
    """compare_trees, its refusal naming init.within when the saved tree nests whole models the
    declared one could be (a distillation run's student and teacher) and none was chosen."""
    try:
        compare_trees(abstract, recorded, what=f"The parameters of {path}", ignore=source.ignore)
    except InitializerMismatchError as error:
        fitting = [] if source.within is not None else [
            key for key in sorted({str(k) for sub in stored.values() if isinstance(sub, Mapping) for k in sub})
            if _fits(abstract, _within(stored, key, path), source.ignore)]
        if not fitting:
            raise
        raise InitializerMismatchError(
            f"The parameters of {path} hold whole models side by side ({', '.join(fitting)} fit"
            f"{'s' if len(fitting) == 1 else ''} this model), not one model: set init.within={fitting[0]} "
            "to start from it.") from error


def _fits(abstract: PyTree, recorded: PyTree, ignore: tuple[str, ...]) -> bool:
    try:
        compare_trees(abstract, recorded, what="", ignore=ignore)
    except InitializerMismatchError:
        return False
    return True


@dataclass(frozen=True)
class IgnoringLeaves:
    """Another source's weights, with the leaves ignore names left at the fresh initialization.

    A leaf whose '/'-joined path matches a glob pattern of ignore is neither
    asked of source nor taken from what it returns (a head the other run did
    not have, or had and this model lacks); fresh (the objective's own init,
    with the run's key) gives the ones the objective's variables have.
    """

    source: Callable[[Variables], Variables]
    ignore: tuple[str, ...]
    fresh: Callable[[], Variables]

    def __call__(self, abstract: Variables) -> Variables:
        read = without(dict(self.source(without(abstract, self.ignore))), self.ignore)
        left = [path for path in _leaves(abstract) if ignored(path, self.ignore)]
        if not left:
            return read
        from flax.linen import meta

        fresh = _leaves(meta.unbox(self.fresh()))  # an objective's init may box its leaves
        for path in left:
            node = read
            *parents, name = path.split("/")
            for part in parents:
                node = node.setdefault(part, {})
            node[name] = fresh[path]
        return read


def _check_float_kinds(expected: PyTree, saved: PyTree, path: object) -> None:
    """Refuse a saved leaf of an integer or boolean dtype where the model keeps a float."""
    want, got = _leaves(expected), _leaves(saved)
    wrong = [f"{name}: {np.dtype(got[name].dtype).name}, expected {np.dtype(want[name].dtype).name}"
             for name in want
             if name in got and jax.numpy.issubdtype(want[name].dtype, jax.numpy.floating)
             and not jax.numpy.issubdtype(got[name].dtype, jax.numpy.floating)]
    if wrong:
        raise InitializerMismatchError(
            f"The parameters of {path} hold leaves of another kind of dtype: {'; '.join(wrong[:8])}. "
            "They would not convert without changing their meaning; start from a checkpoint of "
            "the same model.")


_KEYSTR_PART = re.compile(r"""\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\]]*)\]|\.([^.\[]+)""")


def _keystr_parts(name: str) -> list[str]:
    """The keys of a leaf path as ``jax.tree_util.keystr`` writes it: ``['a'][0].qvalue`` is a, 0, qvalue.

    A quantized leaf (a qwix QArray) is reached by attribute, so its keys are
    not all bracketed; each part reads back as the name path_name gives it.

    >>> _keystr_parts(".params['layers_0']['key']['array'].qvalue")
    ['params', 'layers_0', 'key', 'array', 'qvalue']
    >>> _keystr_parts("['a'][0]['b/c']")
    ['a', '0', 'b/c']
    """
    parts = []
    for match in _KEYSTR_PART.finditer(name):
        bracketed, attribute = match.groups()
        if attribute is not None:
            parts.append(attribute)
        elif bracketed[:1] in ("'", '"'):
            parts.append(str(ast.literal_eval(bracketed)))
        else:
            parts.append(bracketed)
    return parts


def _saved_params(saved: Mapping[str, Mapping[str, Any]], field: str = "params") -> dict[str, PyTree]:
    """The leaves of field a manifest records, as a tree of shape stand-ins."""
    out: dict[str, PyTree] = {}
    prefix = f".{field}"
    for name, leaf in saved.items():
        if not name.startswith(prefix + "["):
            continue
        keys = _keystr_parts(name[len(prefix):])
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(leaf["dtype"]))
    return out
