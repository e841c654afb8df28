"""One background thread that writes every tracker's reports, so a step only enqueues.

A tracker owns a Channel: ``submit`` appends an item to a deque (no lock; a
microsecond on the training thread), and takes the writer's lock only for the
first item of a batch, to schedule it. The process's single writer thread
later hands the channel everything queued since its last batch, in order, to
the tracker's ``send``. A channel with an interval lets items build up that
long, so a backend with a high cost per request (an HTTP server) gets one
request per interval rather than one per step.

When ``send`` raises, the channel's policy decides. A channel that stops the
run on failure keeps the error and raises it, as a TrackerWriteError naming
where the tracker writes, on the next ``submit`` or at ``close``. A channel
that does not (remote trackers by default) keeps the items, retries with a
growing pause, and drops the oldest once more than ``buffer`` wait; when a
send succeeds again it tells its tracker how many were dropped
(``on_recover``), and ``close`` gives up after ``close_timeout`` seconds with
a warning instead of an error, so training is never stopped by it.

A synchronous channel (``synchronous=True``: LocalTracker's cheap appends)
sends on the caller's thread instead, in ``submit`` itself, under the same
policy: a failure that stops the run is raised by the call that met it, and
a tolerated one keeps the items for the next call after its pause.

On two cores the writer and the training loop share the interpreter: while
the writer holds it, the loop cannot dispatch its next step. A fit therefore
tells the writer when it waits for the device (``LOOP``): while a fit runs,
the writer starts a batch, and each item of it, only inside such a wait (or
once it has waited ``LoopWindow.patience`` seconds for one, so a loop that
never waits still gets its reports written). Every send's CPU time is
counted (``tracker_cpu_seconds``), on whichever thread it ran.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dew.errors import DewError

__all__ = ["LOOP", "Channel", "Dropped", "LoopWindow", "TrackerWarning", "TrackerWriteError",
           "let_others_run", "tracker_cpu_seconds"]


class LoopWindow:
    """When the training loops of this process wait for their devices.

    A fit calls ``enter`` when it starts and ``leave`` when it ends, and wraps
    each wait for the device in ``waiting()``. The window is open while no fit
    runs or while one waits: the writer thread does its work then, so it does
    not hold the interpreter while a loop dispatches a step.

    >>> window = LoopWindow()
    >>> window.is_open()
    True
    >>> window.enter()
    >>> window.is_open()
    False
    >>> with window.waiting():
    ...     window.is_open()
    True
    >>> window.leave()
    >>> window.is_open()
    True
    """

    patience = 0.1
    """Seconds a batch of the writer waits, in all, for the window before it goes on anyway."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No loop runs (a forked child starts so: it inherits no running fit)."""
        self._lock = threading.Lock()
        self._loops = 0
        self._waiting = 0
        self._open = threading.Event()
        self._open.set()

    def _update(self) -> None:
        if self._loops <= 0 or self._waiting > 0:
            self._open.set()
        else:
            self._open.clear()

    def enter(self) -> None:
        """A fit started: the writer now works while it waits."""
        with self._lock:
            self._loops += 1
            self._update()

    def leave(self) -> None:
        """A fit ended."""
        with self._lock:
            self._loops = max(0, self._loops - 1)
            self._update()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The caller waits for its device inside: the writer may run."""
        with self._lock:
            self._waiting += 1
            self._update()
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
                self._update()

    def is_open(self) -> bool:
        return self._open.is_set()

    def wait(self, timeout: float) -> bool:
        """Block until the window opens or timeout seconds pass; True when it is open."""
        return self._open.wait(timeout) if timeout > 0 else self._open.is_set()


LOOP = LoopWindow()
"""The process's window: dew.tracking.progress opens it around the loop's waits."""


class _CpuMeter:
    """The CPU seconds every channel's sends took, on whichever thread they ran."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds


_CPU = _CpuMeter()


def tracker_cpu_seconds() -> float:
    """The CPU time every tracker's sends have taken in this process so far, in seconds
    (the writer thread's work, and a synchronous tracker's on the caller's thread). A
    service a tracker talks to (W&B's own process, an MLflow server) is not counted."""
    return _CPU.seconds


class _Batch(threading.local):
    """On the writer thread: when its batch stops waiting for the loop's window (None: no batch)."""

    deadline: float | None = None


_BATCH = _Batch()


def let_others_run() -> None:
    """Hand the interpreter to any thread waiting for it (the training loop).

    A thread that wants the GIL back otherwise waits for the switch interval
    (5 ms) while the writer holds it; a tracker calls this between the items
    of a batch, so the loop waits at most one item's work. On the writer
    thread it also waits for the loop's window (see LoopWindow), within the
    batch's patience.
    """
    time.sleep(0)
    deadline = _BATCH.deadline
    if deadline is not None:
        LOOP.wait(deadline - time.monotonic())


class TrackerWriteError(DewError, RuntimeError):
    """A tracker could not write where it reports to; the message names the place."""


class TrackerWarning(UserWarning):
    """A tracker that does not stop the run failed to write, or dropped reports."""


@dataclass(frozen=True)
class Dropped:
    """What a channel lost while its tracker could not write: ``items`` reports
    (one per log or artifact call) between steps ``first_step`` and ``last_step``."""

    items: int
    first_step: int | None
    last_step: int | None
    error: str


class _Writer:
    """The process's writer thread and the channels with queued items."""

    def __init__(self) -> None:
        self.lock = threading.Condition(threading.Lock())
        self.ready: dict[Channel, None] = {}  # channels holding items, in arrival order
        self.thread: threading.Thread | None = None
        self.channels: weakref.WeakSet[Channel] = weakref.WeakSet()  # for flush_all

    def start(self) -> None:
        """Start the thread unless it runs (called with the lock held)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="dew-trackers", daemon=True)
            self.thread.start()

    def _due(self) -> tuple[list[tuple[Channel, list[Any]]], float | None]:
        """Take the batches that are due; else say how long until the next one is."""
        now = time.monotonic()
        batches, wait = [], None
        for channel in list(self.ready):
            if channel.busy:
                continue
            due = channel.retry_at if channel.hurry else max(channel.due, channel.retry_at)
            if due <= now:
                channel.queued = False  # before taking: an item added after it schedules anew
                batches.append((channel, channel.take()))
                channel.busy = True
                channel.hurry = False
                del self.ready[channel]
            else:
                left = due - now
                wait = left if wait is None else min(wait, left)
        return batches, wait

    def _run(self) -> None:
        while True:
            with self.lock:
                batches, wait = self._due()
                while not batches:
                    self.lock.wait(wait)
                    batches, wait = self._due()
            for channel, items in batches:
                if items:
                    _BATCH.deadline = time.monotonic() + LOOP.patience
                    LOOP.wait(LOOP.patience)
                    try:
                        channel.deliver(items)
                    finally:
                        _BATCH.deadline = None
                    let_others_run()
            with self.lock:
                for channel, _ in batches:
                    channel.busy = False
                    if channel.items or channel.queued:  # arrived or put back during the send
                        channel.queued = True
                        self.ready[channel] = None
                self.lock.notify_all()

    def flush_all(self) -> None:
        """At interpreter exit: write what every channel still holds (a tracker nobody
        closed), each within its close timeout, so the last rows are not lost."""
        for channel in list(self.channels):
            with contextlib.suppress(Exception):
                channel.flush(channel.close_timeout)

    def after_fork(self) -> None:
        """A forked child has no writer thread; the next submit starts one."""
        self.lock = threading.Condition(threading.Lock())
        self.ready = {}
        self.thread = None
        self.channels = weakref.WeakSet()
        LOOP.reset()


_WRITER = _Writer()
atexit.register(_WRITER.flush_all)
_register_at_fork = getattr(os, "register_at_fork", None)  # POSIX only
if _register_at_fork is not None:
    _register_at_fork(after_in_child=_WRITER.after_fork)


def _step_of(item: object) -> int | None:
    step = getattr(item, "step", None)  # an item is whatever its tracker submitted: a record, a tuple
    if step is None and isinstance(item, tuple) and len(item) >= 3:
        step = item[2]
    return step if isinstance(step, int) else None


Item = TypeVar("Item")  # what one tracker submits: a record, a (kind, value, step) tuple, ...


class Channel(Generic[Item]):
    """One tracker's queue on the shared writer thread.

    send receives a list of items in submission order and writes them all;
    where names the file or address, for error messages.

    >>> received = []
    >>> channel = Channel(received.extend, "a list in memory")
    >>> for step in range(3):
    ...     channel.submit(("log", {"loss": 1.0 / (step + 1)}, step))
    >>> channel.close()
    >>> [item[2] for item in received]
    [0, 1, 2]
    """

    def __init__(
        self,
        send: Callable[[list[Item]], None],
        where: str,
        *,
        interval: float = 0.0,
        stop_on_failure: bool = True,
        buffer: int = 10_000,
        retry: tuple[float, float] = (1.0, 30.0),
        close_timeout: float = 30.0,
        on_recover: Callable[[Dropped], None] | None = None,
        retryable: Callable[[BaseException], bool] = lambda error: True,
        synchronous: bool = False,
    ) -> None:
        self.send = send
        self.synchronous = synchronous
        self.where = where
        self.interval = interval
        self.stop_on_failure = stop_on_failure
        self.buffer = buffer
        self.retry = retry
        self.close_timeout = close_timeout
        self.on_recover = on_recover
        self.retryable = retryable
        # Appended by the caller without a lock; taken and put back under the writer's lock:
        self.items: deque[Item] = deque()
        # Guarded by the writer's lock (queued is read without it, see submit):
        self.queued = False  # scheduled with the writer (or to be, once its send ends)
        self.busy = False
        self.hurry = False
        self.due = 0.0  # when the batch building up is sent
        self.retry_at = 0.0  # not before this, after a failure
        # Written by the writer thread, read by the caller:
        self.error: BaseException | None = None
        self.failing: BaseException | None = None
        self.pause = retry[0]
        self.dropped = 0
        self.dropped_steps: tuple[int | None, int | None] = (None, None)
        _WRITER.channels.add(self)

    # -- the caller's side ---------------------------------------------------

    def submit(self, item: Item) -> None:
        """Queue item for the writer; raise a failure met since the last call."""
        if self.error is not None:
            self.check()
        self.items.append(item)
        if self.synchronous:
            if self.failing is None or time.monotonic() >= self.retry_at:  # not in a pause
                self._send_now()
            return
        # The writer clears queued before it takes a batch, so an item appended before it
        # reads queued False is either in that batch or scheduled here; an extra schedule
        # finds an empty batch, which is skipped.
        if not self.queued or len(self.items) > self.buffer:
            self._schedule()

    def _schedule(self) -> None:
        """The first item of a batch: make the batch due an interval from now."""
        writer = _WRITER
        with writer.lock:
            if not self.queued:
                self.queued = True
                self.due = time.monotonic() + self.interval
                if not self.busy:  # else the writer registers it when the send ends
                    writer.ready[self] = None
                    writer.lock.notify()
            if len(self.items) > self.buffer:
                self._overflow(writer)
            writer.start()

    def take(self) -> list[Item]:
        """Everything queued, oldest first, removed from the queue (under the writer's lock)."""
        items: list[Item] = []
        pop = self.items.popleft
        try:
            while True:
                items.append(pop())
        except IndexError:
            return items

    def _overflow(self, writer: _Writer) -> None:
        """Too many items wait: a failing remote drops the oldest, anything else waits."""
        if self.stop_on_failure or self.failing is None:
            self.hurry = True
            writer.lock.notify_all()
            while len(self.items) > self.buffer and self.error is None:
                writer.lock.wait(1.0)
            return
        extra = len(self.items) - self.buffer
        self._count_dropped([self.items.popleft() for _ in range(extra)])

    def _send_now(self) -> None:
        """A synchronous channel: send what is queued on this thread; raise what stops the run."""
        items = self.take()
        if items:
            self.deliver(items)
        self.check()

    def check(self) -> None:
        """Raise the failure the writer met for this channel, once."""
        error, self.error = self.error, None
        if error is not None:
            raise error

    def flush(self, timeout: float | None = None, *, through_outage: bool = True) -> bool:
        """Wait until everything queued is written (or given up on); True when it was.

        through_outage=False returns at once (False) while a tolerated failure lasts: a remote
        in an outage keeps its backlog retrying rather than holding the caller.
        """
        writer = _WRITER
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.synchronous:
            return self._flush_now(deadline)
        with writer.lock:
            self.hurry = True
            self.retry_at = 0.0  # a failing remote gets one attempt now, then its pauses
            writer.lock.notify_all()
            while self.items or self.busy:
                left = None if deadline is None else deadline - time.monotonic()
                if not through_outage and self.failing is not None and not self.stop_on_failure:
                    left = 0
                if left is not None and left <= 0:
                    self.hurry = False
                    return False
                writer.lock.wait(left if left is None else min(left, 1.0))
            self.hurry = False
        return True

    def _flush_now(self, deadline: float | None) -> bool:
        """A synchronous channel's flush: send what waits, retrying until the deadline."""
        while True:
            items = self.take()
            if items:
                self.deliver(items)
            if not self.items or self.error is not None:
                return not self.items
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            time.sleep(min(self.pause, left) if left is not None else self.pause)

    def close(self) -> None:
        """Write what is queued, then raise a failure or warn of what was lost."""
        timeout = None if self.stop_on_failure else self.close_timeout
        if not self.flush(timeout):
            with _WRITER.lock:
                lost = self.take()
                self.queued = False
                _WRITER.ready.pop(self, None)
            self._count_dropped(lost)
        if self.dropped:
            warnings.warn(
                f"{self.where}: {self.dropped} reports (steps {self.dropped_steps[0]} to "
                f"{self.dropped_steps[1]}) could not be written and were dropped; last error: "
                f"{self.failing}", TrackerWarning, stacklevel=3)
            self.dropped = 0
        self.check()

    # -- the writer's side ---------------------------------------------------

    def _count_dropped(self, items: list[Item]) -> None:
        if not items:
            return
        steps = [s for s in (_step_of(item) for item in items) if s is not None]
        first, last = self.dropped_steps
        if steps:
            first = min(steps) if first is None else min(first, *steps)
            last = max(steps) if last is None else max(last, *steps)
        self.dropped += len(items)
        self.dropped_steps = (first, last)

    def _named(self, error: BaseException) -> TrackerWriteError:
        if isinstance(error, TrackerWriteError):
            return error
        from dew.telemetry.redaction import redact_text

        named = TrackerWriteError(redact_text(f"{self.where}: {type(error).__name__}: {error}"))
        named.__cause__ = error
        return named

    def deliver(self, items: list[Item]) -> None:
        """On the writer thread: send items, applying the failure policy (its CPU time counted)."""
        began = time.thread_time()
        try:
            self._deliver(items)
        finally:
            _CPU.add(time.thread_time() - began)

    def _deliver(self, items: list[Item]) -> None:
        try:
            self.send(items)
        except Exception as error:  # noqa: BLE001 - surfaced on the caller's thread
            named = self._named(error)
            if self.stop_on_failure:
                if self.error is None:
                    self.error = named
                return
            if not self.retryable(named):
                self._count_dropped(items)
                warnings.warn(f"{named} ({len(items)} reports dropped; training continues)",
                              TrackerWarning, stacklevel=2)
                self.failing = named  # the next send that succeeds reports the drop
                return
            if self.failing is None:
                warnings.warn(f"{named} (retrying; training continues)", TrackerWarning,
                              stacklevel=2)
            self.failing = named
            with _WRITER.lock:
                self.items.extendleft(reversed(items))
                extra = len(self.items) - self.buffer
                if extra > 0:
                    self._count_dropped([self.items.popleft() for _ in range(extra)])
                self.retry_at = time.monotonic() + self.pause
                self.pause = min(self.pause * 2, self.retry[1])
            return
        if self.failing is not None:
            failing, self.failing = self.failing, None
            self.pause = self.retry[0]
            if self.dropped and self.on_recover is not None:
                dropped = Dropped(self.dropped, *self.dropped_steps, str(failing))
                self.dropped, self.dropped_steps = 0, (None, None)
                try:
                    self.on_recover(dropped)
                except Exception as error:  # noqa: BLE001 - a report about a report
                    warnings.warn(f"{self.where}: could not report {dropped}: {error}",
                                  TrackerWarning, stacklevel=2)
