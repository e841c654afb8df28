"""Stopping a run cleanly when the scheduler asks: SIGTERM, Ctrl-C, a programmatic notice.

A lone process learns of preemption from its own SIGTERM handler (or a
PreemptionNotice). In a pool, jax.distributed's preemption service catches
SIGTERM on any process and agrees with the others on a step to stop at, which
every process must poll at every step. Ctrl-C (SIGINT) stops a run the same
way, saving its step, and the program then exits with 130 instead of 143; a
second signal of either kind ends the process at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType

import jax

__all__ = [
    "INTERRUPTED_STATUS",
    "PREEMPTED_STATUS",
    "Preempted",
    "PreemptionNotice",
    "PreemptionWatch",
    "UnsavedStopError",
]

PREEMPTED_STATUS = 143  # 128 + SIGTERM, what a scheduler expects of a stopped job
INTERRUPTED_STATUS = 130  # 128 + SIGINT, what a shell expects after Ctrl-C


class _StoppedAt(SystemExit):
    """A fit stopped on request at step: exits with status and one line on stderr, uncaught."""

    def __init__(self, step: int, status: int = PREEMPTED_STATUS) -> None:
        super().__init__(int(step), int(status))  # args: pickles back the same
        self.step = int(step)
        self.status = int(status)
        self._announced = False

    @property
    def code(self) -> int:  # type: ignore[override]  # the interpreter reads it at exit: say why
        if not self._announced:
            self._announced = True
            if jax.process_index() == 0:  # a pool's processes all stop at this step: said once
                print(f"dew: {self}", file=sys.stderr, flush=True)
        return self.status

    @property
    def _what(self) -> str:
        return "interrupted (Ctrl-C)" if self.status == INTERRUPTED_STATUS else "preempted"


class Preempted(_StoppedAt):
    """fit stopped at a preemption notice, at step, after writing that step's checkpoint.

    Uncaught, it ends the program with exit status 143 (130 after Ctrl-C)
    and one line on stderr (printed when the interpreter reads the exit
    code). A fit without Checkpoints raises UnsavedStopError instead, so
    this class always means the step is on disk.
    """

    def __str__(self) -> str:
        return (f"{self._what} at step {self.step}; its checkpoint and data position are written. "
                "Run the same command again to resume.")


class UnsavedStopError(_StoppedAt):
    """fit stopped at a preemption notice, at step, with no Checkpoints to write it to.

    It exits as Preempted does (status 143, 130 after Ctrl-C, one line on
    stderr) but is not one: nothing was saved, and running again starts
    over.
    """

    def __str__(self) -> str:
        return (f"{self._what} at step {self.step}; nothing was saved, because the trainer has no "
                "Checkpoints, so running again starts over. Set a recipe's trainer.checkpoint_dir (or give "
                "the Trainer checkpoints=Checkpoints(directory)) to make a stop resumable.")


class PreemptionNotice:
    """A preemption notice given in code, for programs that learn of preemption some other way.

    send() is equivalent to the scheduler's SIGTERM: alone it marks the
    notice for the running PreemptionWatch; in a pool it signals this process
    so JAX's preemption service propagates it to every process.
    """

    _event = threading.Event()
    status = PREEMPTED_STATUS  # the exit status the notice asks for

    @classmethod
    def send(cls, status: int = PREEMPTED_STATUS) -> None:
        cls.status = int(status)
        if jax.process_count() > 1:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            cls._event.set()

    @classmethod
    def received(cls) -> bool:
        return cls._event.is_set()

    @classmethod
    def clear(cls) -> None:
        cls._event.clear()
        cls.status = PREEMPTED_STATUS


class PreemptionWatch:
    """Watch for preemption while a training loop runs (a context manager).

    Entered in the main thread of a lone process, it handles SIGTERM (the
    previous handler comes back on exit); a second SIGTERM while the first is
    pending ends the process at once with status 143. reached(step) must be
    called at every step.
    """

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self._say = say  # prints a line where the run's progress goes; else stderr
        self._previous: Callable[[int, FrameType | None], object] | int | None = None  # the SIGTERM handler installed before this watch
        self._installed = False
        self._pooled = False

    def __enter__(self) -> PreemptionWatch:
        from dew import interrupts

        self._pooled = jax.process_count() > 1
        self._signalled = interrupts.pending()  # a Ctrl-C before the loop: a second one stops at once
        if self._signalled and not self._pooled:  # Python discarded it (dew.interrupts): stop at the first step
            PreemptionNotice.status = INTERRUPTED_STATUS
            PreemptionNotice._event.set()
        if threading.current_thread() is threading.main_thread():
            self._previous_interrupt = signal.signal(signal.SIGINT, self._on_signal)
            if not self._pooled:
                self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous_interrupt)
            if not self._pooled:
                signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
        from dew import interrupts

        interrupts.let_go()
        PreemptionNotice.clear()
        self._signalled = False

    _signalled = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        if self._signalled or PreemptionNotice.received():  # a second signal: stop now
            _to_stderr(f"dew: a second {what}: stopping now, without finishing the step under way")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signalled = True
        status = INTERRUPTED_STATUS if signum == signal.SIGINT else PREEMPTED_STATUS
        if self._pooled:  # the pool's preemption service propagates a SIGTERM to every process
            PreemptionNotice.status = status
            os.kill(os.getpid(), signal.SIGTERM)
            return
        PreemptionNotice.status = status
        PreemptionNotice._event.set()
        # said at once, where the stop line will go: a step, a rollout or a validation can take long
        # before it comes. From a thread of its own: the handler may interrupt that printer mid-line.
        line = f"{what}: the run stops when the step under way ends (a second {what} stops at once)"
        if self._say is None:
            _to_stderr(f"dew: {line}")
        else:
            threading.Thread(target=self._say, args=(line,), name="dew-stop-notice", daemon=True).start()

    @property
    def status(self) -> int:
        """The exit status the stop asks for: 130 after Ctrl-C, else 143."""
        return PreemptionNotice.status

    def stopping(self, step: int, saving: bool) -> str:
        """The line a run prints as it starts to stop at step: what asked, and that a second
        signal stops at once (losing the checkpoint being written, when one is)."""
        what = "Ctrl-C" if self.status == INTERRUPTED_STATUS else "SIGTERM"
        if not saving:
            return f"step {step}: {what}: stopping here (a second {what} stops at once)"
        return (f"step {step}: {what}: stopping here once this step's checkpoint is written (a "
                f"second {what} stops at once, without it)")

    def reached(self, step: int) -> bool:
        """Whether the run should stop after step (every process of a pool agrees)."""
        if self._pooled:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(int(step)))
        return PreemptionNotice.received()


def _to_stderr(line: str) -> None:
    """One line on stderr from a signal handler: written whole to the file descriptor, since the
    handler may run while the main thread is inside a write to sys.stderr."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError):  # no stderr to write to (closed, or replaced by a stream without one)
        pass
