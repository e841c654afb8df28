"""``import dew`` stays cheap: no tracker backend, no Grain, no JAX, no plugin distribution.

Each check runs ``python -X importtime`` in a fresh interpreter and reads the
list of modules it imported from the report on stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import importlib_metadata
import pytest

BACKENDS = ("wandb", "mlflow", "tensorboard", "grain")


def imported_modules(statement: str, extra_path: Path | None = None) -> dict[str, int]:
    """Modules a fresh interpreter imports to run statement, with cumulative microseconds."""
    environment = dict(os.environ)
    if extra_path is not None:
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(extra_path), environment.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", statement],
                            capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr
    modules = {}
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or "imported package" in line:
            continue
        _, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|"))
        modules[name] = int(cumulative)
    assert modules, result.stderr
    return modules


def _roots(modules: dict[str, int], roots: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in roots)


def _entry_point_modules() -> set[str]:
    """Every module that an installed distribution registers in a dew.* entry-point group."""
    found = set()
    for ep in importlib_metadata.entry_points():
        if ep.group.startswith("dew."):
            found.add(ep.value.split(":")[0].split("[")[0].strip())
    return found


@pytest.fixture
def plugin_site(tmp_path: Path) -> Path:
    """An installed-looking plugin distribution registering one hook module."""
    info = tmp_path / "dewtest_cost_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dewtest-cost-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[dew.plugins]\ncost = dewtest_cost_plugin\n")
    (tmp_path / "dewtest_cost_plugin.py").write_text("import json\n")
    return tmp_path


def test_import_dew_imports_no_backend_no_jax_and_no_plugin(plugin_site):
    modules = imported_modules("import dew", plugin_site)
    assert _roots(modules, (*BACKENDS, "jax", "jaxlib", "flax", "optax", "orbax")) == []
    registered = _entry_point_modules() | {"dewtest_cost_plugin"}
    assert sorted(registered & set(modules)) == []
    assert "dew" in modules
    print(f"import dew: {modules['dew'] / 1000:.1f} ms cumulative")


def test_import_dew_training_imports_no_backend_or_grain(plugin_site):
    modules = imported_modules("import dew.training", plugin_site)
    assert _roots(modules, BACKENDS) == []
    assert "dewtest_cost_plugin" not in modules
    assert not any(m.startswith("dew.trackers") for m in modules)


def test_the_check_sees_what_a_heavy_import_pulls_in():
    # The parser is not vacuous: importing the TensorBoard tracker's backend shows up.
    modules = imported_modules("import tensorboard")
    assert _roots(modules, ("tensorboard",))


LINT = Path(__file__).resolve().parents[1] / "scripts" / "lint_imports.py"


def test_import_contracts_see_every_distribution_and_catch_a_violation(tmp_path):
    # scripts/lint_imports.py runs pyproject's contracts across all four portions of
    # the dew package. A planted contract that the code breaks must come back broken,
    # or the check would be vacuous (import-linter alone sees only dew-core's portion).
    code = f"""
import sys
sys.path.insert(0, {str(LINT.parent)!r})
import dew, lint_imports
from importlinter.cli import lint_imports as run
dew.__spec__.submodule_search_locations[:] = list(dew.__path__)
contract = lint_imports.core_contract()
assert "dew.trackers.tensorboard" in contract["forbidden_modules"], contract
assert "dew.training" in contract["source_modules"], contract
config = lint_imports._ini({{"root_packages": ["dew"], "include_external_packages": True,
    "contracts": [{{"name": "planted", "type": "forbidden",
                    "source_modules": ["dew.trackers.tensorboard"],
                    "forbidden_modules": ["tensorboard"]}}]}})
print("EXIT", run(config_filename=config, no_cache=True))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "EXIT 1" in result.stdout and "planted BROKEN" in result.stdout, result.stdout
    kept = subprocess.run([sys.executable, str(LINT)], capture_output=True, text=True, timeout=300)
    assert kept.returncode == 0, kept.stdout[-3000:]
    assert "0 broken" in kept.stdout
