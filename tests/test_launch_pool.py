"""`dew launch -n 2` over real processes: the shipped tiny-lm recipe (shrunk by overrides) trains in
a pool of two ranks joined over 127.0.0.1, stops with its checkpoint on SIGTERM to the launcher
(exit 143), resumes from it, and dies at once on a second SIGTERM; a rank that cannot reach its
coordinator says where it looked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dew.testing.processes import free_port
from test_launch import _gone  # every test folder is on sys.path (conftest.py)

SMALL = ["model.num_layers=1", "model.emb_features=32", "model.mlp_features=64", "model.num_heads=2",
         "data.batch=4", "trackers=[]", "objective.prompt=null", "trainer.log_every=1",
         "trainer.checkpoint_every=100000"]


class Launch:
    """dew launch in a subprocess, its output collected by threads so that the test can wait on it."""

    def __init__(self, args: list[str], cwd: Path, env: dict | None = None) -> None:
        environment = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
                           **(env or {}))
        self.process = subprocess.Popen([sys.executable, "-m", "dew.cli", "launch", *args], cwd=cwd,
                                        env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                         for stream, into in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_for(self, pattern: str, timeout: float = 240, stream: str = "out") -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.out if stream == "out" else self.err):
                found = re.search(pattern, line)
                if found:
                    return found
            assert self.process.poll() is None, self.text()
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.text()}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def text(self) -> str:
        return "".join(self.out) + "\n--- stderr ---\n" + "".join(self.err)[-6000:]


def _children(pid: int) -> list[int]:
    """The processes pid started (its ranks), from /proc. A thread may end between the listing and
    the read (the launcher's threads come and go while the ranks start); its file is then gone."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


@pytest.mark.slow
def test_a_pool_of_two_trains_stops_with_its_checkpoint_on_sigterm_and_resumes(tmp_path):
    # The shipped recipes' folder is named anew at every start ({timestamp}): the pool agrees on
    # one, records it in started.json, and its stop line names it as the folder to start again in.
    args = ["-n", "2", "--grace", "120", "tiny-lm", *SMALL]
    launch = Launch([*args, "trainer.steps=100000", "trainer.checkpoint_dir=runs/{timestamp}"], tmp_path)
    launch.wait_for(r"\(2 process\(es\)\)")
    launch.wait_for(r"^step 3: loss")
    signalled = time.monotonic()
    launch.process.send_signal(signal.SIGTERM)
    code = launch.wait(timeout=150)
    assert code == 143, launch.text()
    assert time.monotonic() - signalled < 120  # within the grace
    said = re.findall(r"preempted at step (\d+); its checkpoint, data position and journal are in (\S+)\. "
                      r"To resume, start the pool again with trainer.checkpoint_dir=(\S+) ", launch.text())
    assert len(said) == 1, launch.text()  # said once, by process 0
    stopped, run = int(said[0][0]), tmp_path / said[0][1]
    assert said[0][2] == said[0][1] and run.parent == tmp_path / "runs", launch.text()
    assert stopped >= 3 and (run / str(stopped)).is_dir(), launch.text()
    assert json.loads((run / "started.json").read_text())["timestamp"].replace(":", "-") == run.name
    assert "asking the ranks to checkpoint and exit within 120 s" in launch.text()

    args.append(f"trainer.checkpoint_dir={said[0][2]}")
    again = Launch([*args, f"trainer.steps={stopped + 2}"], tmp_path)
    assert again.wait(timeout=300) == 0, again.text()
    assert f"Training from step {stopped} to {stopped + 2}" in again.text()
    assert (run / str(stopped + 2)).is_dir()


@pytest.mark.slow
def test_a_second_sigterm_ends_every_rank_at_once(tmp_path):
    launch = Launch(["-n", "2", "tiny-lm", *SMALL, "trainer.steps=100000",
                     f"trainer.checkpoint_dir={tmp_path / 'run'}"], tmp_path)
    launch.wait_for(r"^step 2: loss")
    # The ranks are frozen first, so the stop the first SIGTERM asks for is still under way,
    # however slowly a busy machine runs the test, when the second arrives; it is sent once
    # the launcher says it acted on the first (two pending at once would be one).
    ranks = _children(launch.process.pid)
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    launch.process.send_signal(signal.SIGTERM)
    launch.wait_for(r"asking the ranks to checkpoint and exit", stream="err")
    second = time.monotonic()
    launch.process.send_signal(signal.SIGTERM)
    assert launch.wait(timeout=60) == 137, launch.text()  # killed: no checkpoint of this stop (not 143)
    assert time.monotonic() - second < 5
    killed = re.search(r"a second SIGTERM: killing ranks? (.*)", launch.text())
    assert killed, launch.text()
    pids = [int(p) for p in re.findall(r"pid (\d+)", killed.group(1))]
    assert pids and all(_gone(pid) for pid in pids)


@pytest.mark.slow
@pytest.mark.parametrize("signum, status, said", [
    (signal.SIGINT, 130, r"interrupted \(Ctrl-C\)"),
    # a SIGTERM ended each rank where it stood: status 143, which says a checkpoint was written, and none was
    (signal.SIGTERM, 143, "preempted"),
])
def test_a_stop_while_the_ranks_start_stops_the_pool_at_one_step_with_its_checkpoint(signum, status, said,
                                                                                     tmp_path):
    """Ctrl-C the moment the ranks exist (their interpreters still starting): the launcher passes it
    on, and each rank used to raise it wherever it stood: a traceback from an import (the pool failed
    with status 1), or nothing at all (a KeyboardInterrupt inside a garbage-collection callback is
    discarded, and the pool trained on). Held from each rank's first line and passed to the pool once
    it forms, it stops every rank at one step, saved, with status 130 (143 for a SIGTERM)."""
    run = tmp_path / "run"
    launch = Launch(["-n", "2", "--grace", "150", "tiny-lm", *SMALL, "trainer.steps=100000",
                     f"trainer.checkpoint_dir={run}"], tmp_path)
    began = time.monotonic()
    while len(_children(launch.process.pid)) < 2:
        assert time.monotonic() - began < 60 and launch.process.poll() is None, launch.text()
        time.sleep(0.005)
    launch.process.send_signal(signum)
    code = launch.wait(timeout=200)
    assert code == status, launch.text()
    stopped = re.search(said + r" at step (\d+); its checkpoint, data position and journal are in "
                        r"run\. To resume, start the pool again \(the same dew launch",
                        launch.text())
    assert stopped and (run / stopped.group(1) / "dew.json").is_file(), launch.text()
    assert "Traceback" not in launch.text() and "failed with status" not in launch.text(), launch.text()


@pytest.mark.slow
def test_a_rank_that_cannot_reach_its_coordinator_names_it(tmp_path):
    port = free_port()
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "5"}
    launch = Launch(["--port", str(port), "--connect-timeout", "2", "tiny-lm", *SMALL], tmp_path, env=slurm)
    code = launch.wait(timeout=120)
    assert code == 2, launch.text()  # the rank's dew train named the error: status 2
    text = launch.text()
    assert f"CoordinatorUnreachableError: Process 1 could not reach the pool's coordinator at 127.0.0.1:{port}" in text
    assert "rank 1 failed with status 2" in text


@pytest.mark.slow
def test_a_coordinator_whose_peers_never_join_says_so_in_one_line(tmp_path):
    """JAX's coordinator ends its process with a C++ abort and ten stack frames (status 134) when a
    peer never registers; process 0 now says what happened and what to start, with status 2."""
    port = free_port()
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "5"}
    launch = Launch(["--port", str(port), "--connect-timeout", "2", "tiny-lm", *SMALL], tmp_path, env=slurm)
    code = launch.wait(timeout=120)
    text = launch.text()
    assert code == 2, text
    assert (f"dew: the pool's coordinator at 127.0.0.1:{port} waited 2 s for the other 1 process(es), and "
            "not all of them joined") in text
    assert "rank 0 failed with status 2" in text and "Terminating process" not in text and "@ 0x" not in text


@pytest.mark.slow
def test_a_rank_that_fails_before_its_first_step_ends_the_pool_with_its_status(tmp_path):
    """Rank 0 refused its tracker's folder and printed why, then waited at exit for JAX's
    distributed shutdown, which rank 1 (inside its first step) never reached: the pool hung."""
    (tmp_path / "afile").write_text("")
    launch = Launch(["-n", "2", "--grace", "5", "tiny-lm", *SMALL, "trainer.steps=6",
                     f"trainer.checkpoint_dir={tmp_path / 'run'}",
                     f"trackers=[{{name: local, directory: {tmp_path / 'afile' / 'sub'}}}]"], tmp_path)
    code = launch.wait(timeout=120)
    text = launch.text()
    assert code == 2, text
    assert "TrackerWriteError" in text and "rank 0 failed with status 2" in text
    assert "SIGTERM" not in text  # ended by the failure, not by a signal


def _plugin_site(tmp_path: Path, module: str, name: str, attribute: str, code: str) -> dict[str, str]:
    """A distribution shipping module (code) as the dew plugin name, in a folder of its own; the
    environment that puts it on a child's path."""
    site = tmp_path / "site"
    info = site / f"{module}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[dew.plugins]\n{name} = {module}:{attribute}\n")
    (site / f"{module}.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


HOOK = """
import jax
from dew.plugins import hookimpl


class FailOnRankOne:
    @hookimpl
    def dew_step_end(self, step):
        if jax.process_index() == 1 and step == 5:
            raise RuntimeError("rank 1's plugin failed at step 5")
"""


@pytest.mark.slow
def test_a_plugin_failing_on_one_rank_mid_run_ends_the_pool_with_its_status(tmp_path):
    """The failing rank printed its PluginHookError, then waited on collectives (a save's commit,
    its close, JAX's shutdown) that the other rank, inside its next step, never joined."""
    run = tmp_path / "run"
    launch = Launch(["-n", "2", "--grace", "5", "tiny-lm", *SMALL, "trainer.steps=40", "trainer.checkpoint_every=2",
                     f"trainer.checkpoint_dir={run}"], tmp_path,
                    env=_plugin_site(tmp_path, "dewtest_failing_hook", "failing", "FailOnRankOne", HOOK))
    code = launch.wait(timeout=180)
    text = launch.text()
    assert code == 2, text
    assert "PluginHookError" in text and "rank 1's plugin failed at step 5" in text
    # the rank that failed first is named, though rank 0's collective then failed too, without it
    assert "rank 1 failed with status 2" in text and "SIGTERM" not in text
    assert "Traceback" not in text
    # step 2 was committed before step 4's save began (a save waits for the one before it): it is kept
    assert (run / "2" / "dew.json").is_file()


CRASH = """
import os
import jax
from dew.plugins import hookimpl


class CrashOnRankOne:
    @hookimpl
    def dew_step_end(self, step):
        if jax.process_index() == 1 and step == 3:
            os._exit(9)  # as an out-of-memory kill ends a process: without a word to the pool
"""


@pytest.mark.slow
def test_a_process_whose_peer_died_exits_75_naming_the_collective_that_lost_it(tmp_path):
    """Two processes joined by hand, each under its own launcher: the one left behind ended with
    status 1, the status of a bug, and its launcher named it as the failure."""
    site = _plugin_site(tmp_path, "dewtest_crash", "crash", "CrashOnRankOne", CRASH)
    port = free_port()
    launches = [Launch(["--grace", "5", "tiny-lm", *SMALL, "trainer.steps=40", f"trainer.checkpoint_dir={tmp_path / 'run'}"],
                       tmp_path, env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                                      "JAX_PROCESS_ID": str(index), **site})
                for index in (0, 1)]
    codes = [launch.wait(timeout=180) for launch in launches]
    left = launches[0].text()
    assert codes == [75, 9], left + launches[1].text()
    assert "another process of the pool ended, so this one cannot go on (a collective failed: " in left, left
    assert "rank 0 failed with status 75 (it lost another process of the pool)" in left and "Traceback" not in left


@pytest.mark.slow
def test_processes_given_different_recipes_are_refused_by_name(tmp_path):
    """Two ranks joined by hand with different trainer.steps trained until the shorter one's last
    save, a collective the other never called: the pool hung without a word."""
    port = free_port()
    launches = [Launch(["--grace", "5", "tiny-lm", *SMALL, f"trainer.steps={steps}",
                        f"trainer.checkpoint_dir={tmp_path / 'run'}"], tmp_path,
                       env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                            "JAX_PROCESS_ID": str(index)})
                for index, steps in ((0, 8), (1, 5))]
    codes = [launch.wait(timeout=120) for launch in launches]
    text = "".join(launch.text() for launch in launches)
    assert codes == [2, 2], text
    assert text.count("dew train: Process(es) 1 of the pool of 2 were given another recipe") == 2, text
    # and which field it was, where it named the process alone
    assert text.count("(recipe.trainer.steps is 8 on process 0 and 5 on process 1)") == 2, text
    assert not (tmp_path / "run" / "1").exists()  # refused before any step


def _in_a_pool_and_alone(common: list[str], tmp_path: Path) -> None:
    """dew train common by a pool of two into tmp_path/pool, and by this process into tmp_path/one."""
    from dew.cli import main

    launch = Launch(["-n", "2", *common, f"trainer.checkpoint_dir={tmp_path / 'pool'}",
                     f"trackers.0.directory={tmp_path / 'pool'}"], tmp_path)
    assert launch.wait(timeout=300) == 0, launch.text()
    assert main(["train", *common, f"trainer.checkpoint_dir={tmp_path / 'one'}",
                 f"trackers.0.directory={tmp_path / 'one'}"]) == 0


@pytest.mark.slow
def test_a_pool_scores_its_generation_task_as_one_process_does(tmp_path):
    """tiny-sft's generation task on a pool of two failed at its evaluation fetching an array held
    across both processes (each generates its own rows, so decoding with the pool's arrays cannot
    work): the pool ended with status 1 and the task's scores were never logged."""
    import json


    common = ["tiny-sft", "model.num_layers=1", "model.emb_features=32", "model.mlp_features=64",
              "model.num_heads=2", "data.batch=4", "trainer.steps=2", "trainer.log_every=1",
              "trainer.evaluate.0.every=1", "trainer.evaluate.0.max_new_tokens=4"]
    _in_a_pool_and_alone(common, tmp_path)

    def scored(run):
        rows = [json.loads(line) for line in (run / "scalars.jsonl").read_text().splitlines()]
        return {row["step"]: (row["eval/addition/exact_match"], row["eval/addition/records"])
                for row in rows if "eval/addition/exact_match" in row}

    assert scored(tmp_path / "pool") == scored(tmp_path / "one") and sorted(scored(tmp_path / "pool")) == [1, 2]


def test_processes_holding_different_numbers_of_devices_are_refused_naming_them(tmp_path):
    """Rank 1 given one CPU device and rank 0 two: the pool's first exchange failed with a reshape
    error's traceback (status 1, 'a bug'). Each rank's device count is set as the rank starts, by a
    sitecustomize module that reads its rank."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('DEW_POOL_RANK'):  # a rank: process 0 holds two devices, process 1 one\n"
        "    count = 1 if os.environ.get('JAX_PROCESS_ID') == '1' else 2\n"
        "    os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={count}'\n")
    launch = Launch(["-n", "2", "tiny-lm", *SMALL, "trainer.steps=2", f"trainer.checkpoint_dir={tmp_path / 'run'}"],
                    tmp_path, env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])})
    assert launch.wait(timeout=200) == 2, launch.text()
    assert ("The pool's processes hold different numbers of devices (process 0: 2, process 1: 1); every process "
            "must hold the same number.") in launch.text()
    assert "Traceback" not in launch.text()


@pytest.mark.slow
def test_a_pool_with_local_checkpoints_is_launched_again_and_resumes(tmp_path):
    """A pool's local store answers every checkpoint query collectively, and only process 0 asked for
    the resumed step's meta (for its upgrade line): the ranks' collectives paired wrongly, and the
    relaunch aborted in Gloo ('Received data size doesn't match') or named a lease nobody held."""
    args = ["-n", "2", "tiny-lm", *SMALL, "trainer.checkpoint_dir=runs/pool",
            "trainer.local_checkpoint_dir=runs/pool-local", "trainer.local_every=2", "trainer.checkpoint_every=3"]
    first = Launch([*args, "trainer.steps=4"], tmp_path)
    assert first.wait(timeout=300) == 0, first.text()
    again = Launch([*args, "trainer.steps=6"], tmp_path)
    assert again.wait(timeout=300) == 0, again.text()
    assert "Resuming runs/pool at step 4" in again.text() and "Training from step 4 to 6" in again.text()
    assert (tmp_path / "runs" / "pool" / "6").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("recipe, overrides", [
    ("addition-grpo", ["trainer.eval_every=2"]),
    ("flow-grpo-digits", ["trainer.eval_every=100", "objective.group_size=4", "data.batch=8"]),
])
def test_a_pool_rolls_out_as_one_process_does(recipe, overrides, tmp_path):
    """GRPO's pool failed at its first step reading the sampler's tokens, held across both processes
    (each rolled out its own rows with the pool's programs); FlowGRPO's two processes drew the same noise
    for different rows, so its rewards and gradients differed from one process's."""

    common = [recipe, "init=null", "trainer.steps=2", "trainer.log_every=1", *overrides]
    _in_a_pool_and_alone(common, tmp_path)

    def logged(run):
        rows = [json.loads(line) for line in (run / "scalars.jsonl").read_text().splitlines()]
        return {(row["step"], key): value for row in rows for key, value in row.items()
                if key.startswith(("train/reward", "train/loss", "train/grad_norm", "val/"))}

    pool, one = logged(tmp_path / "pool"), logged(tmp_path / "one")
    assert pool.keys() == one.keys() and (2, "train/reward") in pool
    for key, value in one.items():
        assert pool[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key  # a loss near 0 is float noise


@pytest.mark.slow
def test_a_stopped_rl_pool_journals_whole_batches_and_resumes_bitwise(tmp_path):
    """A GRPO pool journaled only rank 0's half of each batch, and resumed without replaying it: the
    batch it had made ahead (objective.max_lag) was sampled again from newer weights, and the run
    ended elsewhere than an uninterrupted one."""
    import numpy as np

    from dew.training.rollout_journal import read_journal

    # Steps enough that the signal, forwarded by dew launch to both ranks, lands mid-run: at 8 steps a fast
    # machine had finished the run before the ranks saw it, and the relaunch found nothing to resume.
    steps = 24
    common = ["addition-grpo", "init=null", f"trainer.steps={steps}", "trainer.log_every=1", "trainer.eval_every=100",
              "trainer.checkpoint_every=2", "data.batch=4", "objective.group_size=4", "objective.max_lag=1"]

    def launch(name):
        return Launch(["-n", "2", *common, f"trainer.checkpoint_dir={tmp_path / name}",
                       f"trackers.0.directory={tmp_path / name}"], tmp_path)

    assert launch("whole").wait(timeout=300) == 0
    stopped = launch("cut")
    stopped.wait_for(r"step 3:", timeout=300)
    stopped.process.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=120) == 143, stopped.text()
    again = launch("cut")
    assert again.wait(timeout=300) == 0, again.text()
    assert "Resuming" in again.text()

    def logged(run):
        rows = [json.loads(line) for line in (run / "scalars.jsonl").read_text().splitlines()]
        return {(row["step"], key): value for row in rows for key, value in row.items()
                if key.startswith(("train/reward", "train/loss", "train/grad_norm"))}

    assert logged(tmp_path / "cut") == logged(tmp_path / "whole")
    assert (tmp_path / "cut" / str(steps)).is_dir()
    whole = {entry.step: entry for entry in read_journal(tmp_path / "whole")}
    cut = {entry.step: entry for entry in read_journal(tmp_path / "cut")}
    assert set(range(steps)) <= whole.keys() == cut.keys()  # and the batch made ahead of the last step
    for step, entry in whole.items():  # every process's rows: data.batch prompts, group_size each
        assert entry.batch["tokens"].shape[0] == 4 * 4, step
        for key, value in entry.batch.items():
            np.testing.assert_array_equal(cut[step].batch[key], value, err_msg=f"step {step} {key}")
