"""Check the import-linter contracts of pyproject.toml across dew's four distributions.

import-linter finds a root package's files through ``importlib.util.find_spec``,
whose search locations list only dew-core's ``dew/`` directory: the other
distributions join the package through ``pkgutil.extend_path`` when ``dew`` is
imported. This script imports ``dew``, points its spec at every portion, and
runs the contracts from pyproject.toml. A contract that names a module no
distribution ships fails the run: a contract about a module that does not
exist would pass without checking anything.

The placement wing's contract (it imports nothing of the engine above it) and the
contracts between the distributions are generated from the source tree, so
they never fall behind it: no module of dew-core imports a module of the other
three, dew-data and dew-trackers import nothing of each other or of
dew-objectives, and dew-objectives imports nothing of dew-trackers.
"""

from __future__ import annotations

import configparser
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _exists(module: str) -> bool:
    import importlib.util

    if "*" in module:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent is missing, or a distribution that ships it
        return False


class MissingModuleError(ValueError):
    """A contract names a module that no installed distribution ships."""


def _ini(settings: dict) -> str:
    """The [tool.importlinter] table as import-linter's INI configuration."""
    parser = configparser.ConfigParser()
    head = {k: v for k, v in settings.items() if k != "contracts"}
    parser["importlinter"] = {k: _value(v) for k, v in head.items()}
    for index, contract in enumerate(settings.get("contracts", [])):
        for key in ("source_modules", "forbidden_modules"):
            missing = [m for m in contract.get(key, []) if not _exists(m) and not _external(m)]
            if missing:
                raise MissingModuleError(
                    f"contract {contract['name']!r} names {', '.join(missing)} in {key}, which no "
                    f"installed distribution ships: it would check nothing. Install the "
                    f"distribution, or fix the contract in pyproject.toml."
                )
        parser[f"importlinter:contract:{index}"] = {k: _value(v) for k, v in contract.items()}
    with tempfile.NamedTemporaryFile("w", suffix=".ini", delete=False) as file:
        parser.write(file)
    return file.name


def _external(module: str) -> bool:
    """A third-party package (not under dew) that a contract forbids: present or not, it is a name."""
    return module.partition(".")[0] != "dew"


def _value(value: object) -> str:
    if isinstance(value, list):
        return "\n" + "\n".join(str(v) for v in value)
    return str(value)


def _modules(source: Path) -> list[str]:
    """Every module (and package) whose file lies under a distribution's src/ directory."""
    names = []
    for file in sorted(source.rglob("*.py")):
        parts = file.relative_to(source).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


DISTRIBUTIONS = ("dew-core", "dew-objectives", "dew-trackers", "dew-data")


def distribution_contract(source: str, forbidden: tuple[str, ...]) -> dict:
    """No module of the source distribution imports a module of the forbidden ones, read from src/."""
    others = [m for d in forbidden for m in _modules(ROOT / d / "src")]
    return {
        "name": f"{source} imports no module of {', '.join(forbidden)} (every module, from src/)",
        "type": "forbidden",
        "source_modules": _modules(ROOT / source / "src"),
        "forbidden_modules": others,
        "as_packages": "False",
    }


def core_contract() -> dict:
    """dew-core's modules import no module of the other three distributions."""
    return distribution_contract("dew-core", DISTRIBUTIONS[1:])


def placement_contract() -> dict:
    """training/placement (mesh, layout, stages, offload) imports nothing else of dew.training:
    the engine sits above it, and its types appear there in annotations only."""
    training = ROOT / "dew-core" / "src"
    placement = [m for m in _modules(training) if m.startswith("dew.training.placement")]
    engine = [m for m in _modules(training)
              if m.startswith("dew.training.") and not m.startswith("dew.training.placement")]
    return {
        "name": "dew.training.placement imports nothing of the engine above it (from src/)",
        "type": "forbidden",
        "source_modules": placement,
        "forbidden_modules": engine,
        "as_packages": "False",
    }


def generated_contracts() -> list[dict]:
    """The contracts between distributions (what each may not import of the others), and the
    placement wing's floor inside dew.training."""
    return [
        placement_contract(),
        core_contract(),
        distribution_contract("dew-data", ("dew-objectives", "dew-trackers")),
        distribution_contract("dew-trackers", ("dew-objectives", "dew-data")),
        distribution_contract("dew-objectives", ("dew-trackers",)),
    ]


def main() -> int:
    import dew

    # Every portion of the shared package, not only dew-core's.
    dew.__spec__.submodule_search_locations[:] = list(dew.__path__)
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    settings["contracts"] = [*settings.get("contracts", []), *generated_contracts()]
    try:
        config = _ini(settings)
    except MissingModuleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    from importlinter.cli import lint_imports

    return lint_imports(config_filename=config, no_cache=True)


if __name__ == "__main__":
    sys.exit(main())
