"""A Ctrl-C that comes before a training loop watches for it: remembered, so it is never lost.

Python raises a Ctrl-C as KeyboardInterrupt wherever the main thread stands. Inside a callback of
JAX's garbage collection, Python prints it as "Exception ignored" and discards it: a ``dew train``
Ctrl-C'd in its first seconds then trained on to its end. A dew command notes every Ctrl-C from
its first line (``hold``), so a training loop that starts after one that was discarded stops at
its first step, saved, with status 130.

In a pool it goes further. ``dew launch`` passes a Ctrl-C (or a SIGTERM) on to every rank at once,
whatever each is doing, and a rank that raised it wherever it stood (an import: a traceback, status
1; a SIGTERM: status 143 with nothing written) failed the pool. A rank the launcher started
(``RANK`` in its environment) holds the request instead of raising it. Once the pool has formed
(``serve``), the request goes to JAX's preemption service, as a Ctrl-C during training does: every
rank stops at one step, saved. A second signal ends the rank at once.

A Ctrl-C that lands inside an import waits for it to finish (it is sent again every 50 ms, for at
most 10 s): raised there, it reaches the initialization of a native module that calls back into
Python, where numpy's C code prints it as a traceback and jaxlib's crashes (SIGSEGV).

This module imports nothing heavy: it is installed before JAX is.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

__all__ = ["RANK", "hold", "let_go", "pending", "serve"]

RANK = "DEW_POOL_RANK"  # "1" in the environment of each rank dew launch starts


RETRY_SECONDS = 0.05  # how often a Ctrl-C that landed in an import is sent again
MAX_DEFERRALS = 200  # then it is raised wherever it lands (an import that never ends still stops)


class _Held:
    pending = False  # a Ctrl-C came and no training loop has answered it yet
    serving = False  # a pool's rank: the pool formed, and its preemption service takes the request
    deferred = 0  # times a Ctrl-C waited for an import to finish
    status = 130  # the exit status the held request asks for: 130 after Ctrl-C, 143 after SIGTERM


def hold() -> None:
    """From a dew command's first line, in its main thread: note every Ctrl-C (see the module).

    The launcher starts a rank with SIGINT blocked, so one that came while its interpreter started
    is pending, and arrives here.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if os.environ.get(RANK) == "1":  # a SIGTERM the launcher passes on while the rank starts is held too
        signal.signal(signal.SIGINT, _on_rank_interrupt)
        signal.signal(signal.SIGTERM, _on_rank_interrupt)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    else:
        signal.signal(signal.SIGINT, _on_interrupt)


def serve() -> None:
    """A pool has formed: a held Ctrl-C is passed to it now, and a later one as it comes."""
    _Held.serving = True
    if _Held.pending:
        _forward()


def pending() -> bool:
    """Whether a Ctrl-C came that no training loop has answered yet."""
    return _Held.pending


def let_go() -> None:
    """A training loop answered (or the command ended): a Ctrl-C interrupts as Python's does again."""
    if signal.getsignal(signal.SIGINT) in (_on_interrupt, _on_rank_interrupt):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _Held.pending = False
    _Held.deferred = 0


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    _Held.pending = True  # kept, should Python discard what is raised here
    if _importing(frame) and _Held.deferred < MAX_DEFERRALS:
        _Held.deferred += 1
        again = threading.Timer(RETRY_SECONDS, _again)
        again.daemon = True
        again.start()
        return
    raise KeyboardInterrupt


def _importing(frame: FrameType | None) -> bool:
    """Whether the main thread stands inside an import (importlib's loading frame is on its stack)."""
    while frame is not None:
        if frame.f_code.co_name == "_find_and_load" and frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _again() -> None:
    """Send the deferred Ctrl-C again, unless the command already ended or a loop answered it."""
    if _Held.pending and signal.getsignal(signal.SIGINT) is _on_interrupt:
        os.kill(os.getpid(), signal.SIGINT)


def _on_rank_interrupt(signum: int, frame: FrameType | None) -> None:
    if _Held.pending:  # a second signal: the rank ends now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _Held.pending = True
    _Held.status = 130 if signum == signal.SIGINT else 143
    if _Held.serving:
        _forward()


def _forward() -> None:
    """Ask the pool's preemption service to stop every rank (it takes SIGTERM), with the status the
    held signal asks for (130 after Ctrl-C, 143 after SIGTERM)."""
    from dew.training.runtime.preemption import PreemptionNotice

    PreemptionNotice.status = _Held.status
    os.kill(os.getpid(), signal.SIGTERM)
