"""The trackers' writer keeps off the training loop: it sends while a fit waits for its device,
and the CPU time its sends take is counted and logged as ``telemetry/tracker_cpu_seconds``."""

from __future__ import annotations

import json
import threading
import time

import jax
import optax

from dew import Trainer
from dew.testing.doubles import Regression, regression_dataset
from dew.tracking.background import LOOP, Channel, LoopWindow, tracker_cpu_seconds
from dew.tracking.composite import Trackers
from dew.tracking.local import LocalTracker


def _burn(seconds: float) -> None:
    """Spend seconds of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_while_a_fit_dispatches_the_writer_waits_and_sends_inside_the_loops_wait(monkeypatch):
    monkeypatch.setattr(LoopWindow, "patience", 30.0)  # the writer waits for the window alone
    window_open_at_send: list[bool] = []
    received: list[int] = []

    def send(items: list[int]) -> None:
        window_open_at_send.append(LOOP.is_open())
        received.extend(items)

    channel = Channel(send, "a list in memory")
    LOOP.enter()
    try:
        for number in range(5):
            channel.submit(number)
        time.sleep(0.3)
        assert received == []  # the loop was dispatching all along: nothing was sent
        with LOOP.waiting():
            assert channel.flush(timeout=30)
        assert received == list(range(5))
        assert window_open_at_send and all(window_open_at_send)
    finally:
        LOOP.leave()
    channel.submit(5)  # no fit runs: the writer sends at once
    assert channel.flush(timeout=30) and received == list(range(6))
    channel.close()


def test_a_writer_batch_waits_at_most_its_patience_for_a_loop_that_never_waits(monkeypatch):
    monkeypatch.setattr(LoopWindow, "patience", 0.05)
    received: list[int] = []
    channel = Channel(received.extend, "a list in memory")
    LOOP.enter()
    try:
        channel.submit(1)
        assert channel.flush(timeout=30) and received == [1]
    finally:
        LOOP.leave()
    channel.close()


def test_tracker_cpu_seconds_counts_the_cpu_every_send_takes_on_either_thread():
    before_total, before_process = tracker_cpu_seconds(), time.process_time()
    background = Channel(lambda items: _burn(0.02 * len(items)), "a busy sink")
    synchronous = Channel(lambda items: _burn(0.02 * len(items)), "a busy sink", synchronous=True)
    for number in range(3):
        background.submit(number)
        synchronous.submit(number)
    background.close()
    synchronous.close()
    spent = tracker_cpu_seconds() - before_total
    assert 6 * 0.02 <= spent <= time.process_time() - before_process


class _Busy:
    """A tracker whose writes cost 3 ms of CPU each, sent by dew's writer thread."""

    def __init__(self) -> None:
        self.sent = 0
        self.channel = Channel(self._send, "a busy tracker")
        self.thread: list[str] = []

    def _send(self, items: list[object]) -> None:
        for _ in items:
            _burn(0.003)
            self.sent += 1
        self.thread.append(threading.current_thread().name)

    def log(self, scalars, step):
        self.channel.submit(step)

    def artifact(self, value, step):
        self.channel.submit(step)

    def close(self):
        self.channel.close()


def test_a_fit_logs_the_trackers_cpu_seconds_and_leaves_the_loop_window_open(tmp_path):
    before = tracker_cpu_seconds()
    busy, local = _Busy(), LocalTracker(tmp_path)
    Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0), tracker=Trackers(busy, local)).fit(
        regression_dataset(rows=8), steps=12, log_every=1)
    assert LOOP.is_open()  # the fit is over: the writer is free again
    rows = [json.loads(line) for line in (tmp_path / "scalars.jsonl").read_text().splitlines()]
    spent = [row["telemetry/tracker_cpu_seconds"] for row in rows]
    # counted from the fit's start; the local journal's synchronous writes count from step 1 on
    assert len(spent) == 12 and spent == sorted(spent) and spent[-1] > 0
    busy.close()
    local.close()
    assert set(busy.thread) == {"dew-trackers"}
    # every report the busy tracker received (12 logs, the run's start and its goodput) cost
    # 3 ms of CPU on the writer thread, all counted; the logged figures were read before that
    total = tracker_cpu_seconds() - before
    assert busy.sent == 14 and total >= 0.003 * busy.sent and spent[-1] <= total
