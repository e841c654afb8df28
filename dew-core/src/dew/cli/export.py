"""``dew export RUN OUT``: a kept step's model, in the format its architecture is published in.

What is written is the run's pipeline's model: a language model (and the
policy of a preference or RL run, without its reference or value head) as
Hugging Face's Llama when it is one exactly, in dew's own layout otherwise
(``--format dew`` asks for it, ``--format hf`` refuses a model with no exact
counterpart); a diffusion model, a token denoiser or a JEPA encoder in dew's
own layout (no published format computes the same function), which
``Pretrained.load`` reads back with the task it serves. A LoRA run's
adapters are merged into its base weights, so OUT is a plain model;
``--adapters`` writes them alone instead, in PEFT's layout, for the base the
run started from.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

LAYOUTS = {"llama": "Hugging Face's Llama layout", "dew": "dew's own layout"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.cli.runs import add_run_argument

    add_run_argument(parser)
    parser.add_argument("out", metavar="OUT", type=Path, help="the directory to write")
    parser.add_argument("--step", type=int, default=None, help="a kept step (default newest)")
    parser.add_argument("--format", choices=("hf", "dew"), default=None,
                        help="hf: Hugging Face's layout (refused without an exact counterpart); "
                             "dew: dew's own; default: the model's own format")
    parser.add_argument("--adapters", action="store_true",
                        help="a LoRA run: write its adapters alone (PEFT's adapter_model.safetensors and "
                             "adapter_config.json) instead of the merged model")


def run(args: argparse.Namespace) -> int:
    from dew.cli.runs import expected, open_run, refused

    try:
        opened = open_run(args.run, step=args.step)
        lora = getattr(opened.config, "lora", None)
        if args.adapters and lora is None:
            return refused("export", f"{opened.source} has no lora section, so no adapters to "
                                     "write; drop --adapters to export the model.")
        written, what = _write(opened, lora, args.out, adapters=args.adapters, format=args.format)
    except Exception as error:
        if not expected(error):
            raise
        return refused("export", error)
    step = "" if opened.step is None else f" (step {opened.step})"
    print(f"Exported {what} of {opened.source}{step} to {written}")
    return 0


def _write(opened: Any, lora: Any, out: Path, *, adapters: bool, format: str | None
           ) -> tuple[Path, str]:
    """Write the pipeline's model (adapters merged), or its adapters alone; return where and what."""
    from dew.pretrained import Pretrained

    pretrained = opened.pipeline().pretrained()
    layout = LAYOUTS[{"hf": "llama", "dew": "dew"}.get(format or "", pretrained.format)]
    if lora is None:
        return pretrained.save(out, format=format), f"the model ({layout})"
    from dew.adapters.lora import base_model, merge_lora

    base = base_model(pretrained.model)
    if adapters:
        from dew.pretrained.peft import save_adapters

        init = getattr(opened.config, "init", None)
        name = str(getattr(init, "pretrained", None) or getattr(init, "run", None) or "")
        return save_adapters(out, base, pretrained.variables, lora, base_name=name), "the adapters"
    merged = Pretrained(base, merge_lora(pretrained.variables, lora), pretrained.tokenizer,
                        pretrained.task)
    layout = LAYOUTS[{"hf": "llama", "dew": "dew"}.get(format or "", merged.format)]
    return merged.save(out, format=format), f"the model, adapters merged ({layout}),"
