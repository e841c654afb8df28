"""ramped: a Dataset whose global batch grows over the first steps of a run.

A ramp is a schedule of ``(step, batch)`` pairs: from ``step`` on, every
global batch holds ``batch`` rows, until the next pair. ``ramped(dataset,
start=8, steps=1000)`` builds one that grows linearly from 8 rows at step 0
to ``dataset.batch`` at step 1000, in multiples of ``start`` so that the run
compiles only a few batch shapes (the trainer keeps one compiled step per
batch size it sees). Every size must divide among the data shares.

Records are consumed in train_stream's global order whatever the batch: the
stream's position stays a global record count, now with the step beside it,
so a ramped run resumes exactly, at any process count.

>>> import numpy as np
>>> from dew.data import Dataset, DataPartition
>>> from dew.data.sources import ArrayRecords
>>> from dew.data.stream import StreamReader
>>> data = Dataset(train=StreamReader(ArrayRecords({"x": np.arange(100)}), batch=8), batch=8)
>>> stream = ramped(data, [(0, 2), (2, 4), (3, 8)]).train(DataPartition())
>>> [len(next(stream)["x"]) for _ in range(5)]
[2, 2, 4, 8, 8]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dew.data.base import GLOBAL_POSITION, SINGLE, Consumption, DataPartition, Dataset
from dew.data.errors import RampError
from dew.data.stream import StepScheduled, StreamReader, TrainStream, decode_position, source_fields

__all__ = ["RampedReader", "RampedStream", "linear_schedule", "ramped"]

Schedule = tuple[tuple[int, int], ...]


def linear_schedule(start: int, full: int, steps: int) -> Schedule:
    """Batches rising linearly from start (step 0) to full (step ``steps``), in multiples of start."""
    if not 1 <= start <= full:
        raise RampError(f"A ramp must start at 1 to {full} rows (the full batch); got start={start}.")
    if steps < 1:
        raise RampError(f"A ramp must last at least one step; got steps={steps}.")
    schedule: list[tuple[int, int]] = []
    for step in range(steps + 1):
        size = full if step == steps else min(full, (start + (full - start) * step // steps) // start * start)
        if not schedule or schedule[-1][1] != size:
            schedule.append((step, size))
    return tuple(schedule)


def _checked(schedule: Sequence[tuple[int, int]]) -> Schedule:
    pairs = tuple((int(step), int(batch)) for step, batch in schedule)
    if not pairs or pairs[0][0] != 0:
        raise RampError(f"A ramp schedule must begin with a (0, batch) pair; got {list(pairs)}.")
    steps = [step for step, _ in pairs]
    if steps != sorted(set(steps)):
        raise RampError(f"A ramp schedule's steps must strictly increase; got {steps}.")
    if any(batch < 1 for _, batch in pairs):
        raise RampError(f"Every batch of a ramp schedule must be at least 1; got {list(pairs)}.")
    sizes = [batch for _, batch in pairs]
    if sizes != sorted(sizes):  # the Dataset's batch is the last size: a shrinking one would under-report it
        raise RampError(f"A ramp grows the batch, so its sizes may not decrease; got {list(pairs)}: give each "
                        "size at least the one before it.")
    return pairs


def batch_at(schedule: Schedule, step: int) -> int:
    """The global batch of step under schedule."""
    starts = [s for s, _ in schedule]
    return schedule[int(np.searchsorted(starts, step, side="right")) - 1][1]


def records_before(schedule: Schedule, step: int) -> int:
    """Records consumed by the steps before step."""
    total = 0
    for i, (begin, batch) in enumerate(schedule):
        end = schedule[i + 1][0] if i + 1 < len(schedule) else None
        stop = step if end is None else min(step, end)
        total += max(0, stop - begin) * batch
    return total


def step_of(schedule: Schedule, records: int) -> int:
    """The step that starts at record ``records`` (the inverse of records_before)."""
    consumed = 0
    for i, (begin, batch) in enumerate(schedule):
        end = schedule[i + 1][0] if i + 1 < len(schedule) else None
        if end is None or records < consumed + (end - begin) * batch:
            return begin + (records - consumed) // batch
        consumed += (end - begin) * batch
    raise AssertionError("unreachable: the last segment of a schedule is endless")


class RampedStream:
    """This share's rows at each step's scheduled batch; a global position with the step."""

    def __init__(self, reader: StreamReader, schedule: Schedule, partition: DataPartition) -> None:
        self.reader, self.schedule, self.partition = reader, schedule, partition
        for _, batch in schedule:
            if batch % partition.shares:
                raise RampError(
                    f"The ramp's batch of {batch} rows does not divide among {partition.shares} "
                    f"data shares; use ramp sizes that are multiples of {partition.shares}."
                )
        self.step = 0
        self.records = 0
        self._stream: TrainStream | None = None

    def __iter__(self) -> RampedStream:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = batch_at(self.schedule, self.step)
        if self._stream is None or self._stream.batch != batch:
            self.close()
            self._stream = self.reader.open(self.partition, batch=batch, start=self.records)
        out = next(self._stream)
        self.step += 1
        self.records += batch
        return out

    def scalars(self) -> Mapping[str, float]:
        """The scalars of the stream at this step's size (a mixture's ``data/<source>/records``)."""
        return {} if self._stream is None else self._stream.scalars()

    def consumption(self) -> Consumption:
        """The global batch the last ``next()`` returned rows of (the stream at that step's size)."""
        if self._stream is None:
            raise RuntimeError("consumption() describes the last batch; call next() first.")
        return self._stream.consumption()

    def get_state(self) -> bytes:
        fields = {"records": self.records, "step": self.step, "seed": self.reader.seed,
                  "batch": batch_at(self.schedule, self.step), "size": len(self.reader.source),
                  **source_fields(self.reader.source, self.records)}
        return GLOBAL_POSITION + json.dumps(fields, sort_keys=True).encode()

    def set_state(self, state: bytes) -> None:
        fields = decode_position(state)
        probe = self.reader.open(self.partition, batch=self.reader.batch)
        probe.set_state(state)  # the stream's own checks: seed, dataset size and layout
        self.close()
        self.records = int(fields["records"])
        self.step = int(fields["step"]) if "step" in fields else step_of(self.schedule, self.records)

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


@dataclass(frozen=True)
class RampedReader:
    """A Dataset.train factory that opens a RampedStream over a StreamReader."""

    reader: StreamReader
    schedule: Schedule

    def __call__(self, partition: DataPartition = SINGLE) -> RampedStream:
        return RampedStream(self.reader, self.schedule, partition)


def ramped(dataset: Dataset, schedule: Sequence[tuple[int, int]] | None = None, *,
           start: int | None = None, steps: int | None = None) -> Dataset:
    """The dataset with its global batch following a ramp.

    Give schedule, ``(step, batch)`` pairs beginning at step 0, or start and
    steps for linear_schedule(start, dataset.batch, steps). The returned
    Dataset keeps val and records; its batch is the ramp's last size. Only
    readers built on train_stream (TokenWindows, HFImages, StreamReader) can
    change their batch mid-stream; others raise RampError.
    """
    if (schedule is None) == (start is None):
        raise RampError("ramped takes either a schedule of (step, batch) pairs or start= and steps=.")
    if schedule is None:
        assert start is not None  # one of the two is given, checked above
        schedule = linear_schedule(int(start), dataset.batch, int(steps if steps is not None else 1))
    pairs = _checked(schedule)
    reader = dataset.train
    if isinstance(reader, RampedReader):
        reader = reader.reader
    if not isinstance(reader, StreamReader):
        raise RampError(
            f"ramped needs a dataset whose train reader is a train_stream StreamReader (as "
            f"TokenWindows and HFImages build); got {type(reader).__name__}, which cannot change its "
            f"batch size mid-stream. Build the Dataset with StreamReader, or ramp inside your reader."
        )
    if isinstance(reader.source, StepScheduled):  # a mixture's schedule, placed at the ramp's steps
        reader = dataclasses.replace(reader, source=reader.source.at_steps(lambda step: records_before(pairs, step)))
    return Dataset(train=RampedReader(reader, pairs), val=dataset.val, records=dataset.records,
                   batch=pairs[-1][1], ramp=pairs)
