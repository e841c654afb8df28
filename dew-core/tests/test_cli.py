"""The `dew` command: `dew recipes`, `dew train --help`, bad recipes, and tiny-lm trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dew.cli import main
from dew.recipes.config import shipped

DEW = Path(sys.executable).with_name("dew")


def test_recipes_lists_the_shipped_ones_with_descriptions(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in shipped():
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert len(line.split(maxsplit=1)) == 2, f"{name} has no description"
    assert "tiny-lm" in out and "standard library" in out


def test_train_help_lists_every_field(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for key in ("trainer.mesh.fsdp", "trainer.steps", "trainer.checkpoint_dir", "optimizer.solver",
                "optimizer.schedule", "model.name", "data.batch", "trackers.N.name", "seed"):
        assert f"  {key} " in out, key
    assert "'adamw' | 'lion' | 'sgd' | 'adafactor'" in out


def test_bad_recipe_exits_2_naming_the_path(tmp_path, capsys):
    assert main(["train", "tiny-lm", "trainer.mesh.fsdp=two", "model.nam=x"]) == 2
    err = capsys.readouterr().err
    assert "trainer.mesh.fsdp: Input should be a valid integer" in err and "'two'" in err
    assert "model.nam: model 'causal_transformer' has no field 'nam'" in err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "No recipe file" in capsys.readouterr().err


def test_check_prints_the_resolved_recipe(capsys):
    assert main(["train", "tiny-lm", "trainer.steps=7", "--check"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["trainer"]["steps"] == 7 and config["model"]["name"] == "causal_transformer"


@pytest.mark.slow
def test_dew_train_tiny_lm_trains_and_samples(tmp_path):
    """The README's command, a few steps long, through the installed console script.

    The recipe's XLA flags give the process two CPU devices, which only works
    because prepare_process sets them before anything opens JAX's backend.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [str(DEW), "train", "tiny-lm", "trainer.steps=3", "trainer.log_every=1",
         "data.files={stdlib}/a*.py", f"trackers.0.directory={tmp_path}/runs/{{timestamp}}",
         f"trainer.checkpoint_dir={tmp_path}/ckpt", "trainer.checkpoint_every=3",
         "trainer.xla_flags=[--xla_force_host_platform_device_count=2]", "trainer.mesh.fsdp=2"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "step 3: loss" in result.stdout
    assert "'fsdp': 2" in result.stdout
    assert "Sample (sample):\ndef " in result.stdout
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "scalars.jsonl").exists()
    saved = json.loads((tmp_path / "ckpt" / "run.json").read_text())
    assert saved["trainer"]["steps"] == 3
    assert saved["data"]["files"] == "{stdlib}/a*.py"  # run.json keeps the recipe as written

