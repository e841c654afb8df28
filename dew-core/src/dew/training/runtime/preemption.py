"""Stopping a run cleanly when the scheduler asks: SIGTERM, a programmatic notice, Preempted.

A lone process learns of preemption from its own SIGTERM handler (or a
PreemptionNotice). In a pool, jax.distributed's preemption service catches
SIGTERM on any process and agrees with the others on a step to stop at, which
every process must poll at every step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

import jax

__all__ = ["PREEMPTED_STATUS", "Preempted", "PreemptionNotice", "PreemptionWatch"]

PREEMPTED_STATUS = 143  # 128 + SIGTERM, what a scheduler expects of a stopped job


class Preempted(SystemExit):
    """fit stopped at a preemption notice, at step, after writing that step's checkpoint.

    Uncaught, it ends the program with exit status 143 and one line on
    stderr (printed when the interpreter reads the exit code).
    """

    def __init__(self, step: int, saved: bool = True) -> None:
        super().__init__(int(step), bool(saved))  # args: pickles back to the same exception
        self.step = int(step)
        self.saved = bool(saved)
        self._announced = False

    @property
    def code(self) -> int:  # read by the interpreter when this exception ends the program
        if not self._announced:
            self._announced = True
            print(f"dew: {self}", file=sys.stderr, flush=True)
        return PREEMPTED_STATUS

    def __str__(self) -> str:
        if not self.saved:
            return (f"preempted at step {self.step}; the trainer has no Checkpoints, so nothing "
                    "was written and running again starts over.")
        return (f"preempted at step {self.step}; its checkpoint and data position are written. "
                "Run the same command again to resume.")


class PreemptionNotice:
    """A preemption notice given in code, for programs that learn of preemption some other way.

    send() is equivalent to the scheduler's SIGTERM: alone it marks the
    notice for the running PreemptionWatch; in a pool it signals this process
    so JAX's preemption service propagates it to every process.
    """

    _event = threading.Event()

    @classmethod
    def send(cls) -> None:
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


class PreemptionWatch:
    """Watch for preemption while a training loop runs (a context manager).

    Entered in the main thread of a lone process, it handles SIGTERM (the
    previous handler comes back on exit); a second SIGTERM while the first is
    pending ends the process at once with status 143. reached(step) must be
    called at every step.
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._installed = False
        self._pooled = False

    def __enter__(self) -> PreemptionWatch:
        self._pooled = jax.process_count() > 1
        if not self._pooled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
        PreemptionNotice.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if PreemptionNotice.received():  # a second signal: stop now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        PreemptionNotice._event.set()

    def reached(self, step: int) -> bool:
        """Whether the run should stop after step (every process of a pool agrees)."""
        if self._pooled:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(int(step)))
        return PreemptionNotice.received()
