"""The ``dew`` command. Each subcommand lives in its own module, imported only
when that subcommand runs, so ``dew --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# subcommand -> (module, one-line help). A module defines
# add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "train": ("dew.cli.train", "train from a recipe file, with key=value overrides"),
    "recipes": ("dew.cli.recipes", "list the recipes dew ships"),
    "report": ("dew.cli.report", "render local runs' journals into one page of charts"),
    "describe": ("dew.cli.describe", "a registered component's fields, types and defaults"),
    "generate": ("dew.cli.generate", "samples from a trained run or an exported model: texts, images, clips"),
    "eval": ("dew.cli.evaluate", "a kept step's validation metrics, as its objective defines them"),
    "export": ("dew.cli.export", "write a kept step's model in its published format (or dew's own)"),
    "embed": ("dew.cli.embed", "vectors for images from a representation run's encoder"),
    "launch": ("dew.cli.launch", "train a recipe as a process pool: local, under srun, or on Kubernetes"),
}


def version() -> str:
    """The dew distributions installed, with their versions (installed metadata only).

    >>> version().startswith("dew-core ")
    True
    """
    from importlib import metadata

    found = []
    for name in ("dew-core", "dew-objectives", "dew-trackers", "dew-data"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or "dew (no installed distribution found)"


class _Version(argparse.Action):
    """--version, computed only when asked (reading metadata is not free)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the installed dew versions")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version())
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dew", description="dew trains JAX models.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, text) in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            command.set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args._run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
