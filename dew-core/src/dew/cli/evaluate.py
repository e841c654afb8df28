"""``dew eval RUN``: the validation metrics of a kept step, as the objective defines them.

The objective's own metrics score the run's held-out split: loss, accuracy
and perplexity for a language model, the reward of greedy answers for an RL
policy, the preference margin for DPO, the denoising loss per noise band for
diffusion, the collapse figures for JEPA (every Mean its evaluate returns
when it names no metrics). The live parameters score as ``val/...``, as the
run itself logged them; when the run kept an EMA copy, it scores as well,
under ``val_ema/...``.

``--task NAME`` scores an evaluation task instead (``eval/NAME/...``), on a
run's kept step or on an exported model: NAME is an entry of the run's
``trainer.evaluate`` (its label or task), whose fields it takes, or any
task registered in ``dew.evaluations``; ``--set key=value`` gives or
overrides the task's fields (``--set file=arc.jsonl``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dew.data.base import Dataset
    from dew.recipes.opening import Opened

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.cli.runs import add_run_argument, positive

    add_run_argument(parser)
    parser.add_argument("--split", choices=("val", "train"), default=None,
                        help="the held-out records (val) or training batches (one pass, or "
                             "--batches of an endless stream; one when not given)")
    parser.add_argument("--step", type=int, default=None, help="a kept step (default newest)")
    parser.add_argument("--batches", type=positive, default=None,
                        help="evaluate at most this many batches")
    parser.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    parser.add_argument("--task", default=None, metavar="NAME",
                        help="score an evaluation task (an entry of the run's trainer.evaluate by its "
                             "label, or by its task when no --set file= is given; else a registered task) "
                             "instead of the validation split")
    parser.add_argument("--set", dest="fields", action="append", default=[], metavar="KEY=VALUE",
                        help="a field of the task (repeatable), read as YAML: --set file=arc.jsonl")


def run(args: argparse.Namespace) -> int:
    from dew.cli.runs import expected, refused
    from dew.recipes.opening import open_run

    if args.task is not None and (args.split is not None or args.batches is not None):
        print("dew eval: --split and --batches choose what the objective's own metrics score; a "
              "--task scores its own file instead, so leave them out.", file=sys.stderr)
        return 2
    if args.task is None and args.fields:
        print("dew eval: --set gives a field of an evaluation task; name the task with --task NAME "
              "(an entry of the run's trainer.evaluate, or a registered task).", file=sys.stderr)
        return 2
    args.split = args.split or "val"
    try:
        opened = open_run(args.run, step=args.step)
        if args.task is not None:
            return _run_task(args, opened)
        return _evaluate(args, opened)
    except Exception as error:
        if not expected(error):
            raise
        return refused("eval", error)


def _evaluate(args: argparse.Namespace, opened: Opened) -> int:
    from dew.recipes.resuming import started_in

    with started_in(opened.source):  # a run's data paths start where it trained (an export: here)
        return _scored(args, opened)


def _scored(args: argparse.Namespace, opened: Opened) -> int:
    if opened.config is None:
        print(f"dew eval: {opened.source} is an exported model; evaluation reads the data of a "
              "run, so point it at the run directory (it holds run.json).", file=sys.stderr)
        return 2
    objective, live = opened.objective, opened.live
    assert objective is not None and live is not None  # a run directory's: its recipe's, read from its steps
    import itertools

    import jax

    from dew.recipes.run import build_parts
    from dew.training.evaluation import Evaluator, OutputMeans

    dataset = build_parts(opened.config).dataset
    assert dataset is not None  # build_parts loads the data unless asked not to
    other = _other_data(opened, dataset)
    if other is not None:
        print(f"dew eval: {other}", file=sys.stderr, flush=True)
    if args.split == "val":
        if dataset.val is None:
            print(f"dew eval: the run's data has no validation split; {_val_hint(opened.config.data.name)}"
                  "pass --split train (training batches), or --task NAME (an evaluation task).",
                  file=sys.stderr)
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
    kept = [(args.split, live)]
    if opened.variables is not live:
        kept.append((f"{args.split}_ema", opened.variables))
    # An objective without metrics() is scored by the means its evaluate() returns.
    metrics = tuple(objective.metrics()) or (OutputMeans(),)
    evaluator = Evaluator(objective)  # one compiled scorer for both passes
    for split, variables in kept:
        # The EMA copy reaches the scorer as the trainer hands it (JEPA's targets read it).
        result = evaluator(variables, reader, key=jax.random.key(opened.config.seed),
                           metrics=metrics, step=opened.step or 0, split=split,
                           averaged=opened.averaged)
        values.update(result.scalars)
    if args.json:
        _print_json({"step": opened.step, "split": args.split, **values})
    else:
        print(f"{opened.source} step {opened.step} ({args.split}):")
        for name, value in values.items():
            print(f"  {name}: {value:.6g}" if isinstance(value, float) else f"  {name}: {value}")
    return 0


def _print_json(values: dict[str, Any]) -> None:
    """values as one JSON line, a non-finite score spelt as the journal spells it ("+Inf": JSON has no Infinity)."""
    from dew.telemetry.records import json_value

    print(json.dumps(json_value(values)))


def _task_config(args: argparse.Namespace, opened: Opened) -> Any:
    """The task to score: the run's trainer.evaluate entry named args.task, else the registered
    task of that name, with the --set fields over its own."""
    from dew.evaluations.config import EvaluateConfig
    from dew.recipes.config import apply_overrides
    from dew.recipes.errors import RecipeError

    for field in args.fields:
        if "=" not in str(field) or not str(field).split("=", 1)[0].strip():
            raise RecipeError(f"--set {field!r} is not KEY=VALUE: write a field of the task, for example "
                              f"--set file=arc.jsonl.")
    entries = [] if opened.config is None else list(opened.config.trainer.evaluate)
    chosen = next((e for e in entries if e.name == args.task), None)
    if chosen is None and not any(str(field).split("=", 1)[0].strip() == "file" for field in args.fields):
        # the run's own task of that name, on its own file; with another file, the task as registered
        # (not the run's entry, whose template and keys were written for the run's file)
        chosen = next((e for e in entries if e.task == args.task), None)
    data = {"task": args.task} if chosen is None else _as_trained(chosen.model_dump(), opened.source)
    data = apply_overrides(data, args.fields)
    return EvaluateConfig.model_validate(data)


def _other_data(opened: Opened, dataset: Dataset) -> str | None:
    """A note when the data the run's recipe names holds other contents now than its step's position
    was saved over (a run copied elsewhere, its files edited): the scores are then of other data."""
    from dew.checkpoints.restore import read_manifest
    from dew.data.base import SINGLE, Resumable, close_if_closable
    from dew.training.ledger import decoded_position

    def content(position: bytes | None) -> object:
        return (decoded_position(position) or {}).get("content")

    step = opened.source / str(opened.step)
    with contextlib.suppress(Exception):  # a step without a saved position, a reader without a digest: no note
        saved = next((c for c in map(content, read_manifest(step, int(opened.step or 0)).data.decoded().values())
                      if c is not None), None)
        stream = dataset.train(SINGLE)
        try:
            now = content(stream.get_state()) if isinstance(stream, Resumable) else None
        finally:
            close_if_closable(stream)
        if saved is not None and now is not None and saved != now:
            return (f"the data the run's recipe names holds other contents than step {opened.step} was trained "
                    "on (its saved data position keeps another digest): a file edited since, or the run's "
                    "relative paths read from another folder. The scores below are of the data found now.")
    return None


def _val_hint(name: str) -> str:
    """How the run's dataset would hold data out, when its load takes a val_fraction."""
    from dew import registry

    with contextlib.suppress(Exception):  # a reader without a declared load offers no hint
        if "val_fraction" in registry.declared_fields(registry.datasets.load(name).load):
            return "set data.load.val_fraction in its recipe, or "
    return f"dataset {name!r} holds none out, so "


def _as_trained(entry: dict[str, Any], run: str | os.PathLike[str]) -> dict[str, Any]:
    """A run's trainer.evaluate entry with the relative paths of the fields its task reads as files
    made absolute from where the run trained, as they were when it scored them; its other fields (a
    stop text of ".") stay as written, and a --set field as typed, from here."""
    from dew import registry
    from dew.evaluations.base import file_fields
    from dew.recipes.resuming import started_from

    start = started_from(run)
    try:
        paths = file_fields(registry.evaluations.load(entry["task"]))
    except Exception:  # noqa: BLE001 - a task not installed here is named when it is built
        paths = ("file",)
    out = dict(entry)
    for key in paths:
        value = entry.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value) and (start / value).exists():
            out[key] = str(start / value)
    return out


def _trained_with(opened: Opened) -> Any:
    """The objective the weights were trained with: the run's, or, for an export recording its task
    (a reward model's), that objective's class; None for an export that records none."""
    from dew import registry

    if opened.objective is not None or opened.pretrained is None or opened.pretrained.task is None:
        return opened.objective
    try:
        return registry.objectives.load(opened.pretrained.task["name"])
    except Exception:  # noqa: BLE001 - an objective not installed here: the export is scored as a model
        return None


def _run_task(args: argparse.Namespace, opened: Opened) -> int:
    from functools import partial

    from dew import registry
    from dew.evaluations.base import TaskFileError, scheduled
    from dew.objectives.inference import served_variables
    from dew.recipes.config import RecipeError
    from dew.recipes.run import expand

    try:
        config = _task_config(args, opened)
        if config.task not in registry.evaluations:
            raise RecipeError(f"no evaluation task named {config.task!r} in the run's trainer.evaluate "
                              f"or in dew.evaluations; the registered tasks are "
                              f"{', '.join(registry.evaluations.names()) or 'none'}.")
        task = scheduled(config, opened.model, opened.tokenizer, expand=lambda f: expand(f, ""),
                         served=partial(served_variables, opened.objective), objective=_trained_with(opened))
        kept = [("eval", opened.live if opened.live is not None else opened.variables)]
        if opened.live is not None and opened.variables is not opened.live:
            kept.append(("eval_ema", opened.variables))
        values: dict[str, float] = {}
        for prefix, variables in kept:
            values.update(task(variables, step=opened.step or 0, prefix=prefix).scores)
    except (TaskFileError, RecipeError, registry.RegistryError, ValueError, KeyError, TypeError) as error:
        print(f"dew eval: {error}", file=sys.stderr)
        return 2
    if args.json:
        _print_json({"step": opened.step, "task": config.name, **values})
    else:
        where = "an exported model" if opened.step is None else f"step {opened.step}"
        print(f"{opened.source} {where} (task {config.name}):")
        for name, value in values.items():
            print(f"  {name}: {value:.6g}")
    return 0
