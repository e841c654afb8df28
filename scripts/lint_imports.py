"""Check the import-linter contracts of pyproject.toml across dew's four distributions.

import-linter finds a root package's files through ``importlib.util.find_spec``,
whose search locations list only dew-core's ``dew/`` directory: the other
distributions join the package through ``pkgutil.extend_path`` when ``dew`` is
imported. This script imports ``dew``, points its spec at every portion, and
runs the contracts from pyproject.toml. A forbidden module that no distribution
ships yet (a contract written ahead of its code) cannot be imported by anyone,
so it is dropped from the check with a note rather than failing the run.

One contract is added to those of pyproject.toml, generated from the source
tree so that it never falls behind: no module of dew-core imports any module
that dew-objectives, dew-trackers or dew-data ships.
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


def _ini(settings: dict) -> str:
    """The [tool.importlinter] table as import-linter's INI configuration."""
    parser = configparser.ConfigParser()
    head = {k: v for k, v in settings.items() if k != "contracts"}
    parser["importlinter"] = {k: _value(v) for k, v in head.items()}
    for index, contract in enumerate(settings.get("contracts", [])):
        contract = dict(contract)
        for key in ("source_modules", "forbidden_modules"):
            if key in contract:
                kept = [m for m in contract[key] if _exists(m)]
                for missing in sorted(set(contract[key]) - set(kept)):
                    print(f"note: {contract['name']!r}: {missing} does not exist yet; "
                          f"nothing can import it", file=sys.stderr)
                contract[key] = kept
        if not contract.get("source_modules") or not contract.get("forbidden_modules", [None]):
            print(f"note: {contract['name']!r} has nothing to check yet", file=sys.stderr)
            continue
        parser[f"importlinter:contract:{index}"] = {k: _value(v) for k, v in contract.items()}
    with tempfile.NamedTemporaryFile("w", suffix=".ini", delete=False) as file:
        parser.write(file)
    return file.name


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


def core_contract() -> dict:
    """dew-core's modules import no module of the other three distributions, read from the tree."""
    others = [m for d in ("dew-objectives", "dew-trackers", "dew-data")
              for m in _modules(ROOT / d / "src")]
    return {
        "name": "dew-core imports no module of another distribution (every module, from src/)",
        "type": "forbidden",
        "source_modules": _modules(ROOT / "dew-core" / "src"),
        "forbidden_modules": others,
        "as_packages": "False",
    }


def main() -> int:
    import dew

    # Every portion of the shared package, not only dew-core's.
    dew.__spec__.submodule_search_locations[:] = list(dew.__path__)
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    settings["contracts"] = [*settings.get("contracts", []), core_contract()]
    config = _ini(settings)

    from importlinter.cli import lint_imports

    return lint_imports(config_filename=config, no_cache=True)


if __name__ == "__main__":
    sys.exit(main())
