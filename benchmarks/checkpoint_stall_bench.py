"""How long each checkpoint stops a recipe's training loop, against its step time, in one run.

    .venv/bin/python benchmarks/checkpoint_stall_bench.py [--recipe tiny-lm] [--steps 300]
        [--every 100] [--repeats 1]

checkpoint_bench.py saves a synthetic state after a warm-up save; this one
runs a shipped recipe (tiny-lm by default: its model, data, optimizer and
log_every) through Trainer.fit, with checkpoints every --every steps and
without any, alternated --repeats times. Printed for every save:

  * blocked: the time Checkpoints.save held the loop (the first save
    included, which pays for anything set up lazily);
  * in flight: the time the trainer waited, just before, for the steps it had
    already dispatched to finish (the loop runs ahead of the device by up to
    log_every steps; that time is the steps', which the device spends with or
    without a checkpoint);
  * the blocked time in steps (blocked / median step time).

Then the extra wall time per save of the fit with checkpoints over the fit
without (its median over repeats), against the same step time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from dew.checkpoints.manager import Checkpoints
from dew.cli.runs import positive
from dew.recipes.config import RunConfig
from dew.recipes.run import build_parts, objective_parts, run_optimizer
from dew.training.trainer import Trainer


class TimedCheckpoints(Checkpoints):
    """Checkpoints that note how long each save() call took, and how long the state took
    to be ready (the trainer waits for it first, so that part is normally zero)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saves: list[tuple[int, float, float]] = []  # (step, waited for the state, blocked)

    def save(self, step: int, state: Any, **kwargs: Any) -> None:
        began = time.perf_counter()
        jax.block_until_ready(state)
        ready = time.perf_counter()
        super().save(step, state, **kwargs)
        self.saves.append((int(step), ready - began, time.perf_counter() - ready))


class Capture:
    """A tracker that keeps the Goodput record and when each log-step's metrics arrived."""

    def __init__(self) -> None:
        self.goodput: Any = None
        self.notes: list[str] = []

    def log(self, scalars: Any, step: int) -> None:
        pass

    def artifact(self, value: Any, step: int) -> None:
        if getattr(value, "type", None) == "goodput":
            self.goodput = value

    def close(self) -> None:
        pass


def fit(config: RunConfig, directory: Path | None) -> tuple[Any, TimedCheckpoints | None, str, float]:
    """One fit of the recipe: its Goodput record, its checkpoints, its console text, wall seconds."""
    parts = build_parts(config)
    steps = config.trainer.fit_arguments(parts.dataset.steps_per_epoch)
    checkpoints = None if directory is None else TimedCheckpoints(directory, keep=2)
    capture = Capture()
    trainer = Trainer.from_config(config.trainer, parts.objective, run_optimizer(config, steps["steps"]),
                                  key=jax.random.key(config.seed), checkpoints=checkpoints, tracker=capture,
                                  **objective_parts(parts.objective))
    if directory is None:
        steps["checkpoint_every"] = None
    console = io.StringIO()
    began = time.perf_counter()
    with contextlib.redirect_stdout(console):
        trainer.fit(parts.dataset, **steps)
    wall = time.perf_counter() - began
    if checkpoints is not None:
        checkpoints.close()
    return capture.goodput, checkpoints, console.getvalue(), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny-lm")
    parser.add_argument("--steps", type=positive, default=300)
    parser.add_argument("--every", type=positive, default=100, help="checkpoint_every")
    parser.add_argument("--repeats", type=positive, default=1)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dew-checkpoint-stall-"))
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the runs' checkpoints: the figures are what it printed


def run(args: argparse.Namespace, root: Path) -> None:
    """Both arms args.repeats times, the checkpoints written under root."""
    overrides = [f"trainer.steps={args.steps}", f"trainer.checkpoint_every={args.every}"]
    config = RunConfig.load(args.recipe, overrides=overrides)
    print(f"recipe {args.recipe}: {args.steps} steps, log_every {config.trainer.log_every}, a checkpoint "
          f"every {args.every} steps and at the end; jax {jax.__version__} on {jax.devices()[0].platform}")
    blocked, in_flight, per_step, extra = [], [], [], []
    for repeat in range(args.repeats):
        arms = ("none", "checkpoints") if repeat % 2 == 0 else ("checkpoints", "none")
        walls = {}
        for arm in arms:
            directory = None if arm == "none" else root / f"run-{repeat}"
            goodput, checkpoints, console, walls[arm] = fit(config, directory)
            step = goodput.step_seconds / max(1, args.steps - 1)
            per_step.append(step)
            if checkpoints is None:
                print(f"  fit without checkpoints: wall {walls[arm]:6.2f} s, step {1e3 * step:6.1f} ms")
                continue
            waits = [float(line.split("after ")[1].split(" s")[0]) for line in console.splitlines()
                     if "finishing the steps in flight" in line]
            for (number, _, held), waited in zip(checkpoints.saves, waits, strict=False):
                blocked.append(held)
                in_flight.append(waited)
                print(f"  save at step {number:5d}: blocked {1e3 * held:7.1f} ms "
                      f"({held / step:5.2f} steps of {1e3 * step:.1f} ms); in flight before it "
                      f"{1e3 * waited:7.1f} ms")
            print(f"  fit with checkpoints:    wall {walls[arm]:6.2f} s, step {1e3 * step:6.1f} ms, "
                  f"{len(checkpoints.saves)} saves")
            saves = len(checkpoints.saves)
        extra.append((walls["checkpoints"] - walls["none"]) / saves)
    med = statistics.median
    step = med(per_step)
    print(f"blocked per save: median {1e3 * med(blocked):.1f} ms, first {1e3 * blocked[0]:.1f} ms, "
          f"max {1e3 * max(blocked):.1f} ms = {med(blocked) / step:.2f} steps (median) of {1e3 * step:.1f} ms")
    print(f"in flight before a save (the steps' own time): median {1e3 * med(in_flight):.1f} ms")
    print(f"extra wall time per save, fit with checkpoints over without: median {1e3 * med(extra):.1f} ms "
          f"= {med(extra) / step:.2f} steps (includes compile-time noise between fits)")


if __name__ == "__main__":
    main()
