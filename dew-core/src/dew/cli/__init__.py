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
    "report": ("dew.cli.report", "render a local run's journal into plots and an HTML page"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dew", description="dew trains JAX models.")
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
