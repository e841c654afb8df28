"""``dew recipes``: the recipes dew ships, each with its one-line description."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "describe", "run"]


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--paths", action="store_true", help="print each recipe's file as well")


def run(args: argparse.Namespace) -> int:
    from dew.recipes.config import shipped

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
