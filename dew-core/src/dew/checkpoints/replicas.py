"""Emergency checkpoints across slices: a process that lost its local step takes a replica's copy.

A pool's local steps live on each process's own disk (dew.checkpoints.local),
so one lost disk (a replaced host, a wiped scratch volume) would make every
local step that process held no step of the pool. But data parallelism keeps
copies: a process on another slice (another group of the replica, i.e. data,
axis) holds exactly the same shards. As in MaxText's multi-tier checkpointing,
such a process sends its copy of the step to the one that lost it, over the
pool's own collectives, and the step counts again.

Each local step records, beside this process's placement, a table of every
process's: the digest of the shards it holds on its devices (what a restore
checks) and of the shard indices alone (``holds``: equal for two processes
that are replicas of each other). A process lacking a step that others hold
is given it when a holder's table names a process with its ``holds``: that
holder's step directory is broadcast as is (its files and dew's manifest,
whose checksums then check the copy) and committed, by a rename, into the
lacking process's folder. A restore checks a step against this process's
entry of the table, so the copy restores there as it would on its writer.
A step whose lost shards no other process holds stays no step of the pool.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
import tarfile
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from dew.checkpoints.local import PLACEMENT, placement_of
from dew.checkpoints.pool import barrier, pooled
from dew.checkpoints.store import TMP, Store, rmtree
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.checkpoints.store import Location

__all__ = ["fits", "pool_placement", "pool_steps"]

_LOG = logging.getLogger("dew.checkpoints")
_CHUNK = 1 << 26  # bytes broadcast at a time


def _holds(tree: PyTree) -> str:
    """A digest of the shard indices this process holds of tree, whatever devices hold them."""
    from dew.checkpoints.integrity import sharding_of

    leaves: list[list[list[list[int | None]]] | None] = []
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = sharding_of(leaf)
        if sharding is None:
            leaves.append(None)
            continue
        held = sharding.addressable_devices_indices_map(tuple(leaf.shape)).values()
        leaves.append(sorted([[s.start, s.stop] for s in _held(index)] for index in held))
    return hashlib.sha256(json.dumps(leaves).encode()).hexdigest()


def _held(index: tuple[slice, ...] | None) -> tuple[slice, ...]:
    assert index is not None  # a device the sharding addresses holds a slice of the leaf
    return index


def _gather_digests(digest: str) -> list[str]:
    """Every process's hex sha256 digest, in process order (a collective)."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(bytes.fromhex(digest), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    return [bytes(row.tolist()).hex() for row in every]


def pool_placement(state: PyTree) -> dict[str, Any]:
    """This process's placement of state (placement_of) and the pool's table of every process's
    shards and shard indices (a collective: every process calls it with its own state)."""
    placement = placement_of(state)
    holds = _holds(state)
    table = zip(_gather_digests(placement["shards"]), _gather_digests(holds), strict=True)
    return {**placement, "holds": holds, "pool": [{"shards": s, "holds": h} for s, h in table]}


def fits(saved: dict[str, Any] | None, wanted: dict[str, Any]) -> bool:
    """Whether a local step's saved placement restores into wanted (this process's placement_of the
    template): through this process's entry of the pool's table when the step has one (so a copy
    from a replica fits as the original does), else the step's own placement."""
    if saved is None:
        return False
    pool = saved.get("pool")
    if pool is None:
        return saved == wanted
    return (saved.get("processes") == wanted["processes"] == len(pool)
            and pool[wanted["process"]]["shards"] == wanted["shards"])


def _every_process(steps: list[int]) -> list[set[int]]:
    """Each process's committed steps (a collective; each process passes its own)."""
    from jax.experimental import multihost_utils

    count = int(np.asarray(multihost_utils.process_allgather(np.asarray(len(steps), np.int32))).max())
    if count == 0:
        return [set() for _ in range(jax.process_count())]
    padded = np.full(count, -1, np.int32)
    padded[: len(steps)] = steps
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, count)
    return [{int(step) for step in row if step >= 0} for row in every]


def _broadcast(payload: bytes | None, source: int) -> bytes:
    """source's payload on every process (a collective; the others pass None)."""
    from jax.experimental import multihost_utils

    mine = jax.process_index() == source
    data = payload if mine and payload is not None else b""
    header = np.frombuffer(len(data).to_bytes(8, "little") if mine else bytes(8), np.uint8)
    size = int.from_bytes(bytes(np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=mine)).tolist()),
                          "little")
    pieces = []
    for start in range(0, size, _CHUNK):
        length = min(_CHUNK, size - start)
        chunk = np.frombuffer(data[start:start + length], np.uint8) if mine else np.zeros(length, np.uint8)
        pieces.append(np.asarray(multihost_utils.broadcast_one_to_all(chunk, is_source=mine)).tobytes())
    return b"".join(pieces)


def _pack(directory: Location) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(directory, arcname=".")
    return buffer.getvalue()


def _unpack(payload: bytes, store: Store, step: int) -> None:
    """Write a step's files into store as step, committed by the last rename (as Orbax commits)."""
    temporary = store.directory / f"{step}{TMP}"
    if temporary.exists():
        rmtree(temporary)
    temporary.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(payload), mode="r") as archive:
        archive.extractall(temporary, filter="data")
    os.replace(temporary, store.step_path(step))


def _recover(store: Store, step: int, every: list[set[int]]) -> bool:
    """Give every process lacking step a replica's copy (a collective); False when some process's
    shards are held by no process that has the step."""
    holders = [index for index, steps in enumerate(every) if step in steps]
    lacking = [index for index, steps in enumerate(every) if step not in steps]
    me = jax.process_index()
    path = store.step_path(step) / PLACEMENT
    table = _broadcast(path.read_bytes() if me == holders[0] and path.exists() else b"", holders[0])
    try:
        pool = json.loads(table)["pool"]
    except (ValueError, KeyError, TypeError):
        return False  # a step saved before placements named the pool
    sources = {}
    for index in lacking:
        source = next((holder for holder in holders if pool[holder]["holds"] == pool[index]["holds"]), None)
        if source is None:
            _LOG.info("Local step %s: no process that holds it is a replica of process %s.", step, index)
            return False
        sources[index] = source
    for source in sorted(set(sources.values())):
        payload = _broadcast(_pack(store.step_path(step)) if me == source else None, source)
        if sources.get(me) == source:
            _unpack(payload, store, step)
            print(f"dew: local step {step} was missing from {store.directory}; copied from process "
                  f"{source}, which holds the same shards.", file=sys.stderr, flush=True)
    barrier(f"dew-checkpoints-replicated-{step}")
    if store.manager is not None:
        store.manager.reload()
    return True


def pool_steps(store: Store) -> list[int]:
    """The steps of a pool's local store every process holds, once each process lacking one has
    taken it from a replica (see the module docstring); a collective."""
    if not pooled():
        return store.committed()
    every = _every_process(store.committed())
    held = set.intersection(*every)
    for step in sorted(set.union(*every) - held, reverse=True):
        if _recover(store, step, every):
            held.add(step)
    return sorted(held)
