"""``dew generate RUN PROMPT...``: continue prompts with a trained or exported model."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.cli.runs import add_run_argument

    add_run_argument(parser)
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to continue (several: one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 picks the likeliest token")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    parser.add_argument("--min-p", type=float, default=None,
                        help="drop tokens less likely than this share of the likeliest")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end a continuation after this text (repeatable)")
    parser.add_argument("--step", type=int, default=None, help="a kept step of the run (default newest)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random draws")


def run(args: argparse.Namespace) -> int:
    from dew.cli.runs import NoCheckpointError, NotARunError, open_run

    try:
        opened = open_run(args.run, step=args.step)
    except (NoCheckpointError, NotARunError) as error:
        print(f"dew generate: {error}", file=sys.stderr)
        return 2
    import jax

    from dew.objectives.base import NoPipelineError

    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                "min_p": args.min_p}
    # A text pipeline takes its sampling as a keyword; which keywords are the objective's own.
    make: Callable[..., Any] = opened.objective.pipeline
    try:
        pipeline = make(opened.variables, sampling=sampling)
        options = {"stop": args.stop} if args.stop else {}
        texts = pipeline(list(args.prompts), max_new_tokens=args.max_new_tokens,
                         key=jax.random.key(args.seed), **options)
    except (ValueError, NoPipelineError) as error:  # a prompt too long, a setting out of range
        print(f"dew generate: {error}", file=sys.stderr)
        return 2
    for prompt, text in zip(args.prompts, texts, strict=True):
        print(prompt + text)
    return 0
