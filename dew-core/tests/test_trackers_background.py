"""The tracker thread (dew.tracking.background): one thread for every tracker, items in
order and batched, failures raised on the caller's thread or retried within a bound."""

from __future__ import annotations

import re
import threading
import time
import warnings

import pytest

from dew.tracking.background import Channel, Dropped, TrackerWarning, TrackerWriteError


def test_every_channel_is_sent_in_order_by_one_thread():
    received: dict[str, list[int]] = {"a": [], "b": []}
    threads: set[str] = set()

    def sink(name):
        def send(items):
            threads.add(threading.current_thread().name)
            received[name].append(list(items))
        return send

    first, second = Channel(sink("a"), "sink a"), Channel(sink("b"), "sink b", interval=0.2)
    for item in range(200):
        first.submit(item)
        second.submit(item)
    first.close()
    second.close()
    assert [i for batch in received["a"] for i in batch] == list(range(200))
    assert [i for batch in received["b"] for i in batch] == list(range(200))
    assert len(received["b"]) < 200  # the interval let a batch build up
    assert threads == {"dew-trackers"}  # never the caller's thread, one for both


def test_a_failure_is_raised_on_the_next_call_and_names_the_place():
    def broken(items):
        raise OSError(28, "No space left on device")

    channel = Channel(broken, "LocalTracker at /runs/x")
    channel.submit(("log", {"loss": 1.0}, 1))
    assert channel.flush(timeout=30)
    with pytest.raises(TrackerWriteError, match=r"/runs/x.*No space left") as caught:
        channel.submit(("log", {"loss": 1.0}, 2))
    assert isinstance(caught.value.__cause__, OSError)
    channel.submit(("log", {"loss": 1.0}, 3))
    with pytest.raises(TrackerWriteError, match="/runs/x"):
        channel.close()


def test_a_remote_that_fails_is_retried_and_reports_what_it_dropped():
    up = threading.Event()
    sent: list[int] = []
    recovered: list[Dropped] = []

    def flaky(items):
        if not up.is_set():
            raise ConnectionError("server at http://127.0.0.1:1 went away")
        sent.extend(item[2] for item in items)

    channel = Channel(flaky, "MLflowTracker at http://127.0.0.1:1", stop_on_failure=False,
                      buffer=5, retry=(0.05, 0.1), on_recover=recovered.append)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(20):
            channel.submit(("log", {"loss": 1.0}, step))  # never raises: training goes on
            time.sleep(0.01)
        up.set()
        channel.close()
    assert any("went away" in str(w.message) and "retrying" in str(w.message) for w in seen)
    assert sent == sorted(sent) and sent[-5:] == list(range(15, 20))  # newest kept, in order
    (dropped,) = recovered
    assert dropped.items + len(sent) == 20
    assert dropped.last_step == 20 - len(sent) - 1 and "went away" in dropped.error


def test_close_gives_up_on_a_remote_that_stays_away_within_its_timeout():
    def down(items):
        raise ConnectionError("connection refused")

    with pytest.warns(TrackerWarning) as caught:  # "retrying" while it is down, then what was lost
        channel = Channel(down, "MLflowTracker at http://127.0.0.1:1", stop_on_failure=False,
                          retry=(0.05, 0.1), close_timeout=0.5)
        for step in range(3):
            channel.submit(("log", {"loss": 1.0}, step))
        began = time.monotonic()
        channel.close()
    assert time.monotonic() - began < 10
    messages = [str(w.message) for w in caught]
    assert any(re.search(r"127\.0\.0\.1:1: 3 reports \(steps 0 to 2\)", m) for m in messages), messages


def test_rows_of_a_tracker_nobody_closed_are_written_at_exit(tmp_path, python_in_subprocess):
    python_in_subprocess(f"""
        from dew.tracking.local import LocalTracker
        tracker = LocalTracker({str(tmp_path)!r})
        for step in range(1, 101):
            tracker.log({{"loss": 1.0 / step}}, step=step)
    """)  # exits at once, with the rows still queued for the tracker thread
    rows = (tmp_path / "scalars.jsonl").read_text().splitlines()
    assert len(rows) == 100 and rows[-1] == '{"step": 100, "loss": 0.01}'


def test_items_that_arrive_during_a_slow_send_wait_for_the_next_interval():
    batches: list[int] = []

    def slow(items):  # a request that takes a while, as an HTTP server's does
        batches.append(len(items))
        time.sleep(0.05)

    channel = Channel(slow, "a slow server", interval=0.3)
    began = time.monotonic()
    for step in range(300):  # about 1.5 s of steps, 5 ms apart (longer on a busy machine)
        channel.submit(("log", {"loss": 1.0}, step))
        time.sleep(0.005)
    elapsed = time.monotonic() - began
    channel.close()
    assert sum(batches) == 300
    # one request an interval, not one per send's length: bounded by the time the steps took,
    # as measured, so a busy machine that stretches the loop stretches the bound with it
    assert len(batches) <= elapsed / 0.3 + 2, (batches, elapsed)
