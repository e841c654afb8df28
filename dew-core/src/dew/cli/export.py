"""``dew export RUN OUT``: a kept step as a Pretrained directory transformers loads.

A LoRA run's adapters are merged into its base weights, so OUT is a plain
Llama; ``--adapters`` writes them alone instead, in PEFT's layout, for the
base the run started from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.cli.runs import add_run_argument

    add_run_argument(parser)
    parser.add_argument("out", metavar="OUT", type=Path, help="the directory to write")
    parser.add_argument("--step", type=int, default=None, help="a kept step (default newest)")
    parser.add_argument("--adapters", action="store_true",
                        help="a LoRA run: write its adapters alone (PEFT's adapter_model.safetensors and "
                             "adapter_config.json) instead of the merged model")


def run(args: argparse.Namespace) -> int:
    from dew.adapters.lora import LoraError
    from dew.cli.runs import NoCheckpointError, NotARunError, open_run
    from dew.pretrained import PretrainedError

    try:
        opened = open_run(args.run, step=args.step)
        lora = None if opened.config is None else opened.config.lora
        if args.adapters and lora is None:
            print(f"dew export: {opened.source} has no lora section, so no adapters to write; "
                  "drop --adapters to export the model.", file=sys.stderr)
            return 2
        written, what = _write(opened, lora, args.out, adapters=args.adapters)
    except (NoCheckpointError, NotARunError, PretrainedError, LoraError) as error:
        print(f"dew export: {error}", file=sys.stderr)
        return 2
    step = "" if opened.step is None else f" (step {opened.step})"
    print(f"Exported {what} of {opened.source}{step} to {written}")
    return 0


def _write(opened: Any, lora: Any, out: Path, *, adapters: bool) -> tuple[Path, str]:
    """Write opened's model (adapters merged), or its adapters alone; return where and what."""
    from dew.pretrained import Pretrained

    if lora is None:
        return Pretrained(opened.model, opened.variables, opened.tokenizer).save(out), "the model"
    from dew.adapters.lora import base_model, merge_lora

    base = base_model(opened.model)
    if adapters:
        from dew.pretrained.peft import save_adapters

        init = None if opened.config is None else opened.config.init
        name = "" if init is None else str(init.pretrained or init.run or "")
        return save_adapters(out, base, opened.variables, lora, base_name=name), "the adapters"
    merged = merge_lora(opened.variables, lora)
    return Pretrained(base, merged, opened.tokenizer).save(out), "the model, adapters merged,"
