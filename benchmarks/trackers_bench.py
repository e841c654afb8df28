"""Step time with every tracker logging every step, against no tracker, in one run.

    .venv/bin/python benchmarks/trackers_bench.py [--steps 60] [--repeats 2] [--width 1024]

Both arms run the same fit (log_every=1, so the loop fetches and logs metrics
at every step in both); the tracker arm fans out to LocalTracker,
TensorBoardTracker, MLflowTracker (SQLite store, or --mlflow-uri) and an
offline WandbTracker. The step time is the Goodput record's step_seconds per
step after the first (compile excluded). Arms alternate to spread drift
between them. Prints each arm's median and the ratio (target <= 1.02).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
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
from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective
from dew.training.trackers import LocalTracker, Trackers


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


def dataset(rows: int) -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 64)).astype(np.float32)
    batch = {"x": x, "y": x[:, :1] * 2.0}

    def stream(partition):
        while True:
            yield batch

    return Dataset(train=stream, val=None, records=None, batch=rows)


class Capture:
    """A sink that keeps only the Goodput record (both arms carry it)."""

    def __init__(self) -> None:
        self.goodput = None

    def log(self, scalars, step):
        pass

    def artifact(self, value, step):
        if getattr(value, "type", None) == "goodput":
            self.goodput = value

    def close(self):
        pass


def sinks(root: Path, index: int, mlflow_uri: str) -> list:
    from dew.trackers.mlflow import MLflowTracker
    from dew.trackers.tensorboard import TensorBoardTracker
    from dew.trackers.wandb import WandbTracker

    return [
        LocalTracker(root / f"local-{index}"),
        TensorBoardTracker(root / f"tb-{index}"),
        MLflowTracker("dew-bench", f"arm-{index}", uri=mlflow_uri),
        WandbTracker("dew-bench", f"arm-{index}", offline=True),
    ]


def fit(args, tracked: bool, root: Path, index: int) -> float:
    capture = Capture()
    others = sinks(root, index, args.mlflow_uri) if tracked else []
    if others:  # open each sink before timing (run creation is a one-off cost)
        for sink in others:
            sink.log({"warmup": 0.0}, 0)
    tracker = Trackers(capture, *others)
    trainer = dew.Trainer(Regression(args.width), optax.adam(1e-3), key=jax.random.key(0),
                          tracker=tracker)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(dataset(args.batch), steps=args.steps, log_every=1)
    began = time.perf_counter()
    for sink in others:
        sink.close()
    closing = time.perf_counter() - began
    good = capture.goodput
    per_step = good.step_seconds / (args.steps - 1)
    label = "trackers" if tracked else "none    "
    print(f"  {label} step {1e3 * per_step:7.2f} ms  (fit wall {good.wall_seconds:5.1f} s, "
          f"close {closing:4.1f} s)", flush=True)
    return per_step


def per_call(root: Path, mlflow_uri: str, calls: int = 200) -> None:
    """The host time one log() call costs in each sink (what a step pays per log)."""
    scalars = {"loss": 0.5, "abs": 0.25, "throughput/steps_per_second": 10.0,
               "throughput/records_per_second": 2560.0}
    for sink in sinks(root, 99, mlflow_uri):
        sink.log(scalars, 0)  # open it
        began = time.perf_counter()
        for step in range(1, calls + 1):
            sink.log(scalars, step)
        cost = (time.perf_counter() - began) / calls
        sink.close()
        print(f"  {type(sink).__name__:20s} {1e6 * cost:8.1f} us per log() call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--mlflow-uri", default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dew-trackers-bench-"))
    os.environ.setdefault("WANDB_DIR", str(root))
    os.environ.setdefault("WANDB_SILENT", "true")
    args.mlflow_uri = args.mlflow_uri or f"sqlite:///{root / 'mlflow.db'}"
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, width {args.width}, "
          f"batch {args.batch}, {args.steps} steps, log_every=1, mlflow {args.mlflow_uri}")
    times: dict[bool, list[float]] = {False: [], True: []}
    index = 0
    for _ in range(args.repeats):
        for tracked in (False, True):
            times[tracked].append(fit(args, tracked, root, index))
            index += 1
    base, tracked = statistics.median(times[False]), statistics.median(times[True])
    print(f"no tracker:    {1e3 * base:.2f} ms/step (median of {args.repeats})")
    print(f"all trackers:  {1e3 * tracked:.2f} ms/step (median of {args.repeats})")
    print(f"ratio: {tracked / base:.3f} (target <= 1.02)")
    print("per-call cost (host time of log(), 4 scalars):")
    per_call(root, args.mlflow_uri)


if __name__ == "__main__":
    main()
