"""Public surfaces that cost nothing to import, and what to install when a name is absent.

A package lists its public names once, as ordinary imports inside an
``if TYPE_CHECKING:`` block of its ``__init__.py``: type checkers and editors
read those, and ``surface()`` reads the same block (with ``ast``) to resolve
each name on first use. Nothing else maps names to modules.

When a name's module cannot be imported, ``install_hint`` says what to pip
install, from the installed distributions' own metadata: the extra whose
requirements provide the missing module (``dew-trackers[mlflow]``). Only a
package whose names come from a distribution that may be absent altogether
says which one, next to its list (``surface(..., elsewhere="dew-data")``).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from dew.errors import DewError

__all__ = ["MissingDistributionError", "import_or_explain", "install_hint", "surface"]


class MissingDistributionError(DewError, ImportError):
    """A dew name lives in a distribution, or needs an extra, that is not installed."""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _extras_providing(distribution: str, missing: str) -> list[str]:
    """The extras of an installed distribution whose requirements are named like missing's top level."""
    import importlib_metadata
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requires = importlib_metadata.distribution(distribution).requires or []
    except importlib_metadata.PackageNotFoundError:
        return []
    top = _normalize(missing.partition(".")[0])
    extras: list[str] = []
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if _normalize(requirement.name) != top or requirement.marker is None:
            continue
        for extra in re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", str(requirement.marker)):
            if extra not in extras:
                extras.append(extra)
    return extras


def install_hint(distribution: str, missing: str, extras: list[str] | tuple[str, ...] = ()) -> str:
    """What to pip install when `distribution`'s code misses the module `missing`.

    The extras are the distribution's own: those whose requirements name the
    missing module, else those an entry point declares.
    """
    if missing == "dew" or missing.startswith("dew."):
        return f"It ships with {distribution}: pip install {distribution}"
    chosen = _extras_providing(distribution, missing) or list(extras)
    if chosen:
        requirement = f"{distribution}[{chosen[0]}]"
        return f"It needs the {chosen[0]!r} extra: pip install '{requirement}'"
    return (f"{distribution} needs the package that provides {missing!r}; reinstall it with its "
            f"dependencies: pip install {distribution}")


def import_or_explain(module: str, distribution: str, extras: tuple[str, ...] = ()) -> ModuleType:
    """Import module; a missing module raises MissingDistributionError saying what to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = error.name or module
        raise MissingDistributionError(
            f"{module} cannot be imported (module {missing!r} is missing). "
            f"{install_hint(distribution, missing, extras)}",
            name=missing,
        ) from error


def _listed(init_file: str) -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute or None for a module) from the TYPE_CHECKING block of init_file."""
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"))
    names: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            continue
        for statement in node.body:
            if isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
                for alias in statement.names:
                    names[alias.asname or alias.name] = (statement.module, alias.name)
            elif isinstance(statement, ast.Import):
                for alias in statement.names:
                    if alias.asname is None:
                        raise ValueError(f"{init_file}: write 'import {alias.name} as NAME' in the surface")
                    names[alias.asname] = (alias.name, None)
    return names


def surface(package: str, init_file: str, *, elsewhere: str | None = None,
            eager: tuple[str, ...] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The (__getattr__, __dir__, __all__) of a package whose names init_file lists under TYPE_CHECKING.

    elsewhere names the distribution that ships the listed modules dew-core
    does not (for a package two distributions fill); eager are names the
    package defines or imports itself.
    """
    listed = _listed(init_file)

    def __getattr__(name: str) -> Any:
        home = listed.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name, attribute = home
        if module_name == package:  # "from dew import models as models": a subpackage
            module_name, attribute = f"{package}.{attribute}", None
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            missing = error.name or module_name
            extras: tuple[str, ...]
            if missing == "dew" or missing.startswith("dew."):
                distribution, extras = elsewhere or "dew-core", ()
            else:
                distribution, extras = _registered(module_name) or (elsewhere or "dew-core", ())
            raise MissingDistributionError(
                f"{package}.{name} lives in {module_name}, which cannot be imported "
                f"(module {missing!r} is missing). {install_hint(distribution, missing, extras)}",
                name=missing,
            ) from error
        value = module if attribute is None else getattr(module, attribute)
        vars(sys.modules[package])[name] = value  # resolved once
        return value

    names = sorted({*listed, *eager})

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__, names


def _registered(module: str) -> tuple[str, tuple[str, ...]] | None:
    """(distribution, extras) of the first dew entry point that points into module, if any."""
    import importlib_metadata

    for entry_point in importlib_metadata.entry_points():
        if entry_point.group.startswith("dew.") and entry_point.module == module and entry_point.dist:
            return entry_point.dist.name, tuple(entry_point.extras)
    return None
