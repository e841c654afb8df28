"""Layering: the import contracts span all four distributions, catch a planted violation,
and refuse to pass when a module they name does not exist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LINT = Path(__file__).resolve().parents[1] / "scripts" / "lint_imports.py"


def _planted(tmp_path: Path, contracts: str) -> subprocess.CompletedProcess:
    code = f"""
import sys
sys.path.insert(0, {str(LINT.parent)!r})
import dew, lint_imports
from importlinter.cli import lint_imports as run
dew.__spec__.submodule_search_locations[:] = list(dew.__path__)
config = lint_imports._ini({{"root_packages": ["dew"], "include_external_packages": True,
    "contracts": {contracts}}})
print("EXIT", run(config_filename=config, no_cache=True))
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)


def test_import_contracts_see_every_distribution_and_catch_a_violation(tmp_path):
    # scripts/lint_imports.py runs pyproject's contracts across all four portions of
    # the dew package. A planted contract that the code breaks must come back broken,
    # or the check would be vacuous (import-linter alone sees only dew-core's portion).
    result = _planted(tmp_path, """[{"name": "planted", "type": "forbidden",
        "source_modules": ["dew.trackers.tensorboard"], "forbidden_modules": ["tensorboard"]}]""")
    assert result.returncode == 0, result.stderr
    assert "EXIT 1" in result.stdout and "planted BROKEN" in result.stdout, result.stdout
    kept = subprocess.run([sys.executable, str(LINT)], capture_output=True, text=True, timeout=300)
    assert kept.returncode == 0, kept.stdout[-3000:] + kept.stderr[-3000:]
    assert "0 broken" in kept.stdout


def test_training_contract_breaks_where_diffusion_inputs_and_sampling_are_imported(tmp_path):
    # The spec's rule for dew.training, planted on a module that does import them.
    result = _planted(tmp_path, """[{"name": "planted", "type": "forbidden",
        "source_modules": ["dew.objectives.diffusion", "dew.objectives.lm"],
        "forbidden_modules": ["dew.diffusion", "dew.inputs", "dew.sampling"]}]""")
    assert "EXIT 1" in result.stdout and "planted BROKEN" in result.stdout, result.stdout + result.stderr
    assert "dew.objectives.diffusion -> dew.diffusion" in result.stdout
    assert "dew.objectives.diffusion -> dew.inputs" in result.stdout
    assert "-> dew.sampling" in result.stdout


def test_every_distribution_has_a_generated_contract():
    sys.path.insert(0, str(LINT.parent))
    import lint_imports

    contracts = {c["name"].split(" imports")[0]: c for c in lint_imports.generated_contracts()}
    distributions = {name for name in contracts if name.startswith("dew-")}
    assert distributions == set(lint_imports.DISTRIBUTIONS)
    placement = contracts["dew.training.placement"]
    assert "dew.training.placement.layout" in placement["source_modules"]
    assert "dew.training.trainer" in placement["forbidden_modules"]
    assert not any(m.startswith("dew.training.placement") for m in placement["forbidden_modules"])
    assert "dew.data.stream" in contracts["dew-trackers"]["forbidden_modules"]
    assert "dew.trackers.mlflow" in contracts["dew-objectives"]["forbidden_modules"]
    assert "dew.objectives.lm" in contracts["dew-data"]["forbidden_modules"]


def test_a_layers_contract_with_independent_wings_sees_the_engine_import_them(tmp_path):
    # The same wings, planted above the engine instead of below it: the engine's real imports
    # of tracking and checkpoints now run upwards, so the contract must come back broken.
    result = _planted(tmp_path, """[{"name": "planted layers", "type": "layers",
        "layers": ["dew.checkpoints | dew.tracking | dew.adapters", "dew.training"]}]""")
    assert "EXIT 1" in result.stdout and "planted layers BROKEN" in result.stdout, result.stdout + result.stderr
    assert "dew.training.trainer -> dew.tracking.progress" in result.stdout, result.stdout


def test_a_contract_naming_a_module_that_does_not_exist_fails(tmp_path):
    result = _planted(tmp_path, """[{"name": "ahead of its code", "type": "forbidden",
        "source_modules": ["dew.training"], "forbidden_modules": ["dew.holography"]}]""")
    assert result.returncode != 0
    assert "MissingModuleError" in result.stderr and "dew.holography" in result.stderr, result.stderr


def test_the_trainer_stays_a_facade_under_two_hundred_lines():
    # The engine's parts (program, execution, feed, hooks, loop) live in their own modules; the
    # Trainer builds them and runs them, and grows only by delegating.
    import inspect

    from dew.training import trainer

    module = inspect.getsource(trainer).splitlines()
    assert len(module) < 200, f"dew/training/trainer.py has {len(module)} lines"
    # The execution is chosen once (execution_for); the trainer never branches on which it got.
    assert "owns_state" not in inspect.getsource(trainer.Trainer.fit)
    assert not any("if self.execution" in line or "isinstance(self.execution" in line for line in module)
