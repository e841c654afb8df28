"""dew launch without training: the pool read from Slurm's and Kubernetes' environment, and the
launcher's stop handling over real child processes (plain Python programs, so each case takes
about a second). The printed JobSet manifest of a shipped recipe is tested in
tests/test_launch_manifest.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dew.testing.processes import free_port
from dew.training.runtime.pool import (
    CoordinatorUnreachableError,
    PoolEnvironmentError,
    PoolSeat,
    first_host,
    reach_coordinator,
    seat_from_environment,
)


def test_slurm_environment_names_the_first_node_of_the_step():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "a100-[07-10,03]",
           "SLURM_JOB_ID": "4097"}
    seat = seat_from_environment(env)
    # the port JAX's own Slurm detection picks for that job: both sides agree
    assert seat == PoolSeat(f"a100-07:{4097 % 4096 + 61440}", 8, 5, "slurm")
    assert seat_from_environment(env, port=9000).coordinator == "a100-07:9000"
    assert seat_from_environment({**env, "DEW_COORDINATOR_PORT": "9100"}).coordinator == "a100-07:9100"
    assert first_host("solo") == "solo" and first_host("n[1-4]") == "n1"


def test_kubernetes_indexed_job_reads_its_index_and_the_manifest_s_variables():
    env = {"JOB_COMPLETION_INDEX": "2", "DEW_NUM_PROCESSES": "4",
           "DEW_COORDINATOR_ADDRESS": "dew-x-ranks-0-0.dew-x:8476", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert seat_from_environment(env) == PoolSeat("dew-x-ranks-0-0.dew-x:8476", 4, 2, "kubernetes")
    with pytest.raises(PoolEnvironmentError, match="DEW_NUM_PROCESSES and DEW_COORDINATOR_ADDRESS"):
        seat_from_environment({"JOB_COMPLETION_INDEX": "0"})


def test_the_batch_shell_outside_srun_is_told_to_start_the_ranks_with_srun():
    """sbatch's own shell has SLURM_PROCID=0, the job's SLURM_NTASKS and SLURM_JOB_NODELIST, but no
    step: read as rank 0 of the job's tasks, it waited out the connect timeout for ranks srun never
    started. Only a step's SLURM_STEP_NODELIST places a rank (as JAX's Slurm detection reads it)."""
    shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    with pytest.raises(PoolEnvironmentError, match="SLURM_STEP_NODELIST is not; start the processes with srun"):
        seat_from_environment(shell)
    assert seat_from_environment({**shell, "SLURM_STEP_NODELIST": "n[1-2]"}).processes == 2


def test_explicit_variables_win_and_contradictions_are_named():
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1"}
    assert seat_from_environment(env) == PoolSeat("h:1", 2, 1, "environment")
    with pytest.raises(PoolEnvironmentError, match="index 4 of a pool of 4"):
        seat_from_environment({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1"})
    with pytest.raises(PoolEnvironmentError, match="JAX_PROCESS_ID is not"):
        seat_from_environment({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
    assert seat_from_environment({"PATH": "/bin"}) is None


def test_an_unreachable_coordinator_is_named_with_the_fix():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(CoordinatorUnreachableError) as error:
        reach_coordinator(f"127.0.0.1:{port}", index=1, timeout=1.0)
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert f"127.0.0.1:{port}" in message and "--port" in message and "DEW_CONNECT_TIMEOUT" in message
    with socket.socket() as holder:  # process 0 cannot listen where another program does
        holder.bind(("", port))
        holder.listen()
        with pytest.raises(CoordinatorUnreachableError, match=f"cannot listen on port {port}"):
            reach_coordinator(f"127.0.0.1:{port}", index=0, timeout=1.0)
        reach_coordinator(f"127.0.0.1:{port}", index=1, timeout=1.0)  # and a rank reaches it


# The launcher over real processes. Each rank prints "ready" and then either finishes, fails,
# or (like a rank busy writing its checkpoint) ignores SIGTERM.
RANK = r"""
import os, signal, sys, time
mode = sys.argv[1]
if mode == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif mode == "stops":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
# the launcher starts a rank with its stops blocked; a dew rank's first line takes them (dew.interrupts.hold)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
os.write(1, f"ready {os.getpid()}\n".encode())  # one write: the ranks share the pipe
peer = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "peer-ready")
if mode != "lost":
    open(peer, "w").close()
if mode == "fails":
    time.sleep(0.5)
    sys.exit(3)
if mode == "lost":  # a collective lost the peer, which is still on its way out
    while not os.path.exists(peer):  # however late the peer's interpreter started
        time.sleep(0.01)
    time.sleep(0.2)
    sys.exit(75)
time.sleep(120)
"""

LAUNCHER = """
import sys
from dew.training.runtime import launcher
from dew.training.runtime.launcher import Rank, supervise
launcher._BLAME_WAIT = 2.0
modes, grace = sys.argv[1].split(","), float(sys.argv[2])
ranks = [Rank(i, (sys.executable, sys.argv[3], mode)) for i, mode in enumerate(modes)]
sys.exit(supervise(ranks, grace=grace))
"""


def _launcher(tmp_path: Path, modes: str, grace: float) -> tuple[subprocess.Popen, list[int]]:
    (tmp_path / "rank.py").write_text(textwrap.dedent(RANK))
    (tmp_path / "launcher.py").write_text(textwrap.dedent(LAUNCHER))
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), modes, str(grace),
                                 str(tmp_path / "rank.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    pids = []
    while len(pids) < len(modes.split(",")):
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        assert line.startswith("ready "), (line, launcher.stderr.read())
        pids.append(int(line.split()[1]))
    return launcher, pids


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # reaped between the signal and the read: gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_stop_reaches_every_rank_and_the_pool_exits_143(tmp_path):
    launcher, pids = _launcher(tmp_path, "stops,stops", grace=30)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=20) == 143
    assert all(_gone(pid) for pid in pids)


def test_ranks_that_outlive_the_grace_are_killed_and_the_status_says_so(tmp_path):
    launcher, pids = _launcher(tmp_path, "stops,deaf", grace=1.5)
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=20) == 137
    assert 1.5 <= time.monotonic() - started < 10
    assert all(_gone(pid) for pid in pids)
    assert "did not stop within the grace of 1.5 s: killing rank 1" in launcher.stderr.read()


def test_a_second_signal_kills_every_rank_at_once(tmp_path):
    launcher, pids = _launcher(tmp_path, "deaf,deaf", grace=300)
    launcher.send_signal(signal.SIGTERM)
    # the second once the launcher says it acted on the first (two pending at once are one)
    said = ""
    while "asking the ranks to checkpoint and exit" not in said:
        line = launcher.stderr.readline()
        assert line, said  # the launcher ended without acting on the signal
        said += line
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=20) == 137  # killed before the stop's checkpoint: not 143, which says it was written
    assert time.monotonic() - started < 5
    assert all(_gone(pid) for pid in pids)
    assert "a second SIGTERM: killing ranks 0" in said + launcher.stderr.read()


def test_a_failed_rank_fails_the_pool_with_its_status(tmp_path):
    launcher, pids = _launcher(tmp_path, "deaf,fails", grace=300)
    assert launcher.wait(timeout=20) == 3
    assert all(_gone(pid) for pid in pids)
    said = launcher.stderr.read()
    assert "rank 1 failed with status 3" in said and "without it: killing rank 0 (pid" in said


def test_a_rank_that_lost_its_peer_does_not_take_the_blame_for_the_failure(tmp_path):
    """Rank 1's plugin failed; rank 0's collective lost it and rank 0 exited first (the exits race):
    the pool ended with rank 0's status 1 and named it, not the rank whose failure it was."""
    launcher, pids = _launcher(tmp_path, "lost,fails", grace=300)
    assert launcher.wait(timeout=20) == 3
    said = launcher.stderr.read()
    assert "rank 1 failed with status 3" in said and "rank 0 failed" not in said
    assert all(_gone(pid) for pid in pids)


def test_a_lost_peer_whose_cause_never_ends_is_reported_after_a_moment(tmp_path):
    started = time.monotonic()  # before the ranks start, so a late ready line cannot shorten the wait seen
    launcher, pids = _launcher(tmp_path, "lost,deaf", grace=300)
    assert launcher.wait(timeout=20) == 75
    assert 1.5 <= time.monotonic() - started < 20  # the launcher's wait of 2 s for the cause
    said = launcher.stderr.read()
    assert "rank 0 failed with status 75 (it lost another process of the pool)" in said
    assert "killing rank 1" in said and all(_gone(pid) for pid in pids)
