"""Preemption: Preempted's exit, the SIGTERM watch, and a trained run stopped and resumed to the bit."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dew.testing.processes import run_until_lines
from dew.training.runtime import Preempted, PreemptionNotice, PreemptionWatch


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          **kwargs)


def test_uncaught_preempted_exits_143_with_one_line() -> None:
    result = _python("from dew.training.runtime import Preempted\nraise Preempted(7)")
    assert result.returncode == 143
    assert result.stderr.strip().splitlines() == [
        "dew: preempted at step 7; its checkpoint and data position are written. "
        "Run the same command again to resume."
    ]


def test_caught_preempted_is_quiet_and_keeps_its_step() -> None:
    result = _python(
        "from dew.training.runtime import Preempted\n"
        "try:\n    raise Preempted(4)\nexcept SystemExit as stop:\n    print(stop.step)\n"
    )
    assert result.returncode == 0 and result.stdout.strip() == "4" and result.stderr == ""
    assert pickle.loads(pickle.dumps(Preempted(9))).step == 9
    assert isinstance(Preempted(1), SystemExit)


def test_sigterm_is_a_notice_inside_the_watch_only() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatch() as watch:
        assert not watch.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not watch.reached(2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.reached(2)
    assert signal.getsignal(signal.SIGTERM) is before
    assert not PreemptionNotice.received()  # consumed by the run it stopped


def test_notice_in_code_and_outside_the_main_thread() -> None:
    with PreemptionWatch() as watch:
        assert not watch.reached(1)
        PreemptionNotice.send()
        assert watch.reached(1)
    seen = []

    def worker() -> None:
        with PreemptionWatch() as inner:
            seen.append(signal.getsignal(signal.SIGTERM))
            PreemptionNotice.send()
            seen.append(inner.reached(3))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGTERM), True]


def test_a_second_sigterm_ends_the_process_at_once() -> None:
    # The second signal is sent once the first is known to be handled (reached says so), not
    # after a pause: two signals pending at once would run the handler only once.
    code = (
        "import os, signal, time\nfrom dew.training.runtime import PreemptionWatch\n"
        "with PreemptionWatch() as watch:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n    deadline = time.monotonic() + 60\n"
        "    while not watch.reached(1) and time.monotonic() < deadline:\n        time.sleep(0.01)\n"
        "    print(watch.reached(1), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n    print('survived')\n"
    )
    result = _python(code)
    assert result.stdout.strip() == "True" and result.returncode == -signal.SIGTERM


# -- a real run, stopped by SIGTERM and resumed -------------------------------------------------

TRAIN = r'''
import json, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from flax import linen as nn
from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective

directory, losses, mode = sys.argv[1], sys.argv[2], sys.argv[3]
from dew.training.runtime import PreemptionNotice


def hold(point):
    """At the point the test signals (the mode), stay until the signal has arrived: the stop
    then lands in that phase however late a busy machine delivers it."""
    if mode == point and not hold.done:
        hold.done = True
        deadline = time.monotonic() + 120
        while not PreemptionNotice.received() and time.monotonic() < deadline:
            time.sleep(0.01)


hold.done = False


class Regression(Objective):
    def __init__(self):
        self.model = nn.Dense(features=3)

    def init(self, key, variables=None):
        return self.model.init(key, jnp.zeros((1, 4), jnp.float32))

    def loss(self, variables, batch, step):
        noise = jax.random.normal(step.key, batch["y"].shape) * 0.01
        errors = (self.model.apply(variables, batch["x"]) - batch["y"] - noise) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size)), Aux(metrics={})


class Batches:
    def __init__(self, pause):
        self.index, self.pause = 0, pause

    def __iter__(self):
        return self

    def __next__(self):
        rng = np.random.default_rng(self.index)
        x = rng.normal(size=(8, 4)).astype(np.float32)
        self.index += 1
        print("batch", self.index, flush=True)
        time.sleep(self.pause)
        if self.index == 3:
            hold("step")
        return {"x": x, "y": np.tanh(x[:, :3] * 2 + 1)}

    def get_state(self):
        return str(self.index).encode()

    def set_state(self, state):
        self.index = int(state.decode())


def validation(partition):
    print("evaluating", flush=True)
    hold("eval")
    for index in range(2):
        rng = np.random.default_rng(1000 + index)
        x = rng.normal(size=(8, 4)).astype(np.float32)
        yield {"x": x, "y": np.tanh(x[:, :3] * 2 + 1)}


class Losses:
    def log(self, scalars, step):
        with open(losses, "a") as handle:
            kept = {k: v for k, v in scalars.items() if not k.startswith("throughput/") and k != "train/step_time"}
            handle.write(json.dumps({"step": step, "scalars": kept}) + "\n")

    def artifact(self, value, step):
        pass


if mode == "save":
    original = Checkpoints.save

    def slow_save(self, step, *args, **kwargs):
        print("saving", step, flush=True)
        if step == 8:
            hold("save")
        return original(self, step, *args, **kwargs)

    Checkpoints.save = slow_save

pause = 0.0 if mode == "none" else 0.05
data = Dataset(train=lambda partition: Batches(pause), val=validation, records=None, batch=8)
checkpoints = Checkpoints(directory, keep=2)
trainer = Trainer(Regression(), optax.adam(0.05), key=jax.random.key(0), checkpoints=checkpoints,
                  accumulation=2, tracker=Losses())
final = trainer.fit(data, steps=12, log_every=1, eval_every=5, checkpoint_every=4)
checkpoints.wait()
print("finished", int(final.step), flush=True)
'''

TRIGGERS = {"step": "batch 3", "eval": "evaluating", "save": "saving 8"}


def _losses(path: Path) -> dict[tuple[int, str], float]:
    """Every logged scalar (losses and validation scores) by (step, name); a repeat must agree."""
    table: dict[tuple[int, str], float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for name, value in row["scalars"].items():
            key = (row["step"], name)
            assert key not in table or table[key] == value, (key, table[key], value)
            table[key] = value
    return table


def _steps(table: dict[tuple[int, str], float]) -> list[int]:
    return sorted({step for step, name in table if name == "train/loss"})


def _train(tmp_path: Path, name: str, mode: str, trigger: str | None = None) -> tuple[int, str, str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    done = run_until_lines([sys.executable, str(script), str(tmp_path / name), str(tmp_path / f"{name}.jsonl"), mode],
                           signal_at=[trigger] if trigger is not None else [], timeout=180)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], float]:
    where = tmp_path_factory.mktemp("whole")
    code, out, err = _train(where, "run", "none")
    assert code == 0, err[-4000:]
    assert "finished 12" in out
    losses = _losses(where / "run.jsonl")
    assert _steps(losses) == list(range(1, 13))
    assert (10, "val/loss") in losses or any(name.startswith("val/") for _, name in losses), sorted(losses)
    return losses


@pytest.mark.slow
def test_sigterm_at_three_points_then_rerun_matches_the_uninterrupted_run(
        tmp_path: Path, uninterrupted: dict[tuple[int, str], float]) -> None:
    """One run stopped three times (mid-step, during evaluation, during a save), each time resumed."""
    start = 0
    for point, expected in (("step", None), ("eval", 5), ("save", 8)):
        code, out, err = _train(tmp_path, "run", point, TRIGGERS[point])
        assert code == 143, f"{point}: {err[-4000:]}"
        stopped = [line for line in err.splitlines() if line.startswith("dew: preempted at step")]
        assert len(stopped) == 1, err[-4000:]
        step = int(stopped[0].split()[4].rstrip(";"))
        assert f"Training from step {start} to 12" in out and "finished" not in out
        assert expected is None or step == expected, (point, step)
        assert start < step < 12
        assert (tmp_path / "run" / str(step) / "dew.json").is_file()
        assert max(_steps(_losses(tmp_path / "run.jsonl"))) == step
        start = step
    code, out, err = _train(tmp_path, "run", "none")
    assert code == 0, err[-4000:]
    assert f"Training from step {start} to 12" in out and "finished 12" in out
    assert _losses(tmp_path / "run.jsonl") == uninterrupted  # every scalar, bit for bit


def test_fit_with_the_target_reached_reads_and_compiles_nothing(tmp_path: Path) -> None:
    import jax
    import optax

    from dew import Checkpoints, Trainer
    from dew.data import Dataset
    from tiny_objective import DATA, Tiny

    checkpoints = Checkpoints(tmp_path / "run")
    Trainer(Tiny(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=checkpoints).fit(
        DATA, steps=3, checkpoint_every=3)
    checkpoints.wait()
    saved = sorted(p.name for p in (tmp_path / "run").iterdir())

    def refuse(*args, **kwargs):
        raise AssertionError("read or compiled")

    trainer = Trainer(Tiny(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path / "run"))
    trainer.compile = refuse
    final = trainer.fit(Dataset(train=refuse, val=refuse, batch=4), steps=3, checkpoint_every=1)
    assert int(final.step) == 3
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == saved


POOL_WATCH = r"""
import sys, time
import jax
process, port, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
from dew.training.runtime import PreemptionNotice, PreemptionWatch
with PreemptionWatch() as watch:
    for step in range(1, 400):
        if how == "notice" and process == 1 and step == 10:
            PreemptionNotice.send()
        if step == 5:
            print("ready", flush=True)
        if watch.reached(step):
            print("stopped at", step, flush=True)
            break
        time.sleep(0.05)
    else:
        print("never stopped", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "notice"])
def test_a_pool_stops_at_one_agreed_step(tmp_path: Path, how: str) -> None:
    from dew.testing.processes import free_port

    port = str(free_port())
    script = tmp_path / "watch.py"
    script.write_text(POOL_WATCH)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    workers = [subprocess.Popen([sys.executable, str(script), str(index), port, how], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env) for index in range(2)]
    try:
        if how == "sigterm":
            assert workers[1].stdout is not None
            for line in workers[1].stdout:
                if line.strip() == "ready":
                    workers[1].send_signal(signal.SIGTERM)  # only one process is signalled
                    break
        outputs = [worker.communicate(timeout=120) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    stops = []
    for worker, (out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:]
        stops.append([line for line in out.splitlines() if line.startswith("stopped at")])
    assert stops[1] and stops[0] == stops[1], stops


# -- Ctrl-C ---------------------------------------------------------------------------------------

CTRL_C = r'''
import sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from flax import linen as nn
from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective


class Regression(Objective):
    def init(self, key, variables=None):
        return nn.Dense(1).init(key, jnp.zeros((1, 4)))

    def loss(self, variables, batch, step):
        errors = (nn.Dense(1).apply(variables, batch["x"]) - 1.0) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size)), Aux()


def batches(partition):
    index = 0
    while True:
        index += 1
        print("batch", index, flush=True)
        time.sleep(0.05 if index < 6 else 1.0)  # slow from batch 6: signals land mid-fetch
        yield {"x": np.full((8, 4), index, np.float32)}


if sys.argv[2] == "hold":  # the stop's save is still under way when the second Ctrl-C arrives
    def held(self, step, *args, **kwargs):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.01)

    Checkpoints.save = held

Trainer(Regression(), optax.sgd(0.01), key=jax.random.key(0),
        checkpoints=Checkpoints(sys.argv[1])).fit(Dataset(train=batches, batch=8), steps=10_000)
'''


def _interrupted(tmp_path: Path, signals: int) -> tuple[subprocess.CompletedProcess, Path]:
    """Ctrl-C at batch 5; a second one only once the run says it is stopping (its own line, not
    a pause: the first stop is then known to be under way, its save held until the second)."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path / "checkpoints"),
                              "hold" if signals > 1 else "save"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    sent = 0
    for line in child.stdout:
        lines.append(line)
        if (sent == 0 and line.startswith("batch 5")) or (0 < sent < signals and "Ctrl-C: stopping here" in line):
            child.send_signal(signal.SIGINT)
            sent += 1
        if sent == signals:
            break
    out, err = child.communicate(timeout=120)
    return subprocess.CompletedProcess(child.args, child.returncode, "".join(lines) + out, err), tmp_path


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_exits_130(tmp_path: Path) -> None:
    from dew import Checkpoints

    result, _ = _interrupted(tmp_path, signals=1)
    assert result.returncode == 130, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("dew: interrupted (Ctrl-C) at step ") and "checkpoint and data position are written" in line
    # acknowledged as the signal comes, where the stop line goes: the step under way may take long
    acknowledged = "Ctrl-C: the run stops when the step under way ends (a second Ctrl-C stops at once)\n"
    assert result.stdout.count(acknowledged) == 1
    assert result.stdout.index(acknowledged) < result.stdout.index("Ctrl-C: stopping here"), result.stdout
    step = int(line.split("at step ")[1].split(";")[0])
    assert Checkpoints(tmp_path / "checkpoints").latest == step


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    result, _ = _interrupted(tmp_path, signals=2)
    assert result.returncode == -signal.SIGINT, (result.returncode, result.stderr[-2000:])
    assert "a second Ctrl-C stops at once" in result.stdout
    assert "dew: a second Ctrl-C: stopping now, without finishing the step under way" in result.stderr


DISCARDED = r'''
import gc, os, signal, sys
sys.path.insert(0, sys.argv[2])  # dew-core's tests: their tiny objective
import jax, optax
from dew import Checkpoints, Trainer, interrupts
from tiny_objective import DATA, Tiny

interrupts.hold()  # as dew's command does from its first line


def ctrl_c_inside_a_gc_callback(phase, info):  # where JAX's own callback meets a Ctrl-C
    if phase == "start":
        gc.callbacks.remove(ctrl_c_inside_a_gc_callback)
        os.kill(os.getpid(), signal.SIGINT)


gc.callbacks.append(ctrl_c_inside_a_gc_callback)
gc.collect()  # Python raises the KeyboardInterrupt inside the callback, prints it and discards it
print("discarded", interrupts.pending(), flush=True)
Trainer(Tiny(), optax.adam(0.1), key=jax.random.key(0), checkpoints=Checkpoints(sys.argv[1])).fit(
    DATA, steps=50, checkpoint_every=100)
'''


def test_a_ctrl_c_python_discarded_stops_the_training_loop_at_its_first_step_saved(tmp_path: Path) -> None:
    """A Ctrl-C that lands in a garbage-collection callback (JAX's, in dew train's first seconds) is
    printed as 'Exception ignored' and discarded: the run trained on to its end. Noted from the
    command's first line, it stops the loop at its first step, with that step saved."""
    result = subprocess.run(
        [sys.executable, "-c", DISCARDED, str(tmp_path / "run"), str(Path(__file__).parent)], capture_output=True,
        text=True, timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    assert "discarded True" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 130, result.stderr[-3000:]
    assert "interrupted (Ctrl-C) at step 1; its checkpoint and data position are written" in result.stderr
    assert (tmp_path / "run" / "1" / "dew.json").is_file()
