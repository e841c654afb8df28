"""The 'dew.training knows no modality' contract really checks dew.diffusion and dew.inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LINT = Path(__file__).resolve().parents[1] / "scripts" / "lint_imports.py"


def test_training_contract_sees_diffusion_and_inputs(tmp_path):
    # The real contracts run with no "does not exist yet" note for the two modules...
    kept = subprocess.run([sys.executable, str(LINT)], capture_output=True, text=True, timeout=300)
    assert kept.returncode == 0, kept.stdout[-3000:]
    for module in ("dew.diffusion", "dew.inputs", "dew.sampling"):
        assert f"{module} does not exist yet" not in kept.stderr, kept.stderr
    # ...and the same kind of contract breaks where they are imported, so it is not vacuous.
    code = f"""
import sys
sys.path.insert(0, {str(LINT.parent)!r})
import dew, lint_imports
from importlinter.cli import lint_imports as run
dew.__spec__.submodule_search_locations[:] = list(dew.__path__)
config = lint_imports._ini({{"root_packages": ["dew"], "include_external_packages": True,
    "contracts": [{{"name": "planted", "type": "forbidden",
                    "source_modules": ["dew.objectives.diffusion"],
                    "forbidden_modules": ["dew.diffusion", "dew.inputs"]}}]}})
print("EXIT", run(config_filename=config, no_cache=True))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert "EXIT 1" in result.stdout and "planted BROKEN" in result.stdout, result.stdout
    assert "dew.objectives.diffusion -> dew.diffusion" in result.stdout
    assert "dew.objectives.diffusion -> dew.inputs" in result.stdout
