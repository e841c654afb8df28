"""Which dew modules and shipped recipes a dew-core test reaches that dew-core does not ship.

dew is one Python package (``dew``) filled by four distributions. A module belongs to the
distribution whose ``src`` folder (``[tool.setuptools.packages.find] where`` in its
pyproject) holds its file; a name a surface lists (``from dew.data import TokenWindows``)
belongs to the module the surface's ``TYPE_CHECKING`` block imports it from; a shipped
recipe belongs elsewhere when its objective or data is registered by another
distribution's entry points. ``tests/test_core_tests_stand_alone.py`` uses these maps; run as a
script, this module runs pytest as if dew-core alone were installed (see ``main``).
"""

from __future__ import annotations

import ast
import functools
import textwrap
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CORE = "dew-core"
RECIPE_SECTIONS = {"objective": "dew.objectives", "data": "dew.datasets"}
SECTIONS = ("objective", "data", "trackers")


@functools.cache
def distributions() -> dict[str, Path]:
    """Each distribution's name and the folder its pyproject declares its packages under."""
    found: dict[str, Path] = {}
    for pyproject in sorted(ROOT.glob("dew-*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        where = project["tool"]["setuptools"]["packages"]["find"]["where"]
        for folder in where:
            found[project["project"]["name"]] = pyproject.parent / folder
    return found


@functools.cache
def module_owners() -> dict[str, str]:
    """Dotted module name -> the distribution whose source holds its file.

    A namespace package two distributions fill (``dew.data``: dew-core's ``__init__`` and
    ``base``, dew-data's readers) is dew-core's when dew-core holds its ``__init__``; the
    modules under it belong to whoever holds their files.
    """
    owners: dict[str, str] = {}
    for distribution, src in distributions().items():
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if name and (name not in owners or distribution == CORE):
                owners[name] = distribution
        for init in sorted(src.rglob("*.py")):  # a folder only another distribution fills
            folder = init.parent.relative_to(src)
            if folder.parts:
                owners.setdefault(".".join(folder.parts), distribution)
    return owners


@functools.cache
def foreign_modules() -> frozenset[str]:
    """Modules of the package ``dew`` that dew-core does not ship."""
    return frozenset(name for name, owner in module_owners().items() if owner != CORE)


@functools.cache
def surface_names() -> dict[str, dict[str, str]]:
    """Surface package -> {listed name: module it comes from}, for dew-core's surfaces."""
    src = distributions()[CORE]
    listed: dict[str, dict[str, str]] = {}
    for init in sorted(src.rglob("__init__.py")):
        package = ".".join(init.relative_to(src).parent.parts)
        tree = ast.parse(init.read_text(encoding="utf-8"))
        names: dict[str, str] = {}
        for node in tree.body:
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                for statement in node.body:
                    if isinstance(statement, ast.ImportFrom) and statement.module:
                        for alias in statement.names:
                            names[alias.asname or alias.name] = f"{statement.module}.{alias.name}" \
                                if statement.module == package else statement.module
        if names:
            listed[package] = names
    return listed


def _entry_points(group: str) -> dict[str, str]:
    """Entry-point name -> distribution, for one dew group, from the pyprojects."""
    names: dict[str, str] = {}
    for pyproject in sorted(ROOT.glob("dew-*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        for name in project.get("entry-points", {}).get(group, {}):
            names[name] = project["name"]
    return names


@functools.cache
def foreign_components() -> dict[str, str]:
    """Registered objective, dataset and tracker name -> the distribution other than dew-core
    that registers it (a recipe section naming it needs that distribution)."""
    return {name: owner for group in (*RECIPE_SECTIONS.values(), "dew.trackers")
            for name, owner in _entry_points(group).items() if owner != CORE}


@functools.cache
def foreign_recipes() -> dict[str, str]:
    """Shipped recipe name -> why it needs another distribution (its objective's or data's)."""
    recipes = distributions()[CORE] / "dew" / "recipes"
    groups = {section: _entry_points(group) for section, group in RECIPE_SECTIONS.items()}
    found: dict[str, str] = {}
    for path in sorted(recipes.glob("*.yaml")):
        recipe = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for section, registered in groups.items():
            kind = (recipe.get(section) or {}).get("name")
            owner = registered.get(kind, CORE) if isinstance(kind, str) else CORE
            if owner != CORE:
                found[path.stem] = f"its {section} {kind!r} is {owner}'s"
                break
    return found


@dataclass(frozen=True)
class Reach:
    """One place a test file reaches past dew-core."""

    path: Path
    line: int
    what: str

    def __str__(self) -> str:
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{shown}:{self.line}: {self.what}"


def _imports(tree: ast.AST) -> Iterator[tuple[int, str, str | None]]:
    """(line, module, imported name or None) for every import anywhere in tree."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.lineno, node.module, alias.name


def _code_in_strings(tree: ast.AST) -> Iterator[tuple[int, ast.AST]]:
    """Python programs written as string literals (the code a test runs in a child); an f-string's
    replacement fields read as a name, so its literal imports are seen too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(part.value if isinstance(part, ast.Constant) else "_" for part in node.values)
        else:
            continue
        if "import" in text:
            try:
                yield node.lineno, ast.parse(textwrap.dedent(text))
            except SyntaxError:
                continue


def reaches(path: Path) -> list[Reach]:
    """The imports of foreign modules (in the file, and in code it keeps in strings) and the
    foreign shipped recipes (a string naming ``tiny-lm`` or ``tiny-lm.yaml``) in one test file."""
    foreign, surfaces, recipes = foreign_modules(), surface_names(), foreign_recipes()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[Reach] = []

    def check(line: int, module: str, name: str | None, where: str) -> None:
        targets = [module] if name is None else [module, f"{module}.{name}"]
        targets += [surfaces[module][name]] if name and name in surfaces.get(module, {}) else []
        for target in targets:
            hit = next((f for f in foreign if target == f or target.startswith(f + ".")), None)
            if hit:
                what = module if name is None else f"{module}.{name}"
                found.append(Reach(path, line, f"{where}imports {what} ({hit} is not dew-core's)"))
                return

    for line, module, name in _imports(tree):
        check(line, module, name, "")
    for line, program in _code_in_strings(tree):
        for _, module, name in _imports(program):
            check(line, module, name, "code in a string ")
    components = foreign_components()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            stem = node.value.removesuffix(".yaml")
            if stem in recipes:
                found.append(Reach(path, node.lineno, f"names the shipped recipe {stem!r} ({recipes[stem]})"))
            for section, kind in _yaml_sections(node.value):
                if kind in components:
                    found.append(Reach(path, node.lineno, f"a recipe in a string names the {section} "
                                                          f"{kind!r} ({components[kind]}'s)"))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value in SECTIONS:
                    for kind in _names_in(value):
                        if kind in components:
                            found.append(Reach(path, node.lineno, f"a recipe section {key.value!r} names "
                                                                  f"{kind!r} ({components[kind]}'s)"))
    return sorted(found, key=lambda r: r.line)


def _names_in(node: ast.AST) -> Iterator[str]:
    """The string values of "name" keys in a dict literal (or a list of them)."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Dict):
            for key, value in zip(inner.keys, inner.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "name" and \
                        isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.value


def _yaml_sections(text: str) -> Iterator[tuple[str, str]]:
    """(section, name) for each recipe section a YAML document in a string names."""
    if not any(f"{section}:" in text for section in SECTIONS):
        return
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        return
    if not isinstance(document, dict):
        return
    for section in SECTIONS:
        value = document.get(section)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                yield section, item["name"]


SITECUSTOMIZE = '''"""Refuse every module a distribution other than dew-core ships (written by core_test_reach)."""
import importlib.abc
import sys

BLOCKED = frozenset({blocked!r})


class OtherDistributions(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not dew-core's)", name=name)
        return None


sys.meta_path.insert(0, OtherDistributions())
'''


def main(argv: list[str]) -> int:
    """``python tests/core_test_reach.py [PYTEST ARGS]``: run pytest (dew-core/tests by default) as
    if only dew-core were installed, in this interpreter and every child the tests start (the
    import hook is a ``sitecustomize`` on ``PYTHONPATH``). Slower than the guard test, and it
    finds what the guard cannot: reaches that happen only while a test runs."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dew-core-alone-") as folder:
        Path(folder, "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=sorted(foreign_modules())))
        path = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
        command = [sys.executable, "-m", "pytest", *(argv or [str(ROOT / "dew-core" / "tests")])]
        return subprocess.call(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
