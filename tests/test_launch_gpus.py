"""dew launch gives every process of a pool GPUs of its own: a local pool splits the machine's GPUs,
a Slurm task takes its node's share (or all of its own under --gpus-per-task), and the printed sbatch
script and JobSet manifest ask the engine for each rank's GPUs. No GPU is needed: the machine's GPUs
are those CUDA_VISIBLE_DEVICES lists, as they are for CUDA itself."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from dew.cli import main
from dew.training.runtime.gpus import gpu_environment, gpu_share, visible_gpus
from dew.training.runtime.pool import seat_from_environment

EIGHT = "0,1,2,3,4,5,6,7"


def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "JAX_", "JOB_COMPLETION", "CUDA_VISIBLE", "DEW_")):
            monkeypatch.delenv(name)


def _checked(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[int, dict[str, str]]:
    """What each rank's environment adds, as dew launch --check prints it."""
    assert main(["launch", *argv, "--check"]) == 0
    ranks = {}
    for line in capsys.readouterr().out.splitlines():
        head, rest = line.split(": ", 1)
        ranks[int(head.split()[1])] = dict(w.split("=", 1) for w in rest.split() if "=" in w and w[0].isupper())
    return ranks


def test_each_child_of_a_local_pool_receives_its_own_gpus(tmp_path: Path, monkeypatch, capsys):
    _clean(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", EIGHT)
    shares = {rank: env["JAX_LOCAL_DEVICE_IDS"] for rank, env in _checked(["-n", "4", "tiny-lm"], capsys).items()}
    assert shares == {0: "0,1", 1: "2,3", 2: "4,5", 3: "6,7"}
    one_each = _checked(["-n", "8", "tiny-lm"], capsys)
    assert [one_each[i]["JAX_LOCAL_DEVICE_IDS"] for i in range(8)] == [str(i) for i in range(8)]

    # The children themselves: each real process reports the variables it was started with.
    report = ("import json, os, pathlib, sys; pathlib.Path(sys.argv[1], os.environ['JAX_PROCESS_ID'])"
              ".write_text(json.dumps({k: os.environ.get(k) for k in ('JAX_LOCAL_DEVICE_IDS', "
              "'JAX_PROCESS_ID', 'CUDA_VISIBLE_DEVICES')}))")
    monkeypatch.setattr("dew.cli.launch.rank_argv",
                        lambda recipe, overrides: [sys.executable, "-c", report, str(tmp_path)])
    assert main(["launch", "-n", "2", "tiny-lm"]) == 0
    seen = {int(p.name): json.loads(p.read_text()) for p in tmp_path.iterdir()}
    # Every GPU stays visible to CUDA (NCCL reaches its peers); JAX computes on the rank's own half.
    assert seen == {0: {"JAX_LOCAL_DEVICE_IDS": "0,1,2,3", "JAX_PROCESS_ID": "0", "CUDA_VISIBLE_DEVICES": EIGHT},
                    1: {"JAX_LOCAL_DEVICE_IDS": "4,5,6,7", "JAX_PROCESS_ID": "1", "CUDA_VISIBLE_DEVICES": EIGHT}}


def test_gpus_that_do_not_split_evenly_are_refused_and_cpu_pools_get_none(monkeypatch, capsys):
    _clean(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", EIGHT)
    assert main(["launch", "-n", "3", "tiny-lm", "--check"]) == 2
    err = capsys.readouterr().err
    assert "3 processes" in err and "8 GPUs" in err and "1 or 2 or 4 or 8" in err
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # a pool on the CPU of a GPU machine: no GPUs named
    assert all("JAX_LOCAL_DEVICE_IDS" not in env for env in _checked(["-n", "3", "tiny-lm"], capsys).values())
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "5")  # the user's own choice is kept
    assert all(env.get("JAX_LOCAL_DEVICE_IDS") is None for env in _checked(["-n", "2", "tiny-lm"], capsys).values())
    assert visible_gpus({}, driver=Path("/no/such/driver")) == 0
    assert gpu_share(0, 1, 4) == [0, 1, 2, 3]


def test_slurm_tasks_take_their_node_s_share_or_their_own_gpus(monkeypatch):
    task = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "gpu[1-2]", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)"}
    seat = seat_from_environment(task)
    assert (seat.local_index, seat.local_count) == (1, 4)
    # --gpus-per-node: the node's eight GPUs are visible to all four tasks; task 1 takes the second pair.
    assert gpu_environment(seat.local_index, seat.local_count, {**task, "CUDA_VISIBLE_DEVICES": EIGHT}) == {
        "JAX_LOCAL_DEVICE_IDS": "2,3"}
    # --gpus-per-task=2: Slurm shows each task its own two; it takes both (JAX alone would take GPU 1 only).
    bound = {**task, "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_PER_TASK": "2"}
    assert gpu_environment(seat.local_index, seat.local_count, bound) == {"JAX_LOCAL_DEVICE_IDS": "0,1"}


def test_the_printed_scripts_give_each_rank_its_gpus(monkeypatch, capsys):
    _clean(monkeypatch)
    assert main(["launch", "--print", "slurm", "-n", "8", "--per-node", "4", "--gpus-per-process", "2",
                 "tiny-lm"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --ntasks-per-node=4\n" in script and "#SBATCH --gpus-per-task=2\n" in script
    # What one of its tasks then runs: srun's variables for task 6 (node 1, local 2) and its two GPUs.
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    for name, value in {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "gpu[3-4]",
                        "SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_PER_TASK": "2",
                        "CUDA_VISIBLE_DEVICES": "4,5"}.items():
        monkeypatch.setenv(name, value)
    assert main([*srun[srun.index("dew") + 1:], "--check"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("rank 6: ") and "JAX_LOCAL_DEVICE_IDS=0,1 " in line

    _clean(monkeypatch)
    assert main(["launch", "--print", "jobset", "-n", "4", "--gpus-per-process", "8", "tiny-lm"]) == 0
    container = yaml.safe_load(capsys.readouterr().out)["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    # A pod is one rank alone on its share of a node: it computes on every GPU it is shown.
    env = {e["name"]: e["value"] for e in container["env"]}
    seat = seat_from_environment({**env, "JOB_COMPLETION_INDEX": "3"})
    assert gpu_environment(seat.local_index, seat.local_count, {"CUDA_VISIBLE_DEVICES": EIGHT}) == {
        "JAX_LOCAL_DEVICE_IDS": EIGHT}
    assert main(["launch", "--print", "slurm", "-n", "2", "--gpus-per-process", "0", "tiny-lm"]) == 2
    assert "at least one GPU" in capsys.readouterr().err


@pytest.mark.parametrize("given, expected", [({"SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "1"}, "4,5,6,7"),
                                             ({"SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_PER_TASK": "8"}, EIGHT)])
def test_a_rank_srun_starts_itself_joins_its_pool_with_its_gpus(monkeypatch, given, expected):
    """`srun dew train ... trainer.multi_host=true` (no dew launch around it): JAX took each task's
    SLURM_LOCALID as its one GPU, so a task given eight computed on one of them."""
    import jax

    from dew.training.runtime import pool, process

    _clean(monkeypatch)
    for name, value in {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "gpu1",
                        "CUDA_VISIBLE_DEVICES": EIGHT, **given}.items():
        monkeypatch.setenv(name, value)
    seen = {}
    monkeypatch.setattr(pool, "reach_coordinator", lambda *args: None)
    monkeypatch.setattr(jax.config, "update", lambda *args: None)
    monkeypatch.setattr(jax.distributed, "initialize",
                        lambda *args, **kwargs: seen.update(ids=os.environ.get("JAX_LOCAL_DEVICE_IDS"), **kwargs))
    monkeypatch.setattr("dew.interrupts.serve", lambda: None)
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "")  # unset, and restored so after the test whatever it sets
    process._join_pool()
    assert seen["ids"] == expected and seen["process_id"] == 1 and seen["num_processes"] == 2
