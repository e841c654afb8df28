"""A Ctrl-C that reaches a pool's rank before its training loop watches for it: held, then passed
to the whole pool.

``dew launch`` passes a Ctrl-C on to every rank at once, whatever each is doing. A rank still
starting (importing, reading its recipe, joining the pool, compiling) raised KeyboardInterrupt
wherever it stood: inside an import it printed a traceback and failed the pool; inside a callback
of JAX's garbage collection Python discarded it, and the rank trained on. A rank the launcher
started (``RANK`` in its environment) instead holds the request from its first line (``hold``).
Once the pool has formed (``serve``), the request goes to JAX's preemption service, as a Ctrl-C
during training does: every rank stops at one step, saved, with status 130. A second Ctrl-C ends
the rank at once.

This module imports nothing heavy: it is installed before JAX is.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

__all__ = ["RANK", "hold", "let_go", "pending", "serve"]

RANK = "DEW_POOL_RANK"  # "1" in the environment of each rank dew launch starts


class _Held:
    pending = False  # a Ctrl-C came and is not yet answered
    serving = False  # the pool formed: its preemption service takes the request


def hold() -> None:
    """In a launched rank's main thread: from now on a Ctrl-C is held, not raised. The launcher
    starts a rank with SIGINT blocked, so one that came while its interpreter started is pending,
    and arrives here."""
    if os.environ.get(RANK) == "1" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_interrupt)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def serve() -> None:
    """The pool has formed: a held Ctrl-C is passed to it now, and a later one as it comes."""
    _Held.serving = True
    if _Held.pending:
        _forward()


def pending() -> bool:
    """Whether a held Ctrl-C asked this rank to stop."""
    return _Held.pending


def let_go() -> None:
    """The training loop is over: a Ctrl-C interrupts as Python's does again (it stops a pool's
    rank only while the loop runs, where every rank can stop at one step)."""
    if signal.getsignal(signal.SIGINT) is _on_interrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _Held.pending = False


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    if _Held.pending:  # a second Ctrl-C: the rank ends now
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return
    _Held.pending = True
    if _Held.serving:
        _forward()


def _forward() -> None:
    """Ask the pool's preemption service to stop every rank (it takes SIGTERM), as Ctrl-C (130)."""
    from dew.training.runtime.preemption import INTERRUPTED_STATUS, PreemptionNotice

    PreemptionNotice.status = INTERRUPTED_STATUS
    os.kill(os.getpid(), signal.SIGTERM)
