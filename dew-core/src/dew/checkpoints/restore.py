"""Reading one committed step back, checked: manifest first, then files and leaves beside Orbax's read.

Nothing here writes. A damaged step raises CheckpointCorruptedError naming the
file; an intact step that does not fit the state asked for raises
CheckpointTreeMismatchError (or whatever the caller's meta check raises) before
a single array is read, where the manifest can tell.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import jax
import orbax.checkpoint as ocp

from dew.checkpoints import integrity
from dew.checkpoints.errors import CheckpointCorruptedError, CheckpointTreeMismatchError
from dew.checkpoints.manifest import Manifest, parse_manifest
from dew.checkpoints.store import read_position
from dew.data.base import DataPartition
from dew.errors import raised_from
from dew.versions import writer

if TYPE_CHECKING:
    from dew.checkpoints.store import Location

__all__ = ["MetaCheck", "Restored", "intact", "read_manifest", "restore_step"]

MetaCheck = Callable[[Mapping[str, object], int], None]
Expected = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # the template's leaf and node tables
_VERIFY_THREADS = max(2, min(4, os.cpu_count() or 1))


State = TypeVar("State")
"""The saved tree (the trainer's TrainState): any pytree of arrays."""


@dataclass(frozen=True)
class Restored(Generic[State]):
    """A restored step: its state (placed as the template asked), data position and meta."""

    step: int
    state: State
    position: bytes | None
    meta: dict[str, object]


def read_manifest(directory: Location, step: int) -> Manifest:
    """The checked manifest of the step in directory; CheckpointCorruptedError when missing or damaged."""
    path = directory / integrity.MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorruptedError(step, path, "dew's manifest is missing") from None
    except OSError as error:
        raise CheckpointCorruptedError(step, path, f"dew's manifest cannot be read ({error})") from None
    return parse_manifest(raw, step, path)


def intact(directory: Location, step: int) -> bool:
    """Whether the step's manifest and every file it lists are as written (reads every file)."""
    try:
        manifest = read_manifest(directory, step)
    except CheckpointCorruptedError:
        return False
    return integrity.verify_files(directory, manifest.files, manifest.file_hash) is None


def restore_step(directory: Location, step: int, template: State, expected: Expected,
                 partition: DataPartition, check: MetaCheck | None) -> Restored:
    """Read the step in directory into template, checking it on the way (see the module docstring)."""
    manifest = read_manifest(directory, step)
    if check is not None:
        check(dict(manifest.meta), step)
    leaves, nodes = expected
    saved_nodes = [] if manifest.nodes is None else [node.model_dump() for node in manifest.nodes]
    saved_leaves = [leaf.model_dump() for leaf in manifest.leaves]
    differences = integrity.compare_leaves(saved_leaves, leaves)
    if manifest.nodes is not None:
        differences = sorted(set(differences) | set(integrity.compare_nodes(saved_nodes, nodes)))
    if differences:
        raise CheckpointTreeMismatchError(step, differences, writer(manifest.meta))
    position = read_position(step, manifest.data, partition)
    problem = integrity.verify_sizes(directory, manifest.files)
    if problem is not None:
        raise CheckpointCorruptedError(step, *problem)
    with ThreadPoolExecutor(max_workers=_VERIFY_THREADS, thread_name_prefix="dew-verify") as pool:
        hashed = integrity.start_hashing(directory, manifest.files, pool, manifest.file_hash)  # beside Orbax
        try:
            widened = integrity.widened_leaves(saved_leaves, leaves)
            restored = _read_state(directory, _as_saved(template, widened) if widened else template)
        except Exception as error:  # Orbax raises bare exceptions for damaged data
            if raised_from(error, KeyboardInterrupt):  # Ctrl-C as Orbax read: a stop, not a misfit
                raise KeyboardInterrupt from error
            problem = hashed()
            if problem is not None:
                raise CheckpointCorruptedError(step, *problem) from error
            first = (str(error).strip() or type(error).__name__).splitlines()[0][:300]
            raise CheckpointTreeMismatchError(
                step, [f"its files are intact, but Orbax cannot read them into this state ({first})"],
                writer(manifest.meta)) from error
        digests = integrity.start_digests(jax.tree_util.tree_leaves(restored), pool)
        problem = hashed()
        if problem is not None:
            raise CheckpointCorruptedError(step, *problem)
        values = digests()
    for leaf, digest in zip(manifest.leaves, values, strict=True):
        if leaf.digest != digest:
            raise CheckpointCorruptedError(step, directory / "state", f"leaf {leaf.path} does not match its digest")
    if widened:
        restored = jax.tree_util.tree_map(_widen, restored, template)
    return Restored(step=step, state=restored, position=position, meta=dict(manifest.meta))


def _as_saved(template: State, widened: Mapping[str, str]) -> State:
    """template with the leaves saved narrower (widened_leaves) asked for in the dtype they were saved in."""
    def leaf(path: Any, wanted: Any) -> Any:
        saved = widened.get(jax.tree_util.keystr(path))
        return wanted if saved is None else jax.ShapeDtypeStruct(wanted.shape, saved, sharding=wanted.sharding)

    return jax.tree_util.tree_map_with_path(leaf, template)


def _widen(read: jax.Array, wanted: Any) -> jax.Array:
    """A leaf read as saved, in the dtype and placement the template asks for."""
    if read.dtype == wanted.dtype:
        return read
    return jax.jit(lambda x: x.astype(wanted.dtype), out_shardings=wanted.sharding)(read)


def _read_state(directory: Location, template: State) -> State:
    """Read the state item of a committed step directory into template's shardings (reads only)."""
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as reader:
        return reader.restore(directory / "state", args=ocp.args.StandardRestore(template))

