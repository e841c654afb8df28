"""Running the ranks of a pool as child processes, and stopping them the way a scheduler expects.

The launcher is the one process a scheduler (or a shell) signals. It starts
each rank in a process group of its own, so a Ctrl-C at the terminal reaches
the launcher alone and the ranks hear of it only through the launcher, in
order. A first SIGTERM or SIGINT is passed on to every rank, whose
preemption watch saves a checkpoint and exits; the launcher waits up to the
grace for that, then kills what is left. A second signal kills every rank at
once. The exit status says how the pool ended: 0 when it finished, 143 (or
130 after Ctrl-C) when it stopped on request with its checkpoint written,
137 when it had to be killed, and a failed rank's own status otherwise.

A rank that stops only because another one ended (its collective lost the
peer) exits with ``PEER_LOST_STATUS``; the two exits race, so the launcher
waits a moment for the rank whose own failure came first and reports that
one's status.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

__all__ = ["DEFAULT_GRACE", "KILLED_STATUS", "PEER_LOST_STATUS", "Rank", "supervise"]

DEFAULT_GRACE = 300.0  # seconds a stopped pool has to checkpoint and exit
KILLED_STATUS = 137  # 128 + SIGKILL: the pool had to be killed
PEER_LOST_STATUS = 75  # sysexits' EX_TEMPFAIL: a rank that lost another one, not the pool's cause
_BLAME_WAIT = 5.0  # seconds a lost peer's exit waits for the exit of the rank that caused it
_STOP_STATUSES = {143, 130}  # a rank that saved its step and exited on request
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Rank:
    """One process of a pool: its index, its command line and the variables added to its environment."""

    index: int
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def _die_with_launcher() -> None:
    """In the child, before exec: be killed if the launcher dies, so no rank outlives it; and hold
    SIGINT and SIGTERM blocked (pending, not lost) until the rank's first line takes them over
    (dew.interrupts.hold), so a stop passed on while its interpreter starts is not raised in the
    middle of an import, nor ends the rank before it has written anything."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the ranks' own heartbeat ends them later
        pass


def _status(code: int) -> int:
    """A child's return code as a shell reports it (a signal N as 128 + N)."""
    return 128 - code if code < 0 else code


class _Pool:
    def __init__(self, ranks: Sequence[Rank], grace: float, out: IO[str]) -> None:
        self.ranks = list(ranks)
        self.grace = float(grace)
        self.out = out
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self.ended: list[int] = []  # ranks in the order they exited (a failure's peers fail after it)
        self.signals: list[int] = []
        self.deadline: float | None = None
        self.stop_signal: int | None = None
        self.blame_by: float | None = None  # when to stop waiting for the cause of a lost peer

    def say(self, text: str) -> None:
        print(f"dew launch: {text}", file=self.out, flush=True)

    def start(self) -> None:
        for rank in self.ranks:
            child = self.children[rank.index] = subprocess.Popen(
                list(rank.argv), env={**os.environ, **rank.env}, start_new_session=True,
                preexec_fn=_die_with_launcher)
            threading.Thread(target=self._watch, args=(rank.index, child), daemon=True,
                             name=f"dew-launch-rank-{rank.index}").start()

    def _watch(self, index: int, child: subprocess.Popen[bytes]) -> None:
        child.wait()
        self.ended.append(index)

    def on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def alive(self) -> dict[int, subprocess.Popen[bytes]]:
        return {i: c for i, c in self.children.items() if c.poll() is None}

    def kill(self, why: str) -> None:
        living = self.alive()
        if living:
            self.say(f"{why}: killing rank{'s' if len(living) > 1 else ''} "
                     f"{', '.join(f'{i} (pid {c.pid})' for i, c in living.items())}")
        for child in living.values():
            try:
                os.killpg(child.pid, signal.SIGKILL)  # its data workers too
            except ProcessLookupError:
                pass
        for child in self.children.values():
            child.wait()

    def handle_signals(self) -> int | None:
        """Act on the signals received since the last look; a status if the pool is over."""
        while self.signals:
            signum = self.signals.pop(0)
            if self.stop_signal is not None:
                # Killed before the stop's checkpoint: not 143/130, which say it was written.
                self.kill(f"a second {signal.Signals(signum).name}")
                return KILLED_STATUS
            self.stop_signal = signum
            self.deadline = time.monotonic() + self.grace
            self.say(f"{signal.Signals(signum).name}: asking the ranks to checkpoint and exit within "
                     f"{self.grace:g} s (a second signal kills them now)")
            for child in self.alive().values():
                try:
                    os.kill(child.pid, signum)
                except ProcessLookupError:
                    pass
        return None

    def outcome(self) -> int | None:
        """The pool's status once it is decided by its ranks' exits, else None."""
        ended = {i: _status(self.children[i].returncode) for i in list(self.ended)}
        failed = {i: s for i, s in ended.items() if s != 0 and s not in _STOP_STATUSES}
        if failed:
            own = {i: s for i, s in failed.items() if s != PEER_LOST_STATUS}
            if not own and len(ended) < len(self.children):  # the rank that caused it may be exiting now
                self.blame_by = self.blame_by or time.monotonic() + _BLAME_WAIT
                if time.monotonic() < self.blame_by:
                    return None
            index, status = next(iter((own or failed).items()))  # the first to fail: the others lost it
            self.say(f"rank {index} failed with status {status}"
                     + ("" if own else " (it lost another process of the pool)"))
            self.kill("the pool cannot go on without it")
            return status
        stopped = [s for s in ended.values() if s in _STOP_STATUSES]
        if stopped and self.deadline is None:  # the scheduler signalled a rank directly
            self.deadline = time.monotonic() + self.grace
        if len(ended) < len(self.children):
            return None
        return max(stopped) if stopped else 0

    def run(self, poll: float) -> int:
        while True:
            status = self.handle_signals()
            if status is not None:
                return status
            status = self.outcome()
            if status is not None:
                return status
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.kill(f"the pool did not stop within the grace of {self.grace:g} s")
                return KILLED_STATUS
            time.sleep(poll)


def supervise(ranks: Sequence[Rank], grace: float = DEFAULT_GRACE, out: IO[str] | None = None,
              poll: float = 0.1) -> int:
    """Run ranks to their end and return the pool's exit status (see the module's docstring).

    Must be called from the main thread: it takes over SIGTERM and SIGINT
    while the ranks run, and gives the previous handlers back after.
    """
    pool = _Pool(ranks, grace, out if out is not None else sys.stderr)
    previous = {s: signal.signal(s, pool.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        pool.start()
        return pool.run(poll)
    finally:
        pool.kill("the launcher is ending") if pool.alive() else None
        for signum, handler in previous.items():
            signal.signal(signum, handler)
