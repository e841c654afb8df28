"""Setting up the process before JAX starts, and a timestamp every process agrees on.

``prepare_process`` is the first thing a training program calls: some of what
it sets (XLA's flags, membership in a process pool) is read once, when JAX
opens its backend, and is silently ignored afterwards. So it refuses to run
late when that would lose a setting, rather than let a run start without it.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import pydantic
from pydantic import Field

from dew.errors import DewError
from dew.settings import Settings

__all__ = [
    "BackendAlreadyStartedError",
    "CompilationCacheError",
    "ProcessPoolError",
    "ProcessSettings",
    "UnknownXlaFlagError",
    "check_xla_flags",
    "prepare_process",
    "run_timestamp",
    "unknown_xla_flags",
    "use_compilation_cache",
]

TIMESTAMP_FORMAT = "%Y-%m-%d_%H:%M:%S"


class BackendAlreadyStartedError(DewError, RuntimeError):
    """prepare_process ran after JAX opened its backend, so a setting would be lost."""


class ProcessPoolError(DewError, RuntimeError):
    """multi_host was asked for, but nothing describes the pool to join."""


class CompilationCacheError(DewError, OSError):
    """compilation_cache_dir names a file, or a path where no directory can be made."""


class UnknownXlaFlagError(DewError, ValueError):
    """XLA_FLAGS (with a recipe's trainer.xla_flags) holds a flag this XLA does not know."""


def check_xla_flags(flags: Sequence[str]) -> None:
    """Refuse flags XLA does not know before this process relies on them.

    XLA answers an unknown flag by aborting the process at its first device
    call, with no Python error and nothing cleaned up, so the environment's
    XLA_FLAGS with flags appended are first tried in a child interpreter on
    the CPU (a second or so, only when flags are given).
    """
    if not flags:
        return
    merged = _merged_flags(os.environ.get("XLA_FLAGS", ""), flags)
    env = dict(os.environ, XLA_FLAGS=merged, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    unknown = unknown_xla_flags(done.stderr)
    if unknown is not None:
        raise unknown


def unknown_xla_flags(stderr: str) -> UnknownXlaFlagError | None:
    """The error naming the flags XLA refused, read from the stderr of a process it aborted for
    them (its fatal log line), or None when it refused none."""
    unknown = re.search(r"Unknown flags? in XLA_FLAGS: (.+)", stderr)
    if unknown is None:
        return None
    return UnknownXlaFlagError(
        f"XLA does not know the flag(s) {unknown[1].strip()} (XLA_FLAGS with the recipe's trainer.xla_flags), "
        "and would abort the run as it starts; correct their spelling or leave them out of trainer.xla_flags "
        "(or of XLA_FLAGS, where you set it). TPU flags (--xla_tpu_...) go in LIBTPU_INIT_ARGS.")


class ProcessSettings(Settings):
    """What prepare_process reads; a recipe's ``trainer`` section holds these fields."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    xla_flags: list[str] = Field(default_factory=list, description="appended to XLA_FLAGS")
    multi_host: bool = Field(False, description="join the JAX process pool the environment names")
    compilation_cache_dir: str | None = Field(None, description="persistent compilation cache")
    core_dumps: bool = Field(
        False, description="let a crash write a core file (it holds secrets from the environment)"
    )

    @pydantic.field_validator("xla_flags")
    @classmethod
    def _flags(cls, flags: list[str]) -> list[str]:
        """Each item one flag: XLA reads a word of XLA_FLAGS without -- as a file of flags, and aborts
        the process where there is none, naming no field."""
        for flag in flags:
            if not flag.startswith("--") or len(shlex.split(flag)) != 1:
                raise ValueError(f"{flag!r} is not one XLA flag: each item is one flag, as "
                                 "'--xla_dump_to=/tmp/dump' (XLA reads a word without -- as a file of flags)")
        return flags


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def _pool_joined() -> bool:
    from jax._src import distributed

    return distributed.global_state.client is not None


def _raise_soft_limit(which: int) -> None:
    soft, hard = resource.getrlimit(which)
    if soft == hard:
        return
    try:
        resource.setrlimit(which, (hard, hard))
    except (ValueError, OSError):
        # An unlimited hard limit on open files exceeds the kernel's own
        # ceiling (fs.nr_open); take that ceiling instead.
        try:
            with open("/proc/sys/fs/nr_open") as ceiling:
                cap = int(ceiling.read())
        except (OSError, ValueError):
            return
        if hard == resource.RLIM_INFINITY or hard > cap:
            try:
                resource.setrlimit(which, (cap, hard))
            except (ValueError, OSError):
                pass


def _set_core_limit(allowed: bool) -> None:
    """Core files only when asked for: soft limit to the hard limit if allowed, else to 0.

    A core file is the process's memory, environment included, so it holds
    WANDB_API_KEY, cloud credentials and any token the run read.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    wanted = hard if allowed else 0
    if soft != wanted:
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (wanted, hard))
        except (ValueError, OSError):
            pass


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def _merged_flags(current: str, extra: Sequence[str]) -> str:
    """current's flags with extra appended, an extra flag replacing one of the same name."""
    names = {_flag_name(f) for f in extra}
    kept = [f for f in shlex.split(current) if _flag_name(f) not in names]
    return " ".join([*kept, *extra])


def _join_pool() -> None:
    import jax

    from dew.training.runtime.pool import connect_timeout, reach_coordinator, seat_from_environment

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    seat = seat_from_environment()
    if seat is not None:
        from dew.training.runtime.gpus import gpu_environment

        # This process's share of the machine's GPUs, as `dew launch` gives each rank: started by
        # srun alone, JAX would take one GPU per task (SLURM_LOCALID's), whatever the task was given.
        os.environ.update(gpu_environment(seat.local_index, seat.local_count))
        timeout = max(1, int(connect_timeout()))
        reach_coordinator(seat.coordinator, seat.index, timeout)
        # JAX's coordinator ends its process (a C++ abort and its stack) when a peer never joins:
        # process 0 says so itself first, and leaves JAX a little longer so that its line comes first.
        watchdog = threading.Timer(timeout, _peers_missing, (seat.coordinator, seat.processes, timeout))
        watchdog.daemon = True
        if seat.index == 0:
            watchdog.start()
        try:
            jax.distributed.initialize(seat.coordinator, num_processes=seat.processes, process_id=seat.index,
                                       initialization_timeout=timeout + (5 if seat.index == 0 else 0))
        finally:
            watchdog.cancel()
        from dew import interrupts

        interrupts.serve()  # a Ctrl-C held since the rank started now stops the pool, at one step
    else:
        # A cluster JAX knows (TPU pods, Open MPI, ...) describes the pool itself.
        try:
            jax.distributed.initialize()
        except ValueError as error:
            raise ProcessPoolError(
                f"multi_host is set, but JAX found no process pool to join ({error}). Start the "
                "processes with `dew launch` (a local pool, or one rank under srun or a Kubernetes "
                "indexed Job), or set JAX_COORDINATOR_ADDRESS (host:port of process 0), "
                "JAX_NUM_PROCESSES and JAX_PROCESS_ID for every process."
            ) from error


def _peers_missing(coordinator: str, processes: int, timeout: int) -> None:
    """End process 0, whose pool's other processes did not all join within timeout, in one line."""
    print(f"dew: the pool's coordinator at {coordinator} waited {timeout} s for the other {processes - 1} "
          "process(es), and not all of them joined: start every rank with the same coordinator address and "
          "process count (dew launch -n N, or one `dew launch` per node under srun or an indexed Job), or "
          "raise --connect-timeout for a slow start.", file=sys.stderr, flush=True)
    os._exit(2)


def prepare_process(config: ProcessSettings | None = None) -> None:
    """Ready this process to train: limits, XLA flags, compilation cache, process pool.

    The soft limit on open files rises to its hard limit (a sharded checkpoint
    opens many files at once). Core files are written only when
    ``config.core_dumps`` asks for them (the soft core limit then rises to the
    hard one); otherwise the soft core limit is set to 0, because a core file
    is a copy of the process's memory, environment included: it holds
    ``WANDB_API_KEY``, cloud credentials and any other secret the run could
    read, readable by whoever can read the directory it lands in. ``config.xla_flags`` are
    appended to ``XLA_FLAGS``, each replacing a flag of the same name already
    there. ``config.compilation_cache_dir`` turns on JAX's persistent
    compilation cache. With ``config.multi_host``, the process joins the JAX
    process pool that ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID`` describe, else the one Slurm's ``srun`` or a
    Kubernetes indexed Job describes (see ``dew.training.runtime.pool``),
    else one JAX detects itself. A process other than 0 first waits for the
    coordinator to accept connections (``DEW_CONNECT_TIMEOUT`` seconds,
    300 by default) and raises CoordinatorUnreachableError, naming the address,
    if it never does.

    Call it before anything touches a device. Called after JAX opened its
    backend, it raises BackendAlreadyStartedError when flags or the pool
    would be lost; limits and the cache are set either way.
    """
    settings = config if config is not None else ProcessSettings()
    flags = tuple(settings.xla_flags or ())
    started = _backend_started()
    if started:
        current = os.environ.get("XLA_FLAGS", "")
        if flags and _merged_flags(current, flags) != current:
            raise BackendAlreadyStartedError(
                f"JAX already opened its backend, so the XLA flags {' '.join(flags)} would be "
                "ignored. Call dew.training.prepare_process(config) at the very start of the "
                "program, before anything creates an array or asks for devices."
            )
        if settings.multi_host and not _pool_joined():
            raise BackendAlreadyStartedError(
                "JAX already opened its backend, so this process can no longer join a process "
                "pool. Call dew.training.prepare_process(config) before anything creates an "
                "array or asks for devices."
            )
    _raise_soft_limit(resource.RLIMIT_NOFILE)
    _set_core_limit(settings.core_dumps)
    if flags:
        if not started:  # once started, the flags are those the backend already took
            check_xla_flags(flags)
        os.environ["XLA_FLAGS"] = _merged_flags(os.environ.get("XLA_FLAGS", ""), flags)
    import jax  # noqa: F401 - imported here, after XLA_FLAGS are set, as before

    if settings.compilation_cache_dir:
        directory = os.path.abspath(os.path.expanduser(settings.compilation_cache_dir))
        _make_cache_directory(directory)
        use_compilation_cache(directory)
    if settings.multi_host and not _pool_joined():
        _join_pool()


def _make_cache_directory(directory: str) -> None:
    """Make the compilation cache's directory, refusing in one line a path that is a file or lies
    under one, or one this process may not create (os.makedirs says only "File exists")."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        what = "is a file" if os.path.isfile(directory) else f"cannot be made a directory ({error.strerror or error})"
        raise CompilationCacheError(
            f"trainer.compilation_cache_dir {directory!r} {what}; point it at a directory, or at a path "
            "where one can be made (or leave it out for dew's own cache).") from None


def use_compilation_cache(directory: str) -> None:
    """Turn on JAX's persistent compilation cache in directory, keeping every executable
    (not only those above JAX's default of one second of compilation: a run's first step
    waits for all of them)."""
    import jax

    _drop_empty_entries(directory)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _drop_empty_entries(directory: str) -> None:
    """Remove the empty entries a full disk left in a local cache: JAX writes an entry in place and
    never rewrites one that exists, so each later run would warn that it is unreadable and compile
    that program again, for good."""
    if "://" in directory:
        return
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith("-cache") and entry.is_file() and entry.stat().st_size == 0:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def run_timestamp() -> str:
    """Process 0's wall clock, as ``%Y-%m-%d_%H:%M:%S``, returned on every process.

    Alone, this is the local clock. In a process pool every process gets
    process 0's string, so a directory named after it is the same directory
    everywhere, whatever the hosts' clocks say.
    """
    stamp = time.strftime(TIMESTAMP_FORMAT)
    if not _pool_joined():
        return stamp
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return stamp
    encoded = np.frombuffer(stamp.encode("ascii"), dtype=np.uint8).astype(np.int32)
    shared = multihost_utils.broadcast_one_to_all(encoded)
    return bytes(np.asarray(shared).astype(np.uint8).tolist()).decode("ascii")
