"""Run code in fresh interpreters: fake many devices, and stop a run by signal at a printed line.

Tests of meshes, preemption and process pools need a new Python process (a
JAX backend's device count is fixed once it starts). These helpers start one
the same way every time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Finished", "device_env", "run_python", "run_until_lines"]


def device_env(devices: int = 1, env: Mapping[str, str] | None = None, *,
               compilation_cache: str | Path | None = None) -> dict[str, str]:
    """This process's environment for a CPU-only JAX with `devices` fake devices, plus env.

    compilation_cache names a directory where the children of one test keep
    every program they compile (JAX's persistent cache, however small or
    quick the program): a run that restarts, resumes or builds a second
    Trainer then loads the executable the first one compiled. The cache is
    keyed by the program itself, so a different program still compiles.
    """
    environment = dict(os.environ)
    environment["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    environment["JAX_PLATFORMS"] = "cpu"
    if compilation_cache is not None:
        environment["JAX_COMPILATION_CACHE_DIR"] = str(compilation_cache)
        environment["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        environment["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    environment.update(env or {})
    return environment


def run_python(code: str, *, devices: int = 1, timeout: float = 300, env: Mapping[str, str] | None = None,
               cwd: str | Path | None = None,
               compilation_cache: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run code (dedented) in a fresh interpreter with `devices` fake CPU devices (see device_env)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=timeout, env=device_env(devices, env, compilation_cache=compilation_cache), cwd=cwd,
    )


@dataclass(frozen=True)
class Finished:
    """How a child process ended: its exit code and everything it printed."""

    returncode: int
    stdout: str
    stderr: str


def run_until_lines(command: Sequence[str], *, signal_at: Iterable[str] = (), sig: int = signal.SIGTERM,
                    devices: int = 1, timeout: float = 300, env: Mapping[str, str] | None = None,
                    compilation_cache: str | Path | None = None) -> Finished:
    """Run command, sending sig once for each line of signal_at the moment the child prints it.

    This is how a test preempts a training at an exact point: the child
    prints a marker ("saving 4", "batch 7") and the signal arrives while it
    is there, as a scheduler's would.
    """
    pending = list(signal_at)
    child = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=device_env(devices, env, compilation_cache=compilation_cache))
    assert child.stdout is not None and child.stderr is not None
    lines = []
    for line in child.stdout:
        lines.append(line)
        if line.strip() in pending:
            pending.remove(line.strip())
            child.send_signal(sig)
    child.wait(timeout=timeout)
    return Finished(child.returncode, "".join(lines), child.stderr.read())
