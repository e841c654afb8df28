"""Asynchronous GRPO against synchronous, on the shipped addition recipes: wall time per step, reward.

The addition-lm recipe trains the starting policy once (``--lm-steps``);
then addition-grpo runs from it with ``objective.max_lag=0`` (each step's
completions sampled from the policy it trains, when it asks: synchronous)
and ``objective.max_lag=1`` (step n+1's completions sampled from the policy
of step n while step n trains: asynchronous), alternating, ``--repeats``
times each. Every run logs every step; the wall time per step is each
logged step's ``train/step_time``, the first ``--warmup`` steps (compiles)
and the last (its checkpoint) left out. It prints min and median per mode
and the ratio async / sync of both (the issue's goal: <= 0.7), and the
reward curve of each mode (mean ``train/reward`` over windows of steps, and
the last half's mean with its spread across repeats and steps), to read the
two curves as the same within noise.

The overlap needs somewhere to run: the sampler and the step compete for
the same cores on a CPU-only machine, so there the ratio shows what
overlapping host-side work (the engine's scheduling, decoding, the reward)
with the step's computation buys on that machine, no more. It also prints
the share of a synchronous step spent making its batch (the Feed's
``next``, timed around it): overlapping the batch with the rest of the step
can save at most the shorter of the two, so the larger of share and
1 - share bounds the async / sync ratio from below on any machine where
the batch takes as long as here.

    .venv/bin/python benchmarks/async_rollout_bench.py [--steps 40] [--repeats 2] [--lm-steps 150]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from dew.cli.runs import positive

FED: list[float] = []  # seconds of each Feed.next of the run under way


def _timed_feed() -> None:
    """Time every Feed.next (the batch's making, or the wait for it when made ahead)."""
    import time

    from dew.training.feed import Feed

    plain = Feed.next

    def timed(self, state, step):
        began = time.perf_counter()
        try:
            return plain(self, state, step)
        finally:
            FED.append(time.perf_counter() - began)

    Feed.next = timed  # type: ignore[method-assign]


def _train(arguments: list[str]) -> None:
    from dew.cli import main

    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        code = main(["train", *arguments])
    if code != 0:
        raise SystemExit(f"dew train {' '.join(arguments)} exited with {code}:\n{quiet.getvalue()[-3000:]}")


def _rows(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "scalars.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=40, help="GRPO steps per run")
    parser.add_argument("--repeats", type=positive, default=2, help="runs of each mode, alternating")
    parser.add_argument("--lm-steps", type=positive, default=150, help="steps of the starting language model")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
    parser.add_argument("--window", type=positive, default=10, help="steps per point of the reward curve")
    parser.add_argument("--directory", type=Path, default=None, help="keep the runs here (default: a temporary one)")
    args = parser.parse_args()
    if args.warmup < 0 or args.warmup >= args.steps - 1:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}: give it from 0 to "
                     f"{max(0, args.steps - 2)}")

    with tempfile.TemporaryDirectory() as scratch:
        root = (args.directory or Path(scratch)).absolute()
        root.mkdir(parents=True, exist_ok=True)
        os.chdir(root)  # the recipes' run folders are relative
        if not (root / "runs" / "addition-lm" / "run.json").exists():
            _train(["addition-lm", f"trainer.steps={args.lm_steps}", f"trainer.checkpoint_every={args.lm_steps}",
                    "trainer.eval_every=null"])
        _timed_feed()
        times: dict[int, list[float]] = {0: [], 1: []}
        fed: dict[int, list[float]] = {0: [], 1: []}
        rewards: dict[int, list[list[float]]] = {0: [], 1: []}
        for repeat in range(args.repeats):
            for lag in (0, 1):
                run = root / "runs" / f"grpo-lag{lag}-{repeat}"
                shutil.rmtree(run, ignore_errors=True)  # a run left there would resume, not train
                FED.clear()
                _train(["addition-grpo", f"objective.max_lag={lag}", f"seed={repeat}", f"trainer.steps={args.steps}",
                        "trainer.log_every=1", "trainer.eval_every=null", f"trainer.checkpoint_every={args.steps}",
                        f"trainer.checkpoint_dir={run}", f"trackers.0.directory={run}"])
                rows = [r for r in _rows(run) if "train/reward" in r]
                steps = {int(r["step"]): r for r in rows}
                times[lag] += [steps[s]["train/step_time"] for s in sorted(steps)
                               if args.warmup < s < args.steps and "train/step_time" in steps[s]]
                rewards[lag].append([steps[s]["train/reward"] for s in sorted(steps)])
                fed[lag] += FED[args.warmup:-1]
                print(f"run {repeat} max_lag={lag}: median {statistics.median(times[lag]):.4f} s/step so far",
                      flush=True)

    print(f"\nwall time per step, steps {args.warmup + 1}..{args.steps - 1} of {args.steps}, "
          f"{args.repeats} run(s) each:")
    print(f"{'mode':<22}{'min s':>10}{'median s':>10}")
    for lag, name in ((0, "sync (max_lag=0)"), (1, "async (max_lag=1)")):
        print(f"{name:<22}{min(times[lag]):>10.4f}{statistics.median(times[lag]):>10.4f}")
    print(f"{'async / sync':<22}{min(times[1]) / min(times[0]):>10.3f}"
          f"{statistics.median(times[1]) / statistics.median(times[0]):>10.3f}   (goal <= 0.7)")
    share = statistics.median(fed[0]) / statistics.median(times[0])
    print(f"making the batch: median {statistics.median(fed[0]):.4f} s of a synchronous step "
          f"({share:.0%}); asynchronous, the step waits a median {statistics.median(fed[1]):.4f} s for it. "
          f"Overlap can bring async / sync down to about {max(share, 1 - share):.2f} at best here.")

    print(f"\nmean train/reward per {args.window} steps (each mode averaged over its runs):")
    for lag in (0, 1):
        curve = [statistics.mean(values) for values in zip(*rewards[lag], strict=True)]
        points = [statistics.mean(curve[i:i + args.window]) for i in range(0, len(curve), args.window)]
        print(f"  max_lag={lag}: " + " ".join(f"{p:.3f}" for p in points))
    half = args.steps // 2
    for lag in (0, 1):
        late = [v for run in rewards[lag] for v in run[half:]]
        runs = [statistics.mean(run[half:]) for run in rewards[lag]]
        spread = statistics.stdev(runs) if len(runs) > 1 else float("nan")
        print(f"  max_lag={lag}: steps {half + 1}..{args.steps}: mean {statistics.mean(late):.3f}, "
              f"per-step sd {statistics.stdev(late):.3f}, across runs sd {spread:.3f}")


if __name__ == "__main__":
    main()
