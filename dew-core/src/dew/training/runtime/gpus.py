"""Which of a machine's GPUs each process of a pool computes with: its own, never a neighbour's.

A pool may start several processes on one machine (``dew launch -n N``, or
Slurm tasks sharing a node). Left alone, every one of them would open every
GPU it sees, or, under Slurm, JAX would pick GPU ``SLURM_LOCALID`` alone
whatever the task was given. So the launcher decides: the GPUs a machine
shows are split into equal, contiguous shares, one per process on it, and
process ``i`` of the machine gets share ``i`` through ``JAX_LOCAL_DEVICE_IDS``
(which ``jax.distributed.initialize`` reads). Every GPU stays visible to CUDA,
so NCCL still finds the peers it talks to; JAX just computes on its own.

A machine's GPUs are those ``CUDA_VISIBLE_DEVICES`` lists when it is set, else
those the NVIDIA driver lists under ``/proc/driver/nvidia/gpus``; a process
that runs on the CPU (``JAX_PLATFORMS`` without ``cuda``) is given none. A
``JAX_LOCAL_DEVICE_IDS`` already set is the user's choice and is kept.
Where Slurm gives each task its own GPUs (``--gpus-per-task``, which the
sbatch script ``dew launch --print slurm --gpus-per-process K`` asks for), a
task's visible GPUs are already its own, and it takes them all.

>>> gpu_share(local_index=1, local_count=2, visible=8)
[4, 5, 6, 7]
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dew.errors import DewError

__all__ = ["DEVICE_IDS", "GpuShareError", "gpu_environment", "gpu_share", "visible_gpus"]

DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
_DRIVER = Path("/proc/driver/nvidia/gpus")


class GpuShareError(DewError, ValueError):
    """The GPUs a machine shows cannot be split evenly among the processes started on it."""


def visible_gpus(env: Mapping[str, str] | None = None, driver: Path = _DRIVER) -> int:
    """How many GPUs a process started with env would see (0 when it runs on the CPU).

    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "0,3,5"}), visible_gpus({"CUDA_VISIBLE_DEVICES": ""})
    (3, 0)
    >>> visible_gpus({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0,1"})
    0
    """
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and not any(p.strip() in ("cuda", "gpu") for p in platforms.split(",")):
        return 0
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = [e for e in listed.split(",") if e.strip() and e.strip() != "-1"]
        return 0 if entries[:1] == ["NoDevFiles"] else len(entries)
    try:
        return sum(1 for entry in driver.iterdir() if entry.is_dir())
    except OSError:
        return 0


def gpu_share(local_index: int, local_count: int, visible: int) -> list[int]:
    """The GPU indices (among the visible ones) of process local_index of local_count on a machine."""
    if visible % local_count:
        fits = [n for n in range(1, visible + 1) if visible % n == 0]
        raise GpuShareError(
            f"{local_count} processes on this machine cannot share its {visible} GPUs evenly (each "
            f"process computes on GPUs of its own); start {' or '.join(map(str, fits))} processes per "
            "machine, or list the GPUs to use in CUDA_VISIBLE_DEVICES.")
    per = visible // local_count
    return list(range(local_index * per, (local_index + 1) * per))


def gpu_environment(local_index: int, local_count: int, env: Mapping[str, str] | None = None,
                    driver: Path = _DRIVER) -> dict[str, str]:
    """The variables that give process local_index of local_count on this machine its own GPUs.

    Empty on a machine without GPUs, for a process that runs on the CPU, or
    when JAX_LOCAL_DEVICE_IDS is set already. Under Slurm with GPUs given
    per task (SLURM_GPUS_PER_TASK), every visible GPU is the task's own.

    >>> gpu_environment(2, 4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    {'JAX_LOCAL_DEVICE_IDS': '4,5'}
    >>> gpu_environment(1, 2, {"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_GPUS_PER_TASK": "2"})
    {'JAX_LOCAL_DEVICE_IDS': '0,1'}
    """
    env = os.environ if env is None else env
    if env.get(DEVICE_IDS):
        return {}
    visible = visible_gpus(env, driver)
    if not visible:
        return {}
    if env.get("SLURM_GPUS_PER_TASK"):
        local_index, local_count = 0, 1
    return {DEVICE_IDS: ",".join(map(str, gpu_share(local_index, local_count, visible)))}
