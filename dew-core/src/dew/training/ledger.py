"""The data-consumption ledger: which global records every step consumed, beside the checkpoints.

A run's Feed hands the ledger each step's global batch as the stream
reports it (``dew.data.base.Accounted``): its positions in the global
record order and a digest of its record ids (sorted first, so the order of
rows within a step does not matter; the steps stay in order). A step whose
rollout refilled its batch from the stream (``Refilling``: DAPO's dynamic
sampling) read several batches; its line covers all of them (``joined``),
so the positions of the steps still tile the stream's order. The ledger
also notes where each fit opened the stream (the step and the position it
resumed from, the process and share counts) and the position every
checkpoint saved. ``dew audit`` reads it back to prove that a run which was
stopped, resumed elsewhere or ramped its batch consumed exactly the records
of an uninterrupted run.

Process 0 writes it for the whole pool (every share reports the whole
global batch), as JSON lines in ``ledger.jsonl`` in the checkpoint
directory, appended and flushed at every checkpoint, so a crash loses only
steps that were undone with it (a resumed run opens at its checkpoint, and
the lines it writes from there replace what came after).

>>> records_digest([3, 1, 2]) == records_digest([1, 2, 3])
True
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from dew.data.base import GLOBAL_POSITION, Consumption, DataPartition, is_global_position
from dew.errors import DewError
from dew.telemetry.render import append_lines, cut_torn_tail

__all__ = ["LEDGER", "Ledger", "LedgerGapError", "RecordLedger", "decoded_position", "joined", "records_digest"]

LEDGER = "ledger.jsonl"
_FLUSH_EVERY = 256  # lines held before a write, between checkpoints


def records_digest(records: ArrayLike) -> str:
    """A digest of a set of record ids that ignores their order (sorted, then SHA-256)."""
    ids = np.sort(np.asarray(records, dtype=np.int64).reshape(-1)).astype("<i8")
    return hashlib.sha256(ids.tobytes()).hexdigest()[:32]


class LedgerGapError(DewError, ValueError):
    """The batches one step read do not follow each other in the stream's global order."""


def joined(batches: Sequence[Consumption]) -> Consumption:
    """The consumption of one step that read several batches in turn (a refilled rollout's).

    Consecutive batches of one stream lie end to end in its global order, so
    the step read the positions from the first batch's to the last's, and
    their records in that order.

    >>> a = Consumption(0, 2, np.array([5, 1]), {"seed": 0})
    >>> b = Consumption(2, 4, np.array([3, 0]), {"seed": 0})
    >>> step = joined([a, b])
    >>> (step.first, step.end, step.records.tolist())
    (0, 4, [5, 1, 3, 0])
    """
    if not batches:
        raise ValueError("joined needs at least one batch's consumption.")
    for before, after in zip(batches, batches[1:], strict=False):
        if after.first != before.end or dict(after.order) != dict(before.order):
            raise LedgerGapError(
                f"One step read the stream's positions [{before.first}, {before.end}) under order "
                f"{dict(before.order)} and then [{after.first}, {after.end}) under {dict(after.order)}: "
                "the batches a step draws in turn must follow each other in one global order, or the "
                "ledger cannot say which records the step consumed. The stream's consumption() must "
                "report each next() batch's own positions."
            )
    if len(batches) == 1:
        return batches[0]
    records = np.concatenate([np.asarray(b.records, dtype=np.int64).reshape(-1) for b in batches])
    return Consumption(batches[0].first, batches[-1].end, records, batches[-1].order)


def decoded_position(position: bytes | None) -> dict[str, object] | None:
    """A saved data position as the ledger writes it: a global one's fields, else whether there was one."""
    if position is None:
        return None
    if is_global_position(position):
        return json.loads(position[len(GLOBAL_POSITION):])
    return {"opaque": True}


class Ledger(Protocol):
    """Where a Feed reports the records each step consumed (the seam ``dew audit`` reads through)."""

    def opened(self, step: int, position: bytes | None, partition: DataPartition) -> None:
        """A fit opened the stream at step, from position (None: the start), as partition of a pool."""

    def consumed(self, step: int, consumption: Consumption) -> None:
        """The global batches step read (counted from 1, as checkpoints are), joined into one."""

    def checkpoint(self, step: int, position: bytes | None) -> None:
        """A checkpoint of step saved position."""

    def close(self) -> None: ...


class RecordLedger:
    """The ledger as JSON lines appended to ``directory/ledger.jsonl`` (see the module docstring)."""

    def __init__(self, directory: str | Path, *, processes: int = 1) -> None:
        self.path = Path(directory) / LEDGER
        self.processes = processes
        self._lines: list[str] = []
        self._order: Mapping[str, object] | None = None

    def _add(self, row: dict[str, object], *, flush: bool = False) -> None:
        self._lines.append(json.dumps(row, sort_keys=True))
        if flush or len(self._lines) >= _FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._lines:
            return
        lines, self._lines = self._lines, []  # a write refused is not tried again when the fit closes
        append_lines(self.path, lines)

    def opened(self, step: int, position: bytes | None, partition: DataPartition) -> None:
        self._order = None
        cut_torn_tail(self.path)  # a line a crash cut short would swallow the fit's first one
        self._add({"kind": "open", "step": int(step), "position": decoded_position(position),
                   "processes": self.processes, "shares": partition.shares, "time": round(time.time(), 3)},
                  flush=True)

    def consumed(self, step: int, consumption: Consumption) -> None:
        order = dict(consumption.order)
        if order != self._order:
            self._order = order
            self._add({"kind": "order", "step": int(step), **order})
        self._add({"kind": "step", "step": int(step), "first": int(consumption.first),
                   "end": int(consumption.end), "digest": records_digest(consumption.records)})

    def checkpoint(self, step: int, position: bytes | None) -> None:
        self._add({"kind": "checkpoint", "step": int(step), "position": decoded_position(position)}, flush=True)

    def close(self) -> None:
        self.flush()
