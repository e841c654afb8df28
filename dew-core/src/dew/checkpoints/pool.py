"""What Checkpoints needs from a pool of processes: positions gathered, a shared-directory probe.

Alone (one process) every function here is local and cheap; in a pool each
one is a collective that every process must call in the same order.
"""

from __future__ import annotations

import base64
import secrets
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from dew.checkpoints.errors import CheckpointDirectoryNotSharedError
from dew.data.base import DataPartition

if TYPE_CHECKING:
    from dew.checkpoints.store import Location

__all__ = ["barrier", "gather_positions", "pooled", "probe_shared_directory"]


def pooled() -> bool:
    return jax.process_count() > 1


def barrier(name: str) -> None:
    """Wait until every process of the pool reaches name (nothing alone)."""
    if pooled():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def gather_positions(position: bytes | None, partition: DataPartition) -> dict[str, Any]:
    """Every share's position as saved: {"shares": n, "positions": {share: base64 or None}}.

    Reader 0 of each share speaks for it; the other readers of a share hold
    the same rows and so the same position.
    """
    if position is not None and not isinstance(position, bytes | bytearray):
        raise TypeError(f"A data position must be bytes (an iterator's get_state()), got {type(position).__name__}.")
    records = [(partition.share, partition.reader, partition.shares, position)]
    if pooled():
        from jax.experimental import multihost_utils

        header = np.asarray(
            [partition.share, partition.reader, partition.shares, position is not None,
             0 if position is None else len(position)], np.int64,
        )
        headers = np.asarray(multihost_utils.process_allgather(header))
        width = max(1, int(headers[:, 4].max()))
        payload = np.zeros(width, np.uint8)
        if position:
            payload[: len(position)] = np.frombuffer(bytes(position), np.uint8)
        payloads = np.asarray(multihost_utils.process_allgather(payload))
        records = [
            (int(h[0]), int(h[1]), int(h[2]), bytes(p[: int(h[4])]) if h[3] else None)
            for h, p in zip(headers, payloads, strict=True)
        ]
    shares = {record[2] for record in records}
    if len(shares) != 1:
        raise ValueError(f"The processes of a pool disagree on the number of data shares: {sorted(shares)}.")
    positions = {
        str(share): None if saved is None else base64.b64encode(saved).decode("ascii")
        for share, reader, _, saved in records
        if reader == 0
    }
    return {"shares": shares.pop(), "positions": positions}


def probe_shared_directory(directory: Location) -> None:
    """In a pool, check every process sees a file process 0 writes into directory.

    Raises CheckpointDirectoryNotSharedError on every process, naming the processes
    that cannot see it. Alone, or for a bucket, nothing is checked.
    """
    if not pooled() or str(directory).startswith("gs://"):
        return
    from jax.experimental import multihost_utils

    token = int(multihost_utils.broadcast_one_to_all(np.asarray(secrets.randbits(62), np.int64)))
    probe = directory / f".dew-probe-{token:x}"
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("written by process 0 to check every process sees this directory\n")
    barrier(f"dew-probe-written-{token:x}")
    seen = np.asarray(multihost_utils.process_allgather(np.asarray(probe.exists(), np.int32)))
    if jax.process_index() == 0:
        probe.unlink()
    missing = [index for index, flag in enumerate(seen.reshape(-1)) if not flag]
    if missing:
        raise CheckpointDirectoryNotSharedError(directory, missing)
