"""``dew export RUN OUT``: a kept step as a Pretrained directory transformers loads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.cli.runs import add_run_argument

    add_run_argument(parser)
    parser.add_argument("out", metavar="OUT", type=Path, help="the directory to write")
    parser.add_argument("--step", type=int, default=None, help="a kept step (default newest)")


def run(args: argparse.Namespace) -> int:
    from dew.cli.runs import NoCheckpointError, NotARunError, open_run
    from dew.pretrained import Pretrained, PretrainedError

    try:
        opened = open_run(args.run, step=args.step)
        written = Pretrained(opened.model, opened.variables, opened.tokenizer).save(args.out)
    except (NoCheckpointError, NotARunError, PretrainedError) as error:
        print(f"dew export: {error}", file=sys.stderr)
        return 2
    step = "" if opened.step is None else f" (step {opened.step})"
    print(f"Exported {opened.source}{step} to {written}")
    return 0
