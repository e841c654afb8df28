"""The `dew` command: `dew recipes`, `dew train --help`, bad recipes, and tiny-lm trained."""

from __future__ import annotations

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




def test_generate_inputs_after_an_option_are_inputs_too(monkeypatch, capsys):
    """`dew generate RUN --step 3 "1+1="`: argparse alone stops the trailing prompts at the first option."""
    import dew.cli.generate

    seen: dict = {}
    monkeypatch.setattr(dew.cli.generate, "run", lambda args: seen.update(vars(args)) or 0)
    assert main(["generate", "runs/x", "--step", "3", "1+1=", "--count", "2", "2+2="]) == 0
    assert seen["inputs"] == ["1+1=", "2+2="] and seen["step"] == 3 and seen["count"] == 2
    with pytest.raises(SystemExit) as stopped:
        main(["generate", "runs/x", "1+1=", "--no-such-flag"])
    assert stopped.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["generate", "runs/x", "--steps", "0"], "dew generate: argument --steps: 0 is not at least 1"),
    # Named after the Python fields behind them ("count must be at least 1", "stop_strings must be non-empty").
    (["generate", "runs/x", "--count", "0"], "dew generate: argument --count: 0 is not at least 1"),
    (["generate", "runs/x", "--stop", ""],
     "dew generate: argument --stop: an empty text would end every continuation at once; give the text a "
     "continuation ends after"),
    (["generate"], "dew generate: the following arguments are required: RUN, INPUT"),
    (["train", "tiny-lm", "--chek"], "dew train: unrecognized arguments: --chek (did you mean --check?)"),
    (["--nosuch"], "dew: unrecognized arguments: --nosuch"),
])
def test_an_option_argparse_refuses_is_one_line_naming_where_the_options_are(argv, said, capsys):
    """A bad option printed argparse's usage block, then its line: the only refusal of dew's that was
    not one line."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    command = said.split(":")[0]
    assert stopped.value.code == 2 and err == f"{said} ({command} --help lists its options)\n", err
