"""The public surface: every name has one home, the surfaces list what type checkers read,
and error classes are named for what went wrong."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import dew

ROOT = Path(__file__).resolve().parents[1]
SURFACES = ["dew", "dew.training", "dew.data", "dew.recipes", "dew.training.runtime", "dew.trackers",
            "dew.testing"]
# Names the spec gives that do not follow the rule (an exception that reports an outcome).
SPEC_NAMED = {"Preempted"}


def _all_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(dew.__path__, "dew."):
        if ".tests" in info.name:
            continue
        names.append(info.name)
    return names


@pytest.fixture(scope="module")
def modules() -> dict[str, object]:
    return {name: importlib.import_module(name) for name in _all_modules()}


def test_each_surface_name_is_defined_where_its_surface_says(modules):
    from dew._surface import _listed

    for package in SURFACES:
        module = importlib.import_module(package)
        listed = _listed(module.__file__)
        assert listed, f"{package} lists no names under TYPE_CHECKING"
        for name, (home, _attribute) in listed.items():
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value):
                assert value.__module__ == home, f"{package}.{name} is defined in {value.__module__}, listed from {home}"
            assert name in module.__all__ and name in dir(module)


# Where the reference documents each name it says is "documented in" another module: a user
# imports it from there.
DOCUMENTED_IN = {
    "dew": ["Checkpoints"],
    "dew.objectives.base": ["Aux", "EMASpec", "Metric", "Objective", "Step", "everything", "under"],
    "dew.training.optim": ["build_optimizer"],
    "dew.training.quantization": ["Quantization", "apply_quantization"],
    "dew.training.runtime": ["Preempted", "prepare_process", "run_timestamp"],
    "dew.training.state": ["TrainState"],
}


@pytest.mark.parametrize("module", sorted(DOCUMENTED_IN))
def test_each_name_imports_from_the_module_the_reference_documents_it_in(module):
    imported = importlib.import_module(module)
    import dew.training

    for name in DOCUMENTED_IN[module]:
        assert name in imported.__all__, f"{module} does not list {name}"
        value = getattr(imported, name)
        if name in dew.training.__all__:  # the same object the training surface gives
            assert value is getattr(dew.training, name), (module, name)


def test_no_public_class_or_function_has_two_homes(modules):
    homes: dict[str, set[str]] = {}
    for name, module in modules.items():
        command = name.startswith("dew.cli.")  # each command module has add_arguments and run (and markdown)
        for public in getattr(module, "__all__", ()):
            if command and public in {"add_arguments", "run", "describe", "markdown"}:
                continue
            value = getattr(module, public, None)
            if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__.startswith("dew."):
                homes.setdefault(public, set()).add(value.__module__)
    twice = {name: sorted(where) for name, where in homes.items() if len(where) > 1}
    assert twice == {}, twice


def test_error_classes_are_named_for_what_went_wrong(modules):
    wrong = []
    for name, module in modules.items():
        for attribute, value in vars(module).items():
            if attribute.startswith("_") or not (
                    inspect.isclass(value) and value.__module__ == name and issubclass(value, BaseException)):
                continue
            suffix = "Warning" if issubclass(value, Warning) else "Error"
            if not attribute.endswith(suffix) and attribute not in SPEC_NAMED:
                wrong.append(f"{name}.{attribute} (should end in {suffix})")
    assert wrong == []


def test_a_name_missing_from_a_surface_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'Trainr'"):
        dew.Trainr  # noqa: B018
    training = importlib.import_module("dew.training")
    with pytest.raises(AttributeError):
        training.build_trainer  # noqa: B018


def test_a_type_checker_sees_every_public_name(tmp_path):
    # mypy reads the surfaces' TYPE_CHECKING imports: every public name must come out as
    # the real class, function or module, never as Any (a name the checker cannot see).
    # --no-site-packages: dew is found through MYPYPATH and the third-party packages
    # (jax, flax, numpy...) are not analysed; their types inside signatures read as Any,
    # but a dew name the checker cannot see still reads as Any itself, which is what
    # fails. Analysing jax and the rest cost about 30 s and decided nothing here.
    lines = []
    for package in SURFACES:
        for name in importlib.import_module(package).__all__:
            alias = f"_{package.replace('.', '_')}_{name}"
            lines += [f"from {package} import {name} as {alias}", f"reveal_type({alias})"]
    probe = tmp_path / "probe.py"
    probe.write_text("\n".join(lines) + "\n")
    path = os.pathsep.join(str(ROOT / d / "src") for d in ("dew-core", "dew-objectives", "dew-trackers", "dew-data"))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", sys.executable, "--no-site-packages",
         "--follow-imports=silent",
         "--ignore-missing-imports", "--cache-dir", str(tmp_path / "cache"), str(probe)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env={**os.environ, "MYPYPATH": path},
    )
    revealed = [line for line in result.stdout.splitlines() if "Revealed type is" in line]
    assert len(revealed) == len(lines) // 2, result.stdout[-3000:] + result.stderr[-2000:]
    blind = [line for line in revealed if 'Revealed type is "Any"' in line]
    assert blind == [], blind
    assert "Success: no issues found" in result.stdout, result.stdout[-3000:]
