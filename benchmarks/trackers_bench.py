"""Step time with every tracker logging every step, against no tracker, in one run.

    .venv/bin/python benchmarks/trackers_bench.py [--repeats 6] [--arms each]
    .venv/bin/python benchmarks/trackers_bench.py --model mlp --step-ms 10 100

By default the model is the key-concepts page's language model (64 wide, 2
layers, 4 heads, MLP 256, batch 8 x 64 tokens: a step of about 11 ms on two
cores). With ``--model mlp`` an MLP's width is instead calibrated so one step
takes each ``--step-ms``. Both arms run the same fit (log_every=1, so the
loop fetches and logs metrics at every step in both); the tracker arm fans
out to LocalTracker, TensorBoardTracker, MLflowTracker (SQLite store, or
--mlflow-uri) and an offline WandbTracker, opened once and kept open across
the arm's fits (flushed after each, outside the timing). The step time is
the median time between consecutive steps' metrics (the mean from the
Goodput record is printed beside it; a burst of load from elsewhere moves
the mean only). Arms alternate in ABBA order to spread drift and carry-over
between them; each alternation (one fit of each arm, back to back) gives one
ratio, and the script prints their median and worst against the goals
(median <= 1.02, worst <= 1.05), with each arm's best and median. A third
arm, ``again``, is the no-tracker fit once more (``--no-control`` leaves it
out): its ratios to ``none`` are the machine's own spread between two fits of
one arm, the floor under which the worst alternation cannot be read. The
trackers' own CPU (``telemetry/tracker_cpu_seconds``: dew's writer thread and
the journal's appends) is printed per step; W&B's service process is not in
it. --arms each also times every tracker on its own. The machine running it
may be shared: other load lands on either arm, so read the ratios, not the
milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import dew
from dew.cli.runs import amount, positive
from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective
from dew.tracking.background import tracker_cpu_seconds
from dew.tracking.composite import Trackers
from dew.tracking.local import LocalTracker


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.gelu(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)


class Regression(Objective):
    def __init__(self, width: int) -> None:
        self.model = MLP(width)

    def init(self, key, variables=None):
        return variables if variables is not None else self.model.init(key, jnp.zeros((1, 64)))

    def loss(self, variables, batch, step):
        errors = (self.model.apply(variables, batch["x"]) - batch["y"]) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size, jnp.float32)), Aux(
            metrics={"abs": Mean(jnp.sum(jnp.sqrt(errors)), jnp.asarray(errors.size, jnp.float32))})


def key_concepts():
    """The key-concepts page's model, objective and data (docs: a step of about 11 ms)."""
    from dew import models
    from dew.data import ByteTokenizer
    from dew.objectives.lm import LMObjective

    tokenizer = ByteTokenizer()
    text = tokenizer.encode("dew trains jax models. " * 3)
    batch = {"text": np.tile(np.asarray(text[:65], np.int32), (8, 1))}
    model = models.build("causal_transformer", vocab_size=tokenizer.vocab_size, emb_features=64,
                         num_layers=2, num_heads=4, mlp_features=256, max_seq_len=128)

    def stream(partition):
        while True:
            yield batch

    return (lambda: LMObjective(model, seq_len=64)), Dataset(train=stream, val=None, records=8, batch=8)


def dataset(rows: int) -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 64)).astype(np.float32)
    batch = {"x": x, "y": x[:, :1] * 2.0}

    def stream(partition):
        while True:
            yield batch

    return Dataset(train=stream, val=None, records=None, batch=rows)


class Capture:
    """A sink that keeps the Goodput record and when each step's metrics arrived (both
    arms carry it)."""

    def __init__(self) -> None:
        self.goodput = None
        self.arrivals: list[float] = []
        self.thread_cpu: list[float] = []
        self.tracker_cpu = 0.0

    def log(self, scalars, step):
        self.arrivals.append(time.perf_counter())
        self.thread_cpu.append(time.thread_time())
        self.tracker_cpu = scalars.get("telemetry/tracker_cpu_seconds", self.tracker_cpu)

    def median_thread_cpu(self) -> float:
        """The training thread's own CPU time per step (median, past the first few): what
        the loop itself spends, trackers' hand-off included, whatever else the machine runs."""
        return float(np.median(np.diff(self.thread_cpu[3:])))

    def median_step(self) -> float:
        """The median time between consecutive steps' metrics (log_every=1), past the
        first few: a burst of load from elsewhere moves the mean, not the median."""
        gaps = np.diff(self.arrivals[3:])
        return float(np.median(gaps))

    def artifact(self, value, step):
        if getattr(value, "type", None) == "goodput":
            self.goodput = value

    def close(self):
        pass


ARMS = ("none", "local", "tensorboard", "mlflow", "wandb", "all")


def sinks(root: Path, index: int, mlflow_uri: str, arm: str = "all") -> list:
    from dew.trackers.mlflow import MLflowTracker
    from dew.trackers.tensorboard import TensorBoardTracker
    from dew.trackers.wandb import WandbTracker

    make = {
        "local": lambda: LocalTracker(root / f"local-{index}"),
        "tensorboard": lambda: TensorBoardTracker(root / f"tb-{index}"),
        "mlflow": lambda: MLflowTracker("dew-bench", f"arm-{index}", uri=mlflow_uri),
        "wandb": lambda: WandbTracker("dew-bench", f"arm-{index}", offline=True),
    }
    names = list(make) if arm == "all" else [] if arm in ("none", "again") else [arm]
    return [make[name]() for name in names]


def calibrate(target_ms: float, batch: int) -> int:
    """A width whose training step takes about target_ms here (time grows with width²)."""
    def step_ms(width: int) -> float:
        objective = Regression(width)
        params = objective.init(jax.random.key(0))
        x = jnp.ones((batch, 64))
        grad = jax.jit(jax.grad(lambda p: jnp.sum(objective.model.apply(p, x) ** 2)))
        jax.block_until_ready(grad(params))
        times = []
        for _ in range(10):  # the fastest of ten: load from elsewhere only adds time
            began = time.perf_counter()
            jax.block_until_ready(grad(params))
            times.append(time.perf_counter() - began)
        return 1e3 * min(times)

    width = 512
    for _ in range(2):  # once from a guess, once from the first estimate
        width = max(32, int(width * (target_ms / step_ms(width)) ** 0.5) // 32 * 32)
    return width


class Offset:
    """A sink seen at steps shifted by offset, so the sinks one arm keeps open across
    its fits always receive increasing steps (W&B ignores a step it has seen)."""

    def __init__(self, sink, offset: int) -> None:
        self.sink, self.offset = sink, offset

    def log(self, scalars, step):
        self.sink.log(scalars, step + self.offset)

    def artifact(self, value, step):
        self.sink.artifact(value, step + self.offset)

    def close(self):
        pass


def fit(args, arm: str, opened: list, offset: int) -> tuple[float, float, float]:
    """One fit of the arm; its sinks stay open between fits and are flushed after each."""
    capture = Capture()
    tracker = Trackers(capture, *(Offset(sink, offset) for sink in opened))
    trainer = dew.Trainer(args.objective(), optax.adam(1e-3), key=jax.random.key(0),
                          tracker=tracker)
    cpu = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(args.data, steps=args.steps, log_every=1)
    cpu = time.process_time() - cpu
    before = tracker_cpu_seconds()
    began = time.perf_counter()
    for sink in opened:
        sink.flush()  # the writer's backlog lands on this arm, not on the next fit
    flushing = time.perf_counter() - began
    sinks_cpu = capture.tracker_cpu + tracker_cpu_seconds() - before  # the backlog's share too
    good = capture.goodput
    per_step = capture.median_step()
    thread = capture.median_thread_cpu()
    print(f"  {arm:12s} step {1e3 * per_step:7.2f} ms median, "
          f"{1e3 * good.step_seconds / (args.steps - 1):7.2f} ms mean  "
          f"(fit wall {good.wall_seconds:5.1f} s, "
          f"process cpu {cpu:5.1f} s, flush {flushing:4.1f} s; training thread "
          f"{1e6 * thread:6.0f} us CPU/step; trackers {1e6 * sinks_cpu / args.steps:5.0f} us "
          f"CPU/step)", flush=True)
    return per_step, cpu, thread


def per_call(root: Path, mlflow_uri: str, calls: int = 200) -> None:
    """What one log() costs in each sink: the caller's wall time, and the process CPU
    time including the sink's background work (counted until it has all been sent),
    beside a sink that does nothing."""
    scalars = {"loss": 0.5, "abs": 0.25, "throughput/steps_per_second": 10.0,
               "throughput/records_per_second": 2560.0}
    class Nothing(Capture):
        """The floor: a sink that only copies the values (waking after a pause costs
        the caller something on its own)."""

        def log(self, scalars, step):
            dict(scalars)

        def flush(self):
            pass

    for sink in [Nothing(), *sinks(root, 99, mlflow_uri)]:
        sink.log(scalars, 0)  # open it
        cpu, caller = time.process_time(), 0.0
        for step in range(1, calls + 1):
            began = time.perf_counter()
            sink.log(scalars, step)
            caller += time.perf_counter() - began
            time.sleep(0.005)  # paced like a loop, so a batching sink can batch
        sink.flush()
        cpu = time.process_time() - cpu
        sink.close()
        print(f"  {type(sink).__name__:20s} caller {1e6 * caller / calls:8.1f} us, "
              f"process CPU {1e6 * cpu / calls:8.1f} us per log() call")


def compare(args, root: Path, index: int) -> tuple[tuple[float, float, float], int]:
    """Run every arm args.repeats times; print each arm's figures; return the ratios of
    all four trackers to none: best to best, median to median, median of the pairs."""
    arms = ARMS if args.arms == "each" else ("none", "all")
    if args.control:
        arms = (*arms, "again")  # none once more: the spread between two fits of one arm
    opened = {arm: sinks(root, index, args.mlflow_uri, arm) for arm in arms}
    for sink in (sink for group in opened.values() for sink in group):
        sink.log({"warmup": 0.0}, 0)  # run creation is a one-off cost, not timed
    for sink in (sink for group in opened.values() for sink in group):
        sink.flush()  # and done before the first fit, whose tracker CPU it was counted in
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    cpus: dict[str, list[float]] = {arm: [] for arm in arms}
    threads: dict[str, list[float]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        # none-all, all-none, ...: drift lands on each arm as often as on the other.
        for arm in arms if repeat % 2 == 0 else arms[::-1]:
            step, cpu, thread = fit(args, arm, opened[arm], 1 + repeat * args.steps)
            times[arm].append(step)
            cpus[arm].append(cpu)
            threads[arm].append(thread)
    for sink in (sink for group in opened.values() for sink in group):
        sink.close()
    # The fastest of the repeats: other load on the machine only ever adds time.
    base = min(times["none"])
    for arm in arms:
        best, middle = min(times[arm]), statistics.median(times[arm])
        paired = statistics.median(a / b for a, b in zip(times[arm], times["none"], strict=True))
        print(f"{arm:12s} best {1e3 * best:7.2f} ms/step, median {1e3 * middle:7.2f} "
              f"(of {args.repeats}); best vs none {best / base:.3f}; median of paired "
              f"ratios {paired:.3f}"
              f"; process CPU best vs none {min(cpus[arm]) / min(cpus['none']):.3f}; training "
              f"thread CPU/step median {1e6 * statistics.median(threads[arm]):.0f} us (spread "
              f"{1e6 * min(threads[arm]):.0f}-{1e6 * max(threads[arm]):.0f})")
    pairs = [a / b for a, b in zip(times["all"], times["none"], strict=True)]
    print("all / none by alternation: " + ", ".join(f"{r:.3f}" for r in pairs))
    if args.control:
        same = [a / b for a, b in zip(times["again"], times["none"], strict=True)]
        print("again / none by alternation (no trackers in either: the machine's own spread): "
              + ", ".join(f"{r:.3f}" for r in same))
        print(f"the machine's own spread: median {statistics.median(same):.3f}, worst "
              f"{max(same):.3f}, best {min(same):.3f} (a worst alternation of all / none "
              f"inside this is not the trackers')")
    ratios = (min(times["all"]) / base,
              statistics.median(times["all"]) / statistics.median(times["none"]),
              statistics.median(pairs), max(pairs))
    return ratios, index + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("key-concepts", "mlp"), default="key-concepts",
                        help="the key-concepts language model (~11 ms steps), or an MLP calibrated "
                             "to each --step-ms")
    parser.add_argument("--step-ms", type=amount, nargs="+", default=[10.0, 100.0],
                        help="with --model mlp: target step times; the width is calibrated to each")
    parser.add_argument("--seconds", type=amount, default=2.5,
                        help="timed seconds per fit (sets the steps for each step time)")
    parser.add_argument("--repeats", type=positive, default=6, help="alternations (at least 3)")
    parser.add_argument("--batch", type=positive, default=256, help="with --model mlp: rows per batch")
    parser.add_argument("--mlflow-uri", default=None)
    parser.add_argument("--no-control", dest="control", action="store_false",
                        help="leave out the second no-tracker arm that measures the machine's spread")
    parser.add_argument("--arms", choices=("all", "each"), default="all",
                        help="'each' also times every tracker on its own")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats {args.repeats}: the worst alternation needs at least 3")
    here = os.getcwd()
    root = Path(tempfile.mkdtemp(prefix="dew-trackers-bench-"))
    try:
        run(args, root)
    finally:
        os.chdir(here)
        shutil.rmtree(root, ignore_errors=True)  # the runs' files: the figures are what it printed


def run(args: argparse.Namespace, root: Path) -> None:
    """Every comparison args asks for, the sinks writing under root."""
    os.environ.setdefault("WANDB_DIR", str(root))
    os.environ.setdefault("WANDB_SILENT", "true")
    args.mlflow_uri = args.mlflow_uri or f"sqlite:///{root / 'mlflow.db'}"
    os.chdir(root)  # a SQLite store keeps its artifacts in ./mlruns
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs), "
          f"log_every=1, mlflow {args.mlflow_uri}")
    ratios, index = {}, 0
    if args.model == "key-concepts":
        args.objective, args.data = key_concepts()
        args.steps = max(20, int(args.seconds * 1e3 / 11))
        print(f"-- the key-concepts model, {args.steps} steps per fit", flush=True)
        ratios["key-concepts model"], index = compare(args, root, index)
    for target in args.step_ms if args.model == "mlp" else ():
        args.width = calibrate(target, args.batch)
        args.objective = lambda: Regression(args.width)
        args.data = dataset(args.batch)
        args.steps = max(20, int(args.seconds * 1e3 / target))
        print(f"-- step of ~{target:g} ms: width {args.width}, {args.steps} steps", flush=True)
        ratios[f"~{target:g} ms steps"], index = compare(args, root, index)
    for name, (best, middle, paired, worst) in ratios.items():
        print(f"ratio at {name}, all four trackers vs none ({args.repeats} alternations): "
              f"median of alternations {paired:.3f} (goal <= 1.02), worst {worst:.3f} (goal <= "
              f"1.05); best vs best {best:.3f}, median vs median {middle:.3f}")
    print("per-call cost (host time of log(), 4 scalars):")
    per_call(root, args.mlflow_uri)


if __name__ == "__main__":
    main()
