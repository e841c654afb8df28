"""``dew recipes``: the recipes dew ships, each with its one-line description."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "describe", "markdown", "run"]

# Model fields that say what a network is, in the order the table shows them.
_SHAPE = (("num_layers", "{} layer{}"), ("emb_features", "{} wide"), ("image_size", "{0}x{0} pixels"),
          ("position_embedding", "{} positions"), ("mlp_activation", "{}"))


def describe() -> dict[str, str]:
    """Each shipped recipe's name and description, read without validating it."""
    from dew.recipes.config import shipped
    from dew.recipes.reading import RecipeFileError, read_recipe_file

    out = {}
    for name, path in shipped().items():
        try:
            data = read_recipe_file(path) or {}
        except RecipeFileError:
            data = {}
        text = data.get("description") if isinstance(data, dict) else None
        out[name] = " ".join(str(text).split()) if text else ""
    return out


def _model(data: dict[str, Any]) -> str:
    from dew import registry

    model = data.get("model") or {}
    if not model:
        return "its own network"
    try:  # what the recipe leaves out is the model's default, shown as well
        declared = registry.declared_fields(registry.models.load(model["name"]))
        fields = {k: d for k, (_, d) in declared.items() if d is not ...} | model
    except Exception:  # noqa: BLE001 - a model not installed here: what the recipe says
        fields = model
    shape = [text.format(fields[key], "" if fields[key] == 1 else "s") for key, text in _SHAPE
             if key in fields and fields[key] is not None]
    return f"`{model.get('name')}`" + (f" ({', '.join(shape)})" if shape else "")


def _data(data: dict[str, Any]) -> str:
    section = data.get("data") or {}
    source = section.get("files") or section.get("form")
    return f"`{section.get('name')}`" + (f" `{source}`" if source else "") + f", batch {section.get('batch')}"


def _first(data: dict[str, Any]) -> str:
    """What must exist before the recipe runs: the runs and exports it reads."""
    needs = []
    init = data.get("init") or {}
    objective = data.get("objective") or {}
    reward = objective.get("reward")
    for what, where in (("run", init.get("run")), ("export", init.get("pretrained")),
                        ("teacher run", objective.get("teacher_checkpoint")),
                        ("teacher export", objective.get("teacher_pretrained")),
                        ("reward model run", reward.get("run") if isinstance(reward, dict) else None)):
        if where:
            needs.append(f"{what} `{where}`")
    return ", ".join(needs) or "nothing"


def markdown() -> str:
    """The shipped recipes as a Markdown table, read from their files: what each trains, on
    what, for how long, where its run folder is and what it needs first. docs/cli.md shows it
    (a test keeps the two the same)."""
    from dew.recipes.config import shipped
    from dew.recipes.reading import read_recipe_file

    lines = ["| recipe | model | objective | data | steps | run folder | needs first |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, path in shipped().items():
        data = read_recipe_file(path) or {}
        objective = (data.get("objective") or {}).get("name")
        if data.get("lora"):
            objective = f"{objective} + LoRA rank {data['lora'].get('rank')}"
        trainer = data.get("trainer") or {}
        steps = trainer.get("steps") or f"{trainer.get('epochs')} epochs"
        folder = trainer.get("checkpoint_dir")
        lines.append(f"| [{name}](#{name}) | {_model(data)} | `{objective}` | {_data(data)} | {steps} "
                     f"| {f'`{folder}`' if folder else 'none'} | {_first(data)} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--paths", action="store_true", help="print each recipe's file as well")
    parser.add_argument("--markdown", action="store_true",
                        help="print the recipes as a Markdown table (model, objective, data, steps, "
                             "run folder, what each needs first), as docs/cli.md shows them")


def run(args: argparse.Namespace) -> int:
    from dew.recipes.config import shipped

    if args.markdown:
        print(markdown())
        return 0
    recipes = describe()
    if not recipes:
        print("No recipes are installed.")
        return 0
    paths = shipped()
    width = max(len(name) for name in recipes) + 2
    for name, text in recipes.items():
        print(f"{name:<{width}}{text}")
        if args.paths:
            print(f"{'':<{width}}{paths[name]}")
    print("\nRun one with `dew train NAME [key=value ...]`; `dew train --help` lists the fields.")
    return 0
