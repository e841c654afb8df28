"""DatasetReaderKit: a reader's stream resumes from a saved position, at any process count.

A reader's ``load`` gives a ``dew.data.Dataset`` whose ``train(partition)``
opens this process's share of every global batch. A checkpoint saves the
stream's ``get_state()`` and a resumed run (perhaps on another number of
processes) calls ``set_state`` on a fresh stream. Subclass and supply the
loaded dataset::

    class TestMyReader(DatasetReaderKit):
        def dataset(self):
            return MyReader(...).load(batch=8, seed=0)

The tests read a few batches, save the position, resume a fresh stream and
compare what follows with an uninterrupted stream; split the batch among
``shares`` processes (``DataPartition``) and check the shares put together
(share 0's rows first) are the single process's batches; and resume a
position saved by one process on several, and the reverse. A position that
only the share that saved it can read (not ``dew.data.GLOBAL_POSITION``)
fails the last test.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dew.data.base import (
    SINGLE,
    DataPartition,
    Dataset,
    Resumable,
    close_if_closable,
    is_global_position,
)

__all__ = ["DatasetReaderKit"]


def _take(stream: Iterator, count: int) -> list[dict[str, np.ndarray]]:
    return [{k: np.asarray(v) for k, v in batch.items()} for batch in itertools.islice(stream, count)]


def _close(stream: Any) -> None:
    close_if_closable(stream)


def _join(shares: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([s[k] for s in shares]) for k in shares[0]}


def _same(got: Sequence[Mapping[str, np.ndarray]], expected: Sequence[Mapping[str, np.ndarray]],
          what: str) -> None:
    assert len(got) == len(expected), f"{what}: {len(got)} batches, expected {len(expected)}."
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert sorted(a) == sorted(b), f"{what}: batch {index} has keys {sorted(a)}, expected {sorted(b)}."
        for key in a:
            assert a[key].shape == b[key].shape and np.array_equal(a[key], b[key]), (
                f"{what}: batch {index} differs under {key!r} (shapes {a[key].shape} and {b[key].shape}).")


class DatasetReaderKit:
    """Conformance tests for a dataset reader (see the module docstring)."""

    before: int = 3
    after: int = 3
    shares: tuple[int, ...] = (2,)

    def dataset(self) -> Dataset:
        """The reader's Dataset, loaded with a global batch that every count in shares divides."""
        raise NotImplementedError(f"{type(self).__name__} must define dataset().")

    def _open(self, dataset: Dataset, partition: DataPartition = SINGLE) -> Iterator:
        return iter(dataset.train(partition))

    def _uninterrupted(self, dataset: Dataset) -> list[dict[str, np.ndarray]]:
        stream = self._open(dataset)
        try:
            return _take(stream, self.before + self.after)
        finally:
            _close(stream)

    def _saved(self, dataset: Dataset, partition: DataPartition = SINGLE) -> bytes:
        stream = self._open(dataset, partition)
        try:
            assert isinstance(stream, Resumable), (
                f"Dataset.train returned a {type(stream).__name__} without get_state/set_state, so "
                "a resumed run replays the stream from its start; build it on dew.data.train_stream.")
            _take(stream, self.before)
            return stream.get_state()
        finally:
            _close(stream)

    def _resumed(self, dataset: Dataset, position: bytes, partition: DataPartition) -> list[dict]:
        stream = self._open(dataset, partition)
        try:
            assert isinstance(stream, Resumable), f"{type(stream).__name__} has no set_state."
            stream.set_state(position)
            return _take(stream, self.after)
        finally:
            _close(stream)

    def test_batches_hold_the_global_batch(self) -> None:
        dataset = self.dataset()
        (batch,) = _take(self._open(dataset), 1)
        assert batch, "The first batch is empty."
        rows = {k: v.shape[0] if v.ndim else None for k, v in batch.items()}
        assert set(rows.values()) == {dataset.batch}, (
            f"Every array of a batch must have the global batch ({dataset.batch}) as its first "
            f"axis on one process; got {rows}.")

    def test_saved_position_resumes_the_stream(self) -> None:
        dataset = self.dataset()
        expected = self._uninterrupted(dataset)
        resumed = self._resumed(dataset, self._saved(dataset), SINGLE)
        _same(resumed, expected[self.before:], "The resumed stream")

    def test_shares_together_are_the_single_stream(self) -> None:
        dataset = self.dataset()
        expected = self._uninterrupted(dataset)
        for count in self.shares:
            streams = [self._open(dataset, DataPartition(share, count)) for share in range(count)]
            try:
                parts = [_take(s, len(expected)) for s in streams]
            finally:
                for s in streams:
                    _close(s)
            joined = [_join([p[i] for p in parts]) for i in range(len(expected))]
            _same(joined, expected, f"{count} shares put together")

    def test_position_resumes_at_another_process_count(self) -> None:
        dataset = self.dataset()
        expected = self._uninterrupted(dataset)[self.before:]
        position = self._saved(dataset)
        assert is_global_position(position), (
            "The stream's position is not a global one (dew.data.GLOBAL_POSITION), so a run cannot "
            "resume on another number of processes; count records of the whole global stream.")
        for count in self.shares:
            parts = [self._resumed(dataset, position, DataPartition(share, count)) for share in range(count)]
            joined = [_join([p[i] for p in parts]) for i in range(self.after)]
            _same(joined, expected, f"One process's position resumed on {count}")
            back = self._saved(dataset, DataPartition(0, count))
            _same(self._resumed(dataset, back, SINGLE), expected,
                  f"A position saved by share 0 of {count}, resumed on one process")
