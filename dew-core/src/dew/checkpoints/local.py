"""Local emergency checkpoints in a pool: each process writes its own shards to its own disk.

A persistent step is one directory every process writes into and process 0
commits. A local step cannot work that way, because the local directories
are on different disks: each process instead writes, and commits, a step of
its own in ``local_directory/process-<index>``, holding the shards its
devices had (Orbax's local-checkpoint mode: every process its own primary
host). Two limits follow, and both are checked rather than assumed:

- a local step counts only once every process of the pool has committed it
  (a process that died mid-save leaves the others' copies unusable), so the
  processes agree on the steps they all hold;
- a local step restores only into the placement it was saved from: the same
  number of processes, each holding the same shards on the same devices.
  Anything else (another mesh, another process count, a changed layout)
  restores the newest persistent step instead, which any placement can read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers

from dew.checkpoints.errors import CheckpointNotFoundError
from dew.checkpoints.integrity import sharding_of
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.checkpoints.store import Location

__all__ = [
    "PLACEMENT",
    "LocalPlacementMismatchError",
    "all_agree",
    "local_manager",
    "placement_of",
    "process_directory",
]

PLACEMENT = "dew-placement.json"  # in a local pool step: whose shards these are


class LocalPlacementMismatchError(CheckpointNotFoundError):
    """A local step was asked for by number, but it was saved from another placement."""


def process_directory(root: Location) -> Location:
    """This process's own folder under a pool's local_directory."""
    return root / f"process-{jax.process_index()}"


def _multiprocessing() -> ocp.options.MultiprocessingOptions:
    return ocp.options.MultiprocessingOptions(primary_host=None, active_processes=set(range(jax.process_count())),
                                              barrier_sync_key_prefix="dew-local")


def local_manager(directory: Location, options: Mapping[str, Any]) -> ocp.CheckpointManager:
    """An Orbax manager for which every process is its own primary host, writing only its shards."""
    multiprocessing = _multiprocessing()
    registry = type_handlers.create_type_handler_registry(
        (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, multiprocessing_options=multiprocessing,
                                          type_handler_registry=registry)
    directory.mkdir(parents=True, exist_ok=True)  # Orbax will not create it with active_processes set
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(**{**options, "create": False}, multiprocessing_options=multiprocessing,
                                             save_root_metadata=False, enable_per_process_directory_creation=True),
        item_handlers={"state": handler},
    )


def _index(index: tuple[slice, ...] | None) -> list[list[int | None]]:
    assert index is not None  # a device the sharding addresses holds a slice of the leaf
    return [[s.start, s.stop] for s in index]


def placement_of(tree: PyTree) -> dict[str, Any]:
    """What this process holds of tree: the process count and a digest of each leaf's shards per device.

    Works on arrays and on ShapeDtypeStructs with shardings alike, so a
    saved state and a restore template compare.
    """
    leaves: list[list[tuple[int, list[list[int | None]]]] | None] = []
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = sharding_of(leaf)
        if sharding is None:
            leaves.append(None)
            continue
        held = sharding.addressable_devices_indices_map(tuple(leaf.shape))
        leaves.append(sorted((device.id, _index(index))  # type: ignore[attr-defined]  # jax.Device declares none
                             for device, index in held.items()))
    digest = hashlib.sha256(json.dumps(leaves).encode()).hexdigest()
    return {"processes": jax.process_count(), "process": jax.process_index(), "shards": digest}


def all_agree(flag: bool) -> bool:
    """True when flag is true on every process of the pool (a collective)."""
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.asarray(bool(flag), np.int32)))
    return bool(flags.all())
