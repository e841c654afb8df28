"""``dew export RUN OUT``: a kept step's model, in the format its architecture is published in.

What is written is the run's pipeline's model: a language model (and the
policy of a preference or RL run, without its reference or value head) in
its family's Hugging Face layout (Llama, Qwen 3, Gemma 2, ...) when the
family expresses it exactly, in dew's own layout otherwise (``--format dew``
asks for it, ``--format hf`` refuses a model with no exact counterpart); a
reward model on such a decoder as the family's one-label
``...ForSequenceClassification`` (``dew.families.scoring``); a
diffusion model, a token denoiser or a JEPA encoder in dew's own layout (no
published format computes the same function), which ``Pretrained.load``
reads back with the task it serves. A LoRA run's adapters are merged into
its base weights, so OUT is a plain model; ``--adapters`` writes them alone
instead, in PEFT's layout, for the base the run started from. ``--verify``
then loads OUT in transformers on the CPU (adapters: PEFT puts them onto
their base), compares its logits with dew's on fixed prompts, records the
result in OUT/verification.json and fails above ``--tolerance``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dew.adapters.lora import Lora
    from dew.objectives.base import Variables
    from dew.pretrained.model import Pretrained as PretrainedModel
    from dew.pretrained.tokenizers import TokenizerFiles as SavedTokenizerFiles
    from dew.recipes.opening import Opened

__all__ = ["add_arguments", "run"]

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
    parser.add_argument("--force", action="store_true",
                        help="write into an OUT that holds files dew did not write: the export's own "
                             "files are replaced, the others kept (a symbolic link is never followed)")
    parser.add_argument("--verify", action="store_true",
                        help="load the export in transformers on the CPU (adapters: with PEFT, onto their "
                             "base) and compare its logits with dew's on fixed prompts; write "
                             "OUT/verification.json; fail above --tolerance")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="the largest absolute logit difference --verify accepts (default 1e-3)")


def run(args: argparse.Namespace) -> int:
    from dew.cli.runs import expected, refuse_run_folder, refused
    from dew.pretrained.writing import check_out
    from dew.recipes.opening import open_run

    if args.tolerance is not None and not args.verify:
        return refused("export", "--tolerance is the largest logit difference --verify accepts; add --verify, "
                                 "or drop --tolerance.")
    if args.tolerance is not None and not args.tolerance >= 0:
        return refused("export", f"--tolerance {args.tolerance} is no largest difference: give a number of at "
                                 "least 0 (default 1e-3).")
    if args.adapters and args.format == "dew":
        return refused("export", "--adapters writes PEFT's adapter files, which have no dew layout; drop "
                                 "--format dew for the adapters, or drop --adapters to write the model in "
                                 "dew's layout.")
    out = Path(args.out).absolute()
    try:
        refuse_run_folder(out, "OUT", "the export")  # --force or not: a run's files are no export's to mix with
        foreign = check_out(out, force=args.force)  # refused before the run is read
        # An earlier export is what dew wrote there; others' files (kept under --force) are none.
        replaced = out.is_dir() and any(entry.name not in foreign for entry in out.iterdir())
        opened = open_run(args.run, step=args.step)
        lora = None if opened.config is None else opened.config.lora
        if args.adapters and lora is None:
            return refused("export", f"{opened.source} has no lora section, so no adapters to "
                                     "write; drop --adapters to export the model.")
        if args.adapters and _native(opened):
            return refused("export", f"--adapters writes PEFT's adapter files, which transformers' language models "
                                     f"read, and {type(opened.model).__name__} is written in dew's own layout; drop "
                                     "--adapters to export it with its adapters merged.")
        if args.verify and args.format == "dew":
            return refused("export", "--verify checks a model in its Hugging Face layout; drop --format dew to "
                                     "verify the export.")
        if args.verify and args.adapters and lora is not None and lora.base != "float32":
            return refused("export", f"--verify --adapters compares PEFT's model with the run's, and this run trained "
                                     f"its adapters on {_quantized_copy(lora)} of the base, while PEFT puts them onto the "
                                     "float base: they compute other logits by design. Verify the merged export "
                                     "(drop --adapters).")
        if args.verify and args.format is None and _native(opened):
            return refused("export", f"--verify compares the export with what transformers computes from it, "
                                     f"and {type(opened.model).__name__} is written in dew's own layout, which "
                                     "transformers does not read; drop --verify (dew generate or dew embed on the export "
                                     "reads it back).")
        written, what = _write(opened, lora, args.out, adapters=args.adapters, format=args.format,
                               force=args.force)
    except Exception as error:
        if not expected(error):
            raise
        return refused("export", error)
    step = "" if opened.step is None else f" (step {opened.step})"
    print(f"Exported {what} of {opened.source}{step} to {written}")
    if replaced:
        print(f"(it replaced the export {written} held before)")
    if args.verify:
        return _verify(opened, lora, written, args.tolerance, adapters=args.adapters)
    return 0


def _native(opened: Opened) -> bool:
    """Whether the run's model is written in dew's own layout (no Hugging Face class reads it)."""
    from dew.adapters.lora import base_model
    from dew.errors import DewError
    from dew.pretrained import Pretrained
    from dew.pretrained.native import FORMAT

    try:  # its task decides whether a reward model's score fits the layout
        pretrained = opened.pipeline().pretrained()
    except DewError:  # an export recording no task: its model alone
        pretrained = Pretrained(opened.model, _served(opened))
    return dataclasses.replace(pretrained, model=base_model(pretrained.model)).format == FORMAT


def _served(opened: Opened) -> Variables:
    """The variables the run's model applies (a distillation's student without its teacher, a policy
    without its value head): what the export holds."""
    from dew.objectives.inference import served_variables

    return served_variables(opened.objective, opened.variables)


def _verify(opened: Opened, lora: Lora | None, written: Path, tolerance: float | None, *, adapters: bool) -> int:
    """Certify the export against dew's own logits; 1 when they differ past tolerance. Adapters are
    put onto their base by PEFT (the base their adapter_config.json names) and compared so."""
    from dew.pretrained import PretrainedError
    from dew.pretrained.verify import (
        DEFAULT_TOLERANCE,
        ExportMismatchError,
        UnrunnableExportError,
        verify,
        verify_adapters,
    )

    model, variables = opened.model, _served(opened)
    if lora is not None:
        from dew.adapters.lora import base_model, merge_lora

        model, variables = base_model(opened.model), merge_lora(variables, lora)
    limit = DEFAULT_TOLERANCE if tolerance is None else tolerance
    try:
        if adapters:
            result = verify_adapters(written, model, variables, tokenizer=opened.tokenizer, tolerance=limit)
        else:
            result = verify(written, model, variables, tokenizer=opened.tokenizer, tolerance=limit)
    except (ExportMismatchError, UnrunnableExportError) as error:  # written, not certified
        print(f"dew export --verify: {error}", file=sys.stderr)
        return 1
    except PretrainedError as error:
        print(f"dew export --verify: {error}", file=sys.stderr)
        return 2
    compared = "scores" if "ForSequenceClassification" in result.architecture else "logits"
    print(f"Verified: transformers' {result.architecture} matches dew's {compared} within "
          f"{result.max_abs_difference:.2g} (tolerance {result.tolerance:g}) on "
          f"{len(result.prompt_lengths)} prompts; recorded in {written / 'verification.json'}")
    return 0


def _write(opened: Opened, lora: Lora | None, out: Path, *, adapters: bool, format: str | None,
           force: bool = False) -> tuple[Path, str]:
    """Write the pipeline's model (adapters merged), or its adapters alone; return where and what."""

    pretrained = dataclasses.replace(opened.pipeline().pretrained(), **_source_settings(opened))
    pretrained = _with_task(pretrained, opened)
    if lora is None:
        return pretrained.save(out, format=format, force=force), f"the model ({_layout(pretrained, format)})"
    from dew.adapters.lora import base_model, merge_lora

    base = base_model(pretrained.model)
    if adapters:
        from dew.pretrained.peft import save_adapters

        init = opened.config.init if opened.config is not None else None
        # PEFT reads a base from a transformers directory (init.pretrained), never from a dew run.
        name = "" if init is None or init.pretrained is None else init.pretrained
        if name and not Path(name).expanduser().is_absolute():  # from where the run started, not from here
            from dew.recipes.resuming import started_from

            name = str(started_from(opened.source) / Path(name).expanduser())
        what = "the adapters"
        if init is not None and init.run is not None:
            what += (f" (their base is the run {init.run}, which PEFT cannot read: export it with "
                     f"`dew export {init.run} DIR` and load these adapters onto DIR)")
        elif init is None and opened.config is not None:
            what += (" (their base is this run's own fresh initialization, which no directory holds: "
                     "PEFT has nothing to load them onto; the merged export is the run's model)")
        if lora.base != "float32":
            what += (f" (trained on {_quantized_copy(lora)} of the base: PEFT puts them onto the float base, which "
                     "computes other logits than the run; the merged export is the run's model)")
        from dew.families import scoring

        scored = scoring.scored(base, pretrained.variables, pretrained.task)
        if scored:
            what += (" (with the reward model's score, for PEFT's sequence-classification model of the base: "
                     "AutoModelForSequenceClassification with num_labels=1)")
        return save_adapters(out, base, pretrained.variables, lora, base_name=name, force=force,
                             scored=scored), what
    merged = dataclasses.replace(pretrained, model=base, variables=merge_lora(pretrained.variables, lora))
    into = "" if lora.base == "float32" else (
        f" into {_quantized_copy(lora)} of the base, read back as floats: the run's own function, not the "
        "original base's weights plus the update,")
    return merged.save(out, format=format, force=force), f"the model, adapters merged{into} ({_layout(merged, format)}),"


def _quantized_copy(lora: Lora) -> str:
    """'an nf4 copy', 'an int8 copy': the base a QLoRA run trained its adapters on."""
    return f"{'an' if lora.base.startswith(('int', 'nf')) else 'a'} {lora.base} copy"


def _layout(pretrained: PretrainedModel, format: str | None) -> str:
    """The layout save writes for format, in words."""
    from dew.families import family, scoring

    chosen = pretrained.format if format in (None, "hf") else format
    if chosen == "dew":
        return "dew's own layout"
    if scoring.scored(pretrained.model, pretrained.variables, pretrained.task):
        return f"Hugging Face's {scoring.architecture(family(chosen).architecture)} layout, a reward model"
    return f"Hugging Face's {chosen} layout"


def _with_task(pretrained: PretrainedModel, opened: Opened) -> PretrainedModel:
    """pretrained, with the run's objective as its task where its pipeline (a plugin's) named none: the
    export is then read back by dew generate. A language model needs none (it continues text)."""
    from dew.adapters.lora import base_model
    from dew.nn.backbones import CausalTransformer

    if (pretrained.task is not None or isinstance(base_model(pretrained.model), CausalTransformer)
            or opened.config is None or not dataclasses.is_dataclass(opened.objective)):
        return pretrained
    from dew.pretrained.native import objective_task

    return dataclasses.replace(pretrained, task=objective_task(opened.objective))


def _source_settings(opened: Opened) -> dict[str, Any]:
    """What the Hugging Face directory the weights came from says beyond them, as Pretrained's fields:
    its tokenizer settings (chat template, special tokens), context length and training settings. The
    directory is the exported one itself, or the run's init.pretrained, followed back through the runs
    an init.run names (each None: neither)."""
    from dew.families import for_config
    from dew.pretrained import CONFIG_FILE, PretrainedError, TokenizerFiles
    from dew.pretrained.native import FORMAT

    if opened.config is None:
        source: Path | None = Path(opened.source)
    else:
        from dew.recipes.resuming import pretrained_origin

        init = opened.config.init
        source = None if init is None else pretrained_origin(opened.source, init.model_dump())
    if source is None or not (source / CONFIG_FILE).is_file():
        return {"tokenizer_files": None, "context": None, "training": None}
    import json

    from dew.families.hf_config import training_settings

    config = json.loads((source / CONFIG_FILE).read_text())
    context, own = None, config.get("dew") or {}
    training = own.get("training") if isinstance(own, dict) else None
    if config.get("format") != FORMAT:  # dew's own layout keeps them in its "dew" key
        training = training_settings(config)
        with contextlib.suppress(PretrainedError):  # a family dew does not read keeps none
            context = for_config(config).context(config)
    files = TokenizerFiles.read(source, config)
    if opened.config is not None and not _same_tokenizer(opened.tokenizer, source, config, files):
        print(f"dew export: the run's tokenizer is not the one of {source}, which its weights started from: "
              "that folder's chat template, special tokens and generation settings are left out, so the "
              "export does not mix two tokenizers.", file=sys.stderr, flush=True)
        files = None
    return {"tokenizer_files": files, "context": context, "training": training or None}


def _same_tokenizer(tokenizer: object, source: Path, config: dict[str, Any], files: SavedTokenizerFiles | None) -> bool:
    """Whether tokenizer spells text as the ids the tokenizer source holds does, read as dew reads a
    folder's (dew's byte tokenizer where its config records one); a folder without one has nothing
    to mix, and one that cannot be read is another."""
    from dew.data.hf_tokenizer import vocabulary
    from dew.errors import DewError
    from dew.pretrained.tokenizers import read_tokenizer

    try:
        theirs = read_tokenizer(source, (config.get("dew") or {}).get("tokenizer"), config.get("eos_token_id"), files)
    except DewError:
        return False
    return theirs is None or vocabulary(tokenizer) == vocabulary(theirs)
