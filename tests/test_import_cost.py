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
