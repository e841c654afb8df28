"""A pool's rollouts made over the whole global batch, as one process makes them.

A rollout samples with programs compiled over the pool's devices, and every
process must call such a program with the same inputs. Each process rolling
out its own rows gave them different ones: the sampler's outputs spanned the
other processes' devices and could not be read, and FlowGRPO's processes
drew the same noise for different rows. So in a pool every process gathers
the global batch (``whole``), rolls it out with the step's one key, and
keeps its own share's rows (``share_of``): the rows and draws of a run on
one process. Process 0 journals the whole batches and hands the journal to
the others on a resume (``from_process_zero``), so every process replays them.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dew.data.base import Batch, DataPartition

__all__ = ["from_process_zero", "host_value", "share_of", "whole"]


def host_value(array: Any) -> np.ndarray:
    """array whole on this host, though a pool's program left it spread over other processes' devices."""
    if isinstance(array, jax.Array) and not (array.is_fully_addressable or array.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


def _every_process(payload: bytes) -> list[bytes]:
    """payload of every process of the pool, in process order."""
    from jax.experimental import multihost_utils

    sizes = np.asarray(multihost_utils.process_allgather(np.asarray(len(payload), np.int64))).reshape(-1)
    padded = np.zeros(max(1, int(sizes.max())), np.uint8)
    padded[: len(payload)] = np.frombuffer(payload, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [every[index, : int(size)].tobytes() for index, size in enumerate(sizes)]


def from_process_zero(value: Any) -> Any:
    """Process 0's value on every process of the pool (what only it holds: the rollout journal)."""
    return pickle.loads(_every_process(pickle.dumps(value) if jax.process_index() == 0 else b"")[0])


def whole(batch: Batch, partition: DataPartition) -> dict[str, np.ndarray]:
    """The global batch: each share's rows (its first reader's) in share order."""
    mine = pickle.dumps((partition.share, partition.reader, {k: host_value(v) for k, v in batch.items()}))
    shares = sorted((share, rows) for share, reader, rows in map(pickle.loads, _every_process(mine))
                    if reader == 0)
    return {key: np.concatenate([rows[key] for _, rows in shares]) for key in batch}


def share_of(batch: Mapping[str, Any], partition: DataPartition) -> dict[str, np.ndarray]:
    """This process's share of a batch made from the whole one: its block of every value's rows."""
    out: dict[str, np.ndarray] = {}
    for key, value in batch.items():
        array = host_value(value)
        if array.ndim == 0 or len(array) % partition.shares:
            raise ValueError(f"The rollout's {key!r} has shape {array.shape}, whose rows do not split among "
                             f"the pool's {partition.shares} data shares; a rollout returns rows of the batch.")
        rows = len(array) // partition.shares
        out[key] = array[partition.share * rows: (partition.share + 1) * rows]
    return out
