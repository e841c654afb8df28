"""The lock-free hand-off of dew.tracking.background: nothing is lost or reordered while the
writer takes batches concurrently with the caller's appends."""

from __future__ import annotations

import time

import pytest

from dew.tracking.background import Channel, TrackerWriteError


@pytest.mark.parametrize("interval", [0.0, 0.002])
def test_every_item_arrives_once_in_order_while_the_writer_races_the_caller(interval: float) -> None:
    received: list[int] = []
    batches: list[int] = []

    def send(items: list[int]) -> None:
        batches.append(len(items))
        received.extend(items)
        time.sleep(0.0002)  # the caller keeps appending while a send is under way

    channel = Channel(send, "a list in memory", interval=interval)
    for number in range(20_000):
        channel.submit(number)
        if number % 997 == 0:
            time.sleep(0.001)  # let the writer catch up, so some batches start empty-handed
    assert channel.flush(timeout=120), "items were left unscheduled"
    channel.close()
    assert received == list(range(20_000))
    assert all(size > 0 for size in batches)  # an empty batch is never sent
    assert len(batches) > 1


def test_a_flush_after_each_item_returns_with_the_item_written() -> None:
    received: list[int] = []
    channel = Channel(received.extend, "a list in memory", interval=10.0)  # only a flush sends
    for number in range(50):
        channel.submit(number)
        assert channel.flush(timeout=30)
        assert received == list(range(number + 1))
    channel.close()


def test_a_failure_met_by_the_writer_is_raised_by_the_next_submit() -> None:
    def send(items: list[int]) -> None:
        raise OSError("disk full")

    channel = Channel(send, "a file on a full disk")
    channel.submit(1)
    channel.flush(timeout=30)
    with pytest.raises(TrackerWriteError, match="a file on a full disk: OSError: disk full"):
        channel.submit(2)
