"""Profiler traces: ``dew.profile`` around any code, and the one-trace-at-a-time rule.

JAX's profiler runs one trace per process. dew.profile and a fit's
ProfileWindow both go through start()/stop() here, so each knows whether
the other is tracing and refuses clearly instead of failing deep in JAX.

>>> import dew, tempfile
>>> with dew.profile(tempfile.mkdtemp()):      # doctest: +SKIP
...     run_some_steps()
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from dew.errors import DewError

__all__ = ["ProfilerBusyError", "active", "profile", "start", "stop", "tracing"]


class ProfilerBusyError(DewError, RuntimeError):
    """A profiler trace was asked for while another one is being written."""


_LOCK = threading.Lock()
_current: tuple[str, str] | None = None  # (owner, directory) of the trace being written


def active() -> bool:
    """True while a trace started through dew (dew.profile or a fit's window) is open."""
    return _current is not None


def tracing() -> tuple[str, str] | None:
    """(owner, directory) of the open trace, or None."""
    return _current


def start(directory: str | Path, owner: str) -> Path:
    """Start a JAX profiler trace into directory on behalf of owner; return the directory."""
    global _current
    import jax

    path = Path(directory).absolute()
    with _LOCK:
        if _current is not None:
            raise ProfilerBusyError(
                f"{owner} asked for a profiler trace into {str(path)!r}, but {_current[0]} is "
                f"already tracing into {_current[1]!r}; JAX writes one trace at a time. "
                "Drop one of the two: either the enclosing dew.profile block or the fit's "
                "ProfileWindow."
            )
        path.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(path))
        _current = (owner, str(path))
    return path


def stop() -> None:
    """Stop the open trace and write it out; a no-op when none is open."""
    global _current
    import jax

    with _LOCK:
        if _current is None:
            return
        try:
            jax.profiler.stop_trace()
        finally:
            _current = None


@contextlib.contextmanager
def profile(directory: str | Path) -> Iterator[Path]:
    """Trace everything run inside the block into directory (open it with TensorBoard or Perfetto).

    A fit inside the block refuses to schedule its own ProfileWindow, since
    JAX writes one trace at a time.
    """
    path = start(directory, "dew.profile")
    try:
        yield path
    finally:
        stop()
