"""One ``dew`` package from four distributions, installed in subsets into fresh venvs.

Wheels are built with ``pip wheel --no-deps`` from clean copies of the four
projects and installed with ``--no-deps`` into virtual environments that see
the third-party stack (jax, flax, ...) but none of dew's own installs.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

import fresh_venv as fv  # every test folder is on sys.path (conftest.py)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    return fv.session_wheels(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def dependencies(tmp_path_factory) -> Path:
    return fv.session_dependencies(tmp_path_factory.getbasetemp())


def _venv(tmp_path: Path, dependencies: Path, *installs: Path, editable: tuple[Path, ...] = ()) -> Path:
    python = fv.create(tmp_path / "venv", dependencies)
    if editable:
        fv.install(python, *editable, editable=True)
    if installs:
        fv.install(python, *installs)
    return python


# Printed by every probe: what the venv's dew looks like from inside.
_PROBE = """
import importlib, json, sys
import dew, dew.training, dew.data
from dew import registry
out = {
    "dew_file": dew.__file__,
    "names": {group: registry.registry(group).names() for group in registry.GROUPS},
    "errors": {},
    "files": {},
}
def attempt(label, action):
    try:
        value = action()
        out["files"][label] = getattr(value, "__file__", None) or getattr(
            sys.modules.get(getattr(value, "__module__", ""), None), "__file__", None)
    except Exception as error:
        out["errors"][label] = [type(error).__name__, str(error)]
attempt("base", lambda: importlib.import_module("dew.objectives.base"))
attempt("lm", lambda: registry.objectives.load("lm"))
attempt("lm_module", lambda: importlib.import_module("dew.objectives.lm"))
attempt("tensorboard", lambda: dew.training.TensorBoardTracker)
attempt("tokenizer", lambda: dew.data.ByteTokenizer)
attempt("reader", lambda: dew.data.TokenWindows)
attempt("model", lambda: dew.models.load("causal_transformer"))
from dew._surface import install_hint
out["hint"] = install_hint("dew-trackers", "tensorboard")
print(json.dumps(out))
"""


def test_only_dew_core_ships_the_shared_packages_init(wheels):
    shared = {"dew/__init__.py", "dew/objectives/__init__.py", "dew/data/__init__.py", "dew/evaluations/__init__.py"}
    for name, wheel in wheels.items():
        files = set(zipfile.ZipFile(wheel).namelist())
        if name == "dew-core":
            assert shared <= files
            init = zipfile.ZipFile(wheel).read("dew/__init__.py").decode()
            assert "extend_path" in init
        else:
            assert not (shared & files), f"{name} ships {shared & files}"
            assert any(f.startswith("dew/") for f in files), f"{name} ships no dew module"


def test_core_alone(tmp_path, wheels, dependencies):
    python = _venv(tmp_path, dependencies, wheels["dew-core"])
    out = fv.probe(python, _PROBE)
    assert out["dew_file"].startswith(str(tmp_path / "venv"))
    assert out["names"]["models"]["causal_transformer"] == "dew-core"
    assert set(out["names"]["trackers"].values()) == {"dew-core"}
    assert out["names"]["objectives"] == {}
    assert "base" in out["files"]
    kind, message = out["errors"]["lm"]  # a registry name from an absent distribution
    assert kind == "UnknownNameError" and "pip install dew-objectives" in message
    assert out["errors"]["lm_module"][0] == "ModuleNotFoundError"  # a plain import stays Python's
    kind, message = out["errors"]["tensorboard"]  # a surface name from an absent distribution
    assert kind == "MissingDistributionError" and "pip install dew-trackers" in message
    kind, message = out["errors"]["reader"]
    assert kind == "MissingDistributionError" and "pip install dew-data" in message
    # the tokenizers a published model's directory holds are read by dew-core alone
    assert "tokenizer" not in out["errors"] and out["files"]["tokenizer"].startswith(str(tmp_path / "venv"))
    assert "model" not in out["errors"] and out["files"]["model"].startswith(str(tmp_path / "venv"))


def test_core_and_objectives(tmp_path, wheels, dependencies):
    python = _venv(tmp_path, dependencies, wheels["dew-core"], wheels["dew-objectives"])
    out = fv.probe(python, _PROBE)
    assert out["names"]["objectives"]["lm"] == "dew-objectives"
    site = str(tmp_path / "venv")
    assert out["files"]["base"].startswith(site)
    assert out["files"]["lm"].startswith(site), out["errors"].get("lm")
    assert out["errors"]["tensorboard"][0] == "MissingDistributionError"
    assert out["errors"]["reader"][0] == "MissingDistributionError"


def test_all_four(tmp_path, wheels, dependencies):
    python = _venv(tmp_path, dependencies, *wheels.values())
    out = fv.probe(python, _PROBE)
    assert {"tensorboard", "mlflow", "wandb", "local"} <= set(out["names"]["trackers"])
    assert out["names"]["trackers"]["tensorboard"] == "dew-trackers"
    assert out["names"]["objectives"]["lm"] == "dew-objectives"
    assert "tensorboard" not in out["errors"] or (
        out["errors"]["tensorboard"][0] != "MissingDistributionError"), out["errors"]
    assert out["files"]["reader"].startswith(str(tmp_path / "venv")), out["errors"]
    # the extra comes from dew-trackers' own metadata, as installed from its wheel
    assert "pip install 'dew-trackers[tensorboard]'" in out["hint"], out["hint"]
    help_text = fv.run([str(python.parent / "dew"), "--help"], cwd="/").stdout
    assert "train" in help_text


def test_editable_core_beside_a_plugin_wheel(tmp_path, wheels, dependencies):
    python = _venv(tmp_path, dependencies, wheels["dew-objectives"],
                   editable=(fv.DISTRIBUTIONS["dew-core"],))
    out = fv.probe(python, _PROBE)
    assert out["dew_file"] == str(fv.ROOT / "dew-core/src/dew/__init__.py")
    assert out["files"]["base"] == str(fv.ROOT / "dew-core/src/dew/objectives/base.py")
    assert out["names"]["models"]["causal_transformer"] == "dew-core"
    assert out["names"]["objectives"]["lm"] == "dew-objectives"
    assert out["files"]["lm"].startswith(str(tmp_path / "venv")), out["errors"].get("lm")
    assert out["errors"]["tensorboard"][0] == "MissingDistributionError"


def test_every_root_dew_is_installed_from_is_marked_typed():
    """A user's `mypy --strict` skipped dew ('installed, but missing library stubs or py.typed
    marker') and read Objective as Any. Each distribution's dew folder (an editable install puts
    four on the path; mypy looks for the marker in the one a module is found in) holds py.typed,
    and dew-core's wheel carries it."""
    import importlib
    import tomllib
    from pathlib import Path

    roots = {Path(importlib.import_module(name).__file__).parents[1]
             for name in ("dew.training.step", "dew.objectives.dpo", "dew.data.hf_text", "dew.trackers.tensorboard")}
    assert len(roots) == 4, roots
    assert all((root / "py.typed").is_file() for root in roots), roots
    core = next(root for root in roots if (root / "__init__.py").is_file())
    data = tomllib.loads((core.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["dew"]
