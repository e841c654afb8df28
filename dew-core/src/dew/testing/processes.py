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
import tempfile
import textwrap
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dew.training.runtime.pool import free_port

__all__ = ["Finished", "device_env", "free_port", "run_pool", "run_python", "run_until_lines",
           "shared_compilation_cache"]


def shared_compilation_cache(fallback: str | Path) -> Path:
    """The compilation cache this process already names (JAX_COMPILATION_CACHE_DIR), else fallback.

    A test suite that keeps one persistent cache for itself and its children
    sets that variable; children given this folder load what any earlier test,
    or the last run of the suite, compiled. Without it, fallback (a folder the
    caller owns) still lets the children of one test share their programs.
    """
    return Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or fallback)


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


def run_pool(code: str, *, processes: int = 2, devices: int = 1, args: Sequence[str] = (),
             timeout: float = 600, env: Mapping[str, str] | None = None) -> list[Finished]:
    """Run code (dedented) in a real pool of processes joined over 127.0.0.1, each with `devices` fake devices.

    Every process gets the pool's coordinator, size and its own index in
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, the
    variables ``dew launch`` sets, so code joins the pool the way a launched
    rank does (``dew.training.prepare_process`` with ``multi_host=True``).
    args become sys.argv[1:]. Returns each process's Finished, in index
    order; a process still running at the timeout is killed (with the rest).
    """
    port = free_port()
    command = [sys.executable, "-c", textwrap.dedent(code), *args]
    # Output goes to files, not pipes: a child that fills a pipe nobody reads yet would stall the pool.
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(processes)]
    children = [
        subprocess.Popen(command, stdout=out, stderr=err, text=True,
                         env=device_env(devices, {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                                                  "JAX_NUM_PROCESSES": str(processes),
                                                  "JAX_PROCESS_ID": str(index), **(env or {})}))
        for index, (out, err) in enumerate(outputs)
    ]
    deadline = time.monotonic() + timeout
    try:
        for child in children:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    finished = []
    for child, (out, err) in zip(children, outputs, strict=True):
        texts = []
        for stream in (out, err):
            stream.seek(0)
            texts.append(stream.read())
            stream.close()
        finished.append(Finished(child.returncode, *texts))
    return finished
