"""ramped: batch sizes follow the schedule, records follow the global order, resume is exact."""

from __future__ import annotations

import numpy as np
import pytest

from dew.data import DataPartition, Dataset, ramped
from dew.data.errors import BatchDivisionError, RampError
from dew.data.ramp import linear_schedule, records_before, step_of
from dew.data.sources import ArrayRecords
from dew.data.stream import StreamReader, train_stream

SCHEDULE = [(0, 2), (3, 4), (5, 8)]


def data(batch: int = 8) -> Dataset:
    return Dataset(train=StreamReader(ArrayRecords({"id": np.arange(29)}), batch=batch, seed=4), batch=batch)


def test_sizes_follow_the_schedule_and_rows_follow_the_global_order():
    stream = ramped(data(), SCHEDULE).train(DataPartition())
    got = [next(stream)["id"] for _ in range(8)]
    assert [len(b) for b in got] == [2, 2, 2, 4, 4, 8, 8, 8]
    # The same records as an unramped stream, one at a time.
    one = train_stream(ArrayRecords({"id": np.arange(29)}), batch=1, seed=4)
    flat = np.concatenate([next(one)["id"] for _ in range(sum(len(b) for b in got))])
    np.testing.assert_array_equal(np.concatenate(got), flat)


def test_resume_at_every_step_and_at_another_share_count():
    reference = [next(s)["id"] for s in [ramped(data(), SCHEDULE).train(DataPartition())] for _ in range(9)]
    stream = ramped(data(), SCHEDULE).train(DataPartition(1, 2))
    for k in range(9):
        position = stream.get_state()
        resumed = ramped(data(), SCHEDULE).train(DataPartition())
        resumed.set_state(position)
        for want in reference[k:]:
            np.testing.assert_array_equal(next(resumed)["id"], want)
        half = next(stream)["id"]
        np.testing.assert_array_equal(half, reference[k][len(reference[k]) // 2:])


def test_a_ramped_position_saved_over_other_contents_is_refused():
    # A ramped stream's position kept no content digest (a plain stream's does): a resume over data
    # edited since, as many records, trained on other records without a word.
    from dew.data.errors import PositionMismatchError

    stream = ramped(data(), SCHEDULE).train(DataPartition())
    for _ in range(4):
        next(stream)
    position = stream.get_state()
    edited = Dataset(train=StreamReader(ArrayRecords({"id": np.arange(29)[::-1].copy()}), batch=8, seed=4), batch=8)
    resumed = ramped(edited, SCHEDULE).train(DataPartition())
    with pytest.raises(PositionMismatchError, match="contents differ"):
        resumed.set_state(position)
    again = ramped(data(), SCHEDULE).train(DataPartition())
    again.set_state(position)  # the same data resumes
    assert len(next(again)["id"]) == 4


def test_linear_schedule_and_its_inverse():
    assert linear_schedule(8, 64, 100) == ((0, 8), (15, 16), (29, 24), (43, 32), (58, 40), (72, 48), (86, 56), (100, 64))
    pairs = linear_schedule(2, 16, 10)
    for step in range(30):
        assert step_of(pairs, records_before(pairs, step)) == step
    full = ramped(data(64), start=8, steps=100)
    assert full.batch == 64


def test_bad_ramps_are_refused():
    with pytest.raises(RampError, match=r"begin with a \(0, batch\) pair"):
        ramped(data(), [(1, 2)])
    with pytest.raises(RampError, match="strictly increase"):
        ramped(data(), [(0, 2), (3, 4), (3, 8)])
    with pytest.raises(RampError, match=r"its sizes may not decrease; got \[\(0, 8\), \(2, 4\)\]"):
        ramped(data(), [(0, 8), (2, 4)])  # accepted, and its Dataset said its batch was 4
    with pytest.raises(RampError, match=r"6 rows does not divide among 4"):
        ramped(data(), [(0, 6), (2, 8)]).train(DataPartition(0, 4))
    generic = Dataset(train=lambda partition: iter([]), batch=8)
    with pytest.raises(RampError, match="cannot change its batch size"):
        ramped(generic, start=2, steps=4)
    assert issubclass(RampError, ValueError) and issubclass(BatchDivisionError, ValueError)
