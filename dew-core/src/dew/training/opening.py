"""A stream's first batch read on a thread while the fit places its state.

A fit opens its data stream before it places the state (restores it, or
compiles and runs the initializer), so the stream's start-up (Grain's
worker processes starting, the first windows tokenized and packed) runs
beside work the fit does anyway. ``FirstRead`` reads the first batch on a
thread; the step loop takes it (waiting only for what is left), and an
error the read raised is raised there, where a user sees a data error.

A fresh state can be built the same way: ``Pending`` compiles and runs the
initializer on a thread while the loop reads the first batch and compiles
the step from the state's shapes (when the execution can, and no rollout
reads the state to make the batch), so the two compilations overlap
instead of following each other; the loop waits for the state only to run
the first step. An error the initializer raised is raised there.

``closing_on_sigterm`` covers the start-up: a SIGTERM that arrives while
the state is placed closes the stream (its worker processes end) before
the signal ends the process, as it did before the stream was open.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

import jax

if TYPE_CHECKING:
    from dew.checkpoints.manager import Checkpoints
    from dew.training.execution import Execution
    from dew.training.feed import Feed
    from dew.training.placement.layout import Placement
    from dew.training.state import TrainState

__all__ = ["FirstRead", "InterceptsJax", "Pending", "builds_ahead", "closing_on_sigterm", "ending",
           "start_placed"]

_CLOSE_WAIT_SECONDS = 10.0  # how long closing waits for a read under way before closing the stream under it


_T = TypeVar("_T")


class FirstRead(Generic[_T]):
    """The first next() of stream, run on a thread from construction; ``take`` waits for it."""

    def __init__(self, stream: Iterator[_T]) -> None:
        self.started = time.perf_counter()
        self._stream = stream
        self._batch: tuple[_T] | None = None  # (the batch,) once read
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="dew-feed-first-batch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self._batch = (next(self._stream),)
        except BaseException as error:  # noqa: BLE001 - raised again by take(), in the step loop
            self._error = error

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def take(self) -> _T:
        """The first batch, once read (the stream's own error, StopIteration included, if it failed)."""
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error.with_traceback(error.__traceback__)
        read, self._batch = self._batch, None
        assert read is not None, "FirstRead.take is called once"
        return read[0]

    def settle(self, timeout: float = _CLOSE_WAIT_SECONDS) -> None:
        """Wait (up to timeout) for the read under way, before the stream is closed under it."""
        self._thread.join(timeout)


@runtime_checkable
class InterceptsJax(Protocol):
    """A model whose calls swap jax functions for the whole process while they run (qwix's LoRA and
    quantization wrappers): tracing it on one thread while another calls jax races with the swap."""

    intercepts_jax: bool


@runtime_checkable
class _HoldsModel(Protocol):
    model: object


def builds_ahead(execution: Execution, rollout: object | None, objective: object = None) -> bool:
    """Whether a fresh state may be built on a thread (``Pending``) while the step compiles.

    Not when the objective's model intercepts jax (InterceptsJax: the build's own jax calls
    met the compile's swapped functions, a KeyError inside qwix), nor when a rollout makes the
    first batch from the state, nor when the
    execution compiles from the state's arrays, nor when JAX's persistent
    compilation cache evicts (``jax_compilation_cache_max_size`` set): its
    eviction reads every entry's access-time file under a file lock that
    two threads of one process both hold, so a second thread's entry written
    between the two can fail the first's save.
    """
    settings = jax.config.values
    evicting = bool(settings["jax_compilation_cache_dir"]) and settings["jax_compilation_cache_max_size"] != -1
    intercepting = isinstance(objective, _HoldsModel) and isinstance(objective.model, InterceptsJax)
    return rollout is None and execution.compiles_from_shapes and not evicting and not intercepting


class Pending:
    """A fresh state being built on a thread: its shapes and shardings now, the state at ``result``."""

    def __init__(self, build: Callable[[], TrainState], template: TrainState) -> None:
        self.template = template  # the state as ShapeDtypeStructs carrying their shardings
        self._state: TrainState | None = None
        self._error: BaseException | None = None
        # Not a daemon: an interpreter that ends while XLA compiles on this thread crashes (SIGSEGV).
        self._thread = threading.Thread(target=self._build, args=(build,), name="dew-initial-state")
        self._thread.start()

    def _build(self, build: Callable[[], TrainState]) -> None:
        try:
            self._state = build()
        except BaseException as error:  # noqa: BLE001 - raised again by result(), in the step loop
            self._error = error

    def result(self) -> TrainState:
        """The built state (the initializer's own error, if it failed)."""
        self._thread.join()
        if self._error is not None:
            raise self._error.with_traceback(self._error.__traceback__)
        assert self._state is not None
        return self._state

    def settle(self) -> None:
        """Wait for the build under way, keeping nothing: the fit failed before it needed the state."""
        self._thread.join()
        self._state = self._error = None


@contextmanager
def ending(feed: Feed, state: TrainState | Pending | None) -> Iterator[None]:
    """Around a fit's loop: on the way out the feed closes, and a state still being built (the
    loop failed before it needed it) is waited for, so no compilation outlives the fit."""
    try:
        yield
    finally:
        feed.close()
        if isinstance(state, Pending):
            state.settle()


@contextmanager
def closing_on_sigterm(close: Callable[[], None]) -> Iterator[None]:
    """While inside, a SIGTERM calls close, then ends the process by the signal as before.

    Only where SIGTERM would end the process anyway (the default handler, in
    the main thread of a lone process): a handler someone installed, or a
    pool's preemption service, is left to do what it does.
    """
    installed = (threading.current_thread() is threading.main_thread() and jax.process_count() == 1
                 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    if not installed:
        yield
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            close()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start_placed(place: Callable[[], tuple[TrainState | Pending, Placement, bytes | None]], feed: Feed,
                 checkpoints: Checkpoints | None, steps: int, *,
                 overlap: bool = True) -> tuple[TrainState | Pending, int]:
    """The placed state and its step, with feed open for it.

    With overlap, the stream starts before place() runs, so its start-up
    overlaps the placement, and place may hand back a fresh state as a
    ``Pending``. A failure, a SIGTERM, or a fit already at its
    target step closes the feed here (and, at its target, the checkpoints' writer).
    """
    state: TrainState | Pending | None = None
    try:
        with closing_on_sigterm(feed.close):  # a SIGTERM while placing ends the stream's workers too
            if overlap:
                _begin(feed, checkpoints, steps)
            state, _, position = place()
            start = 0 if isinstance(state, Pending) else int(jax.device_get(state.step))  # a fresh one
            if start < steps:
                feed.open(position, resuming=start > 0, start=start)
                return state, start
    except BaseException:
        with ending(feed, state):
            raise
    feed.close()
    if checkpoints is not None:  # nothing to train: the writer is let go of, as a fit's end does
        checkpoints.close()
    return (state.result() if isinstance(state, Pending) else state), start


def _begin(feed: Feed, checkpoints: Checkpoints | None, steps: int) -> None:
    """Start the stream where this fit will continue it, before the state is placed.

    The step and position come from the newest checkpoint's manifest (no
    array is read). A fit already at its target reads no data; when the
    manifest cannot say or the stream cannot start, nothing starts here and
    place() and open() raise what they raise; open() opens afresh when the
    restored position is another (a damaged step fell back to an older one).
    """
    latest = None if checkpoints is None else checkpoints.latest
    position = None
    try:
        if checkpoints is not None and latest is not None:
            if latest >= steps:
                return
            # read here, as Checkpoints is: only a run that keeps checkpoints imports them
            from dew.checkpoints.manifest import Positions
            from dew.checkpoints.store import read_position

            saved = Positions.model_validate(checkpoints.manifest(latest)["data"])
            position = read_position(latest, saved, feed.partition)
        feed.begin(position, resuming=latest is not None)
    except Exception:  # noqa: BLE001 - raised again where a fit that did not start early raises it
        feed.close()
