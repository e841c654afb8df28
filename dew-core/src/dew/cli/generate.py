"""``dew generate RUN PROMPT...``: continue prompts with a trained or exported model."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.cli.runs import add_run_argument

    add_run_argument(parser)
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to continue (several: one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 picks the likeliest token")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
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

    from dew.cli.runs import require

    require(opened.objective, "pipeline", "generate", "what its trained weights are for")
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    try:
        pipeline = opened.objective.pipeline(opened.variables, sampling=sampling)
        texts = pipeline(list(args.prompts), max_new_tokens=args.max_new_tokens,
                         key=jax.random.key(args.seed))
    except ValueError as error:  # a prompt too long for the model, a sampling setting out of range
        print(f"dew generate: {error}", file=sys.stderr)
        return 2
    for prompt, text in zip(args.prompts, texts, strict=True):
        print(prompt + text)
    return 0
