"""``dew eval RUN``: the validation metrics of a kept step, as the objective defines them.

The objective's own metrics score the run's held-out split: loss, accuracy
and perplexity for a language model, the reward of greedy answers for an RL
policy, the preference margin for DPO, the denoising loss per noise band for
diffusion, the collapse figures for JEPA (every Mean its evaluate returns
when it names no metrics). The live parameters score as ``val/...``, as the
run itself logged them; when the run kept an EMA copy, it scores as well,
under ``val_ema/...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.cli.runs import add_run_argument

    add_run_argument(parser)
    parser.add_argument("--split", choices=("val", "train"), default="val",
                        help="the held-out records (val) or one pass of training batches")
    parser.add_argument("--step", type=int, default=None, help="a kept step (default newest)")
    parser.add_argument("--batches", type=int, default=None,
                        help="evaluate at most this many batches")
    parser.add_argument("--json", action="store_true", help="print the metrics as one JSON object")


def run(args: argparse.Namespace) -> int:
    from dew.cli.runs import expected, open_run, refused

    try:
        return _evaluate(args, open_run(args.run, step=args.step))
    except Exception as error:
        if not expected(error):
            raise
        return refused("eval", error)


def _evaluate(args: argparse.Namespace, opened: Any) -> int:
    if opened.config is None:
        print(f"dew eval: {opened.source} is an exported model; evaluation reads the data of a "
              "run, so point it at the run directory (it holds run.json).", file=sys.stderr)
        return 2
    import itertools

    import jax

    from dew.recipes.run import build_parts
    from dew.training.evaluation import Evaluator, OutputMeans

    dataset = build_parts(opened.config).dataset
    if args.split == "val":
        if dataset.val is None:
            print("dew eval: the run's data has no validation split; set data.load.val_fraction "
                  "in its recipe, or pass --split train.", file=sys.stderr)
            return 2
        reader = dataset.val
    else:
        steps = dataset.steps_per_epoch or args.batches or 1

        def reader(partition):
            return itertools.islice(dataset.train(partition), steps)
    if args.batches is not None:
        whole, limit = reader, args.batches

        def reader(partition):
            return itertools.islice(whole(partition), limit)
    values: dict[str, float] = {}
    kept = [(args.split, opened.live)]
    if opened.variables is not opened.live:
        kept.append((f"{args.split}_ema", opened.variables))
    metrics = tuple(opened.objective.metrics()) or (OutputMeans(),)
    evaluator = Evaluator(opened.objective)  # one compiled scorer for both passes
    for split, variables in kept:
        # The EMA copy reaches the scorer as the trainer hands it (JEPA's targets read it).
        result = evaluator(variables, reader, key=jax.random.key(opened.config.seed),
                           metrics=metrics, step=opened.step or 0, split=split,
                           averaged=opened.averaged)
        values.update(result.scalars)
    if args.json:
        print(json.dumps({"step": opened.step, "split": args.split, **values}))
    else:
        print(f"{opened.source} step {opened.step} ({args.split}):")
        for name, value in values.items():
            print(f"  {name}: {value:.6g}" if isinstance(value, float) else f"  {name}: {value}")
    return 0
