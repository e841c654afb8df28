"""Which process pool this process belongs to, read from the scheduler that started it.

A pool is three facts every process must agree on: where process 0 listens
(the coordinator), how many processes there are, and which one this is.
``dew launch`` writes them as ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` for a local pool; on a cluster
they come from the engine that started the processes: Slurm's ``srun``
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``) or a
Kubernetes indexed Job or JobSet (``JOB_COMPLETION_INDEX``, with the count
and the coordinator set in the manifest ``dew launch --print jobset``
writes). Reading them here, rather than in JAX's own cluster detection,
lets a missing or contradictory variable be named before any process waits
on a coordinator that will never answer.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from dew.errors import DewError

__all__ = [
    "COORDINATOR_PORT",
    "CONNECT_TIMEOUT",
    "DEFAULT_PORT",
    "CoordinatorUnreachableError",
    "PoolEnvironmentError",
    "PoolSeat",
    "connect_timeout",
    "first_host",
    "free_port",
    "reach_coordinator",
    "seat_from_environment",
]

COORDINATOR_PORT = "DEW_COORDINATOR_PORT"  # the port process 0 listens on, on a cluster
CONNECT_TIMEOUT = "DEW_CONNECT_TIMEOUT"  # seconds a process waits for the coordinator
DEFAULT_PORT = 8476
_DEFAULT_TIMEOUT = 300.0  # JAX's own initialization timeout


class PoolEnvironmentError(DewError, RuntimeError):
    """The environment starts a pool but leaves out, or contradicts, what a process needs to join it."""


class CoordinatorUnreachableError(DewError, RuntimeError):
    """A process of a pool could not reach process 0's coordinator address in time."""


@dataclass(frozen=True)
class PoolSeat:
    """One process's place in a pool: the coordinator's host:port, the pool's size, this index.

    local_index and local_count place the process among those on its own
    machine, which share the machine's GPUs (dew.training.runtime.gpus).

    >>> seat = PoolSeat("127.0.0.1:8476", processes=2, index=1, source="local")
    >>> seat.environment()["JAX_PROCESS_ID"]
    '1'
    """

    coordinator: str
    processes: int
    index: int
    source: str
    local_index: int = 0
    local_count: int = 1

    def environment(self) -> dict[str, str]:
        """The variables dew.training.prepare_process reads to join this pool."""
        return {"JAX_COORDINATOR_ADDRESS": self.coordinator, "JAX_NUM_PROCESSES": str(self.processes),
                "JAX_PROCESS_ID": str(self.index)}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at this moment (a local pool's coordinator)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list, compressed ranges included.

    >>> first_host("node[007-015,002],login1")
    'node007'
    >>> first_host("gpu-a1,gpu-a2")
    'gpu-a1'
    """
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise PoolEnvironmentError(f"SLURM_STEP_NODELIST={nodelist!r} names no host.")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges, maxsplit=1)[0]


def _integer(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise PoolEnvironmentError(f"{name}={value!r} is not a whole number.") from None


def _port(env: Mapping[str, str], port: int | None) -> int:
    if port is not None:
        return port
    if env.get(COORDINATOR_PORT):
        return _integer(env, COORDINATOR_PORT)
    if env.get("SLURM_JOB_ID", "").isdigit():
        # As JAX does: a port of the ephemeral range picked by the job, so that two jobs
        # sharing a node do not collide.
        return int(env["SLURM_JOB_ID"]) % 2 ** 12 + (65535 - 2 ** 12 + 1)
    return DEFAULT_PORT


def _checked(seat: PoolSeat, names: str) -> PoolSeat:
    if seat.processes < 1 or not 0 <= seat.index < seat.processes:
        raise PoolEnvironmentError(
            f"{names} place this process at index {seat.index} of a pool of {seat.processes}; "
            "the index must be at least 0 and below the count. Start every process of the pool "
            "from the same job so that the scheduler numbers them.")
    return seat


def seat_from_environment(env: Mapping[str, str] | None = None, port: int | None = None) -> PoolSeat | None:
    """This process's seat in the pool the environment describes, or None outside any pool.

    Explicit ``JAX_*`` variables come first, then Slurm, then a Kubernetes
    indexed Job. ``port`` (else ``DEW_COORDINATOR_PORT``, else one derived
    from ``SLURM_JOB_ID`` as JAX derives it, else 8476) is where process 0
    listens under Slurm.

    >>> seat_from_environment({"SLURM_PROCID": "3", "SLURM_NTASKS": "4",
    ...                        "SLURM_STEP_NODELIST": "gpu[12-15]"})
    PoolSeat(coordinator='gpu12:8476', processes=4, index=3, source='slurm', local_index=0, local_count=1)
    >>> seat_from_environment({}) is None
    True
    """
    env = os.environ if env is None else env
    if env.get("JAX_COORDINATOR_ADDRESS"):
        for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            if not env.get(name):
                raise PoolEnvironmentError(
                    f"JAX_COORDINATOR_ADDRESS is set but {name} is not; set JAX_NUM_PROCESSES and "
                    "JAX_PROCESS_ID for every process too (or unset JAX_COORDINATOR_ADDRESS).")
        seat = PoolSeat(env["JAX_COORDINATOR_ADDRESS"], _integer(env, "JAX_NUM_PROCESSES"),
                        _integer(env, "JAX_PROCESS_ID"), "environment")
        return _checked(seat, "JAX_PROCESS_ID and JAX_NUM_PROCESSES")
    if env.get("SLURM_PROCID") is not None and env.get("SLURM_NTASKS") is not None:
        # a step's own list: the batch shell has SLURM_PROCID=0 and the job's SLURM_NTASKS too, and
        # would wait as rank 0 for ranks srun never started (JAX's Slurm detection reads it alone too)
        nodes = env.get("SLURM_STEP_NODELIST")
        if not nodes:
            raise PoolEnvironmentError(
                "SLURM_PROCID and SLURM_NTASKS are set but SLURM_STEP_NODELIST is not; start the "
                "processes with srun inside the allocation (sbatch runs one shell, srun the tasks).")
        seat = PoolSeat(f"{first_host(nodes)}:{_port(env, port)}", _integer(env, "SLURM_NTASKS"),
                        _integer(env, "SLURM_PROCID"), "slurm",
                        local_index=_integer(env, "SLURM_LOCALID") if env.get("SLURM_LOCALID") else 0,
                        local_count=_tasks_here(env))
        return _checked(seat, "SLURM_PROCID and SLURM_NTASKS")
    if env.get("JOB_COMPLETION_INDEX") is not None:
        missing = [n for n in ("DEW_NUM_PROCESSES", "DEW_COORDINATOR_ADDRESS") if not env.get(n)]
        if missing:
            raise PoolEnvironmentError(
                f"This is a Kubernetes indexed Job (JOB_COMPLETION_INDEX is set) but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not: set DEW_NUM_PROCESSES to the Job's completions and DEW_COORDINATOR_ADDRESS to "
                "host:port of the pod with index 0 (`dew launch --print jobset` writes both).")
        seat = PoolSeat(env["DEW_COORDINATOR_ADDRESS"], _integer(env, "DEW_NUM_PROCESSES"),
                        _integer(env, "JOB_COMPLETION_INDEX"), "kubernetes")
        return _checked(seat, "JOB_COMPLETION_INDEX and DEW_NUM_PROCESSES")
    return None


def _tasks_here(env: Mapping[str, str]) -> int:
    """How many tasks of the Slurm step run on this node.

    >>> _tasks_here({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"})
    3
    >>> _tasks_here({"SLURM_NTASKS_PER_NODE": "8"})
    8
    """
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _integer(env, "SLURM_NTASKS_PER_NODE")
    per_node = env.get("SLURM_TASKS_PER_NODE", "")
    counts: list[int] = []
    for part in filter(None, per_node.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise PoolEnvironmentError(f"SLURM_TASKS_PER_NODE={per_node!r} is not a Slurm task count list.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = _integer(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else 0
    return counts[node] if node < len(counts) else 1


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise PoolEnvironmentError(f"The coordinator address {address!r} is not host:port.")
    return host.strip("[]"), int(port)


def connect_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds a process waits for the coordinator: ``DEW_CONNECT_TIMEOUT``, else 300."""
    env = os.environ if env is None else env
    value = env.get(CONNECT_TIMEOUT)
    if not value:
        return _DEFAULT_TIMEOUT
    try:
        return float(value)
    except ValueError:
        raise PoolEnvironmentError(f"{CONNECT_TIMEOUT}={value!r} is not a number of seconds.") from None


def reach_coordinator(address: str, index: int, timeout: float) -> None:
    """Wait until process 0's coordinator accepts a connection, or raise CoordinatorUnreachableError.

    JAX's own client aborts the process (a C++ check failure, no Python
    exception) when the coordinator does not answer, so the failure is found
    here first, where it can be named. Process 0 instead checks that it can
    listen on the port.
    """
    host, port = _split(address)
    if index == 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", port))
            except OSError as error:
                raise CoordinatorUnreachableError(
                    f"Process 0 cannot listen on port {port} for the pool's coordinator ({error.strerror}). "
                    f"Another program holds it: pick a free port (dew launch --port PORT, or "
                    f"{COORDINATOR_PORT}=PORT on a cluster).") from None
        return
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(timeout, 0.1))):
                return
        except OSError as error:
            last = error.strerror or type(error).__name__
        if time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    raise CoordinatorUnreachableError(
        f"Process {index} could not reach the pool's coordinator at {address} within {timeout:g} s "
        f"({last}). Process 0 listens there: check that it started, that {host} resolves to its "
        f"host from this one, and that port {port} is open between the hosts (or choose another with "
        f"dew launch --port PORT / {COORDINATOR_PORT}); {CONNECT_TIMEOUT} sets how long to wait.")
