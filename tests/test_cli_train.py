"""The `dew` command over the shipped tiny-lm recipe: --check and a real training (they need the objectives and data distributions)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dew.cli import main
from test_cli import DEW  # every test folder is on sys.path (conftest.py)


def test_check_prints_the_resolved_recipe(capsys):
    assert main(["train", "tiny-lm", "trainer.steps=7", "--check"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["trainer"]["steps"] == 7 and config["model"]["name"] == "causal_transformer"


def test_overrides_after_an_option_are_overrides_too(capsys):
    # argparse alone stops a trailing key=value list at the first option
    assert main(["train", "tiny-lm", "--check", "trainer.steps=9", "optimizer.learning_rate=0.002"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["trainer"]["steps"] == 9 and config["optimizer"]["learning_rate"] == 0.002
    with pytest.raises(SystemExit) as stopped:
        main(["train", "tiny-lm", "--check", "--no-such-flag"])
    assert stopped.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("recipe, overrides, said", [
    # an objective's own refusal, which --check used to pass and the run then refused as it built
    ("digits-diffusion", ["objective.guidance=3", "objective.condition_dropout=0"],
     "guidance=3 extrapolates from the model's prediction without its condition"),
    ("tiny-distill", ["objective.teacher=null", "objective.teacher_checkpoint=null",
                      "objective.teacher_pretrained=nowhere/teacher"], "holds no config.json"),
    ("qwen3-sft", ["init=null", "data.tokenizer=nowhere/qwen3"], "'nowhere/qwen3' does not exist"),
])
def test_check_builds_the_objective_and_reader_as_the_run_would(recipe, overrides, said, capsys, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", recipe, *overrides, "--check"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())  # nothing is written: no run folder, no data read


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


@pytest.mark.parametrize("under", ["checkpoint_dir", "tracker_dir"])
def test_a_run_directory_under_a_file_is_named_without_a_note_to_create_it(tmp_path, monkeypatch, capsys, under):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("a user's file\n")
    tracker = "afile/sub" if under == "tracker_dir" else "runs/t"
    code = main(["train", "tiny-lm", "trainer.steps=2", "trainer.checkpoint_dir=afile/sub",
                 f"trackers.0.directory={tracker}"])
    error = capsys.readouterr().err
    assert code == 2, error
    if under == "checkpoint_dir":
        assert f"CheckpointDirectoryError: The checkpoint directory {tmp_path}/afile/sub cannot be used: it, or " \
               "a folder above it, is a file" in error
    else:  # the trackers' directories are checked first
        assert f"TrackerWriteError: The tracker directory {tmp_path}/afile/sub" in error
        assert "The recipe's trackers.0.directory names it: point trackers.0.directory at a directory" in error
    assert "create it first" not in error and "Traceback" not in error  # the folder's note is for missing inputs
    assert (tmp_path / "afile").read_text() == "a user's file\n"
    assert not (tmp_path / "runs").exists()  # the run never started and kept nothing


def test_a_file_the_recipe_names_is_to_be_created_only_when_it_is_missing(tmp_path, monkeypatch, capsys):
    """A missing tokenizer gets the note that traces it to the recipe and asks to create it; one
    that is there but unreadable is named as such (not a traceback), traced to the same field,
    and nobody is told to create what exists."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("not json\n")
    code = main(["train", "qwen3-sft", "trainer.steps=1", "data.tokenizer=tok/tokenizer.json"])
    error = capsys.readouterr().err
    assert code == 2, error
    assert "UnreadableTokenizerError: The tokenizer file 'tok/tokenizer.json' cannot be read" in error
    assert "The recipe's data.tokenizer names it." in error
    assert "create it first" not in error and "Traceback" not in error
    code = main(["train", "qwen3-sft", "trainer.steps=1", "data.tokenizer=gone/tokenizer.json"])
    error = capsys.readouterr().err
    assert code == 2 and "MissingFileError" in error
    assert "The recipe's data.tokenizer names it: create it first" in error
    assert "Nothing was kept: the run failed before it wrote anything." in error  # as docs/cli.md promises


def test_a_recipe_field_written_as_a_flag_is_told_its_key_value_word(capsys):
    """`dew train tiny-lm --steps 5` (as other trainers take it) was told only 'unrecognized arguments'."""
    for argv, said in ((["--steps", "5"], "(a recipe's fields are key=value words: trainer.steps=5)"),
                       (["--lr=0.1"], "(a recipe's fields are key=value words: optimizer.learning_rate=0.1)"),
                       (["--chek"], "(did you mean --check?)")):
        with pytest.raises(SystemExit) as stopped:
            main(["train", "tiny-lm", *argv])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and f"unrecognized arguments: {' '.join(argv)} {said}" in err, err


def test_ctrl_c_during_the_final_sample_says_the_run_trained_and_is_saved(tmp_path, monkeypatch, capsys):
    # A Ctrl-C after the last step, while the sample was drawn, said only "interrupted (Ctrl-C)":
    # the run read as lost, though every step was trained and saved. A Ctrl-C lands at a moment
    # no test can choose, so the sample raises it.
    from dew.recipes import run as running

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(running, "show_sample", interrupted)
    arguments = ["tiny-lm", "trainer.steps=2", "data.batch=2", "model.num_layers=1"]
    code = main(["train", *arguments, "trainer.checkpoint_dir=run", "trackers.0.directory=run"])
    err = capsys.readouterr().err
    assert code == 130  # the status a shell expects after Ctrl-C
    assert ("dew train: interrupted (Ctrl-C) while drawing the run's sample, after it trained to step 2, saved "
            f"in {tmp_path / 'run'}.\nUse the run: dew generate {tmp_path / 'run'} PROMPT") in err, err
    assert (tmp_path / "run" / "2" / "dew.json").is_file()
    # A program (a notebook) calling train() met SystemExit, which reads as the interpreter leaving
    # and escapes `except KeyboardInterrupt`; it gets a KeyboardInterrupt saying the same.
    from dew.recipes.config import RunConfig

    config = RunConfig.load(arguments[0], [*arguments[1:], "trainer.checkpoint_dir=other", "trackers.0.directory=other"])
    with pytest.raises(KeyboardInterrupt, match=r"after it trained to step 2, saved in .*other"):
        running.train(config)


def test_a_resume_whose_start_folder_is_gone_says_where_its_relative_paths_are_read(tmp_path, monkeypatch, capsys):
    """A run copied to another machine (its project folder gone) resumed reading its recipe's relative
    data paths from here without a word; other data there was then refused as a changed data set."""
    import shutil

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    args = ["trainer.steps=1", "data.batch=2", "model.num_layers=1"]
    assert main(["train", "tiny-lm", *args, "trainer.checkpoint_dir=runs/r", "trackers.0.directory=runs/r"]) == 0
    shutil.copytree(project / "runs" / "r", tmp_path / "elsewhere" / "r")
    project.rename(tmp_path / "gone")
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["train", "--resume", "r", "trainer.steps=2"]) == 0
    out = capsys.readouterr().out
    assert (f"The folder the run started in, {project}, is gone: its recipe's relative paths (data files, a "
            f"tokenizer, task files) are read from here, {tmp_path / 'elsewhere'}, instead") in out, out
    assert (tmp_path / "elsewhere" / "r" / "2").is_dir()


def test_a_resume_keeps_the_recipes_checkpoint_dir_as_written_in_run_json(tmp_path, monkeypatch):
    """run.json held this machine's absolute path for trainer.checkpoint_dir after a resume, so `dew
    diff` against an uninterrupted run listed it as a change of recipe, and the folder, moved, named
    its old place."""
    import json

    monkeypatch.chdir(tmp_path)
    args = ["trainer.steps=1", "data.batch=2", "model.num_layers=1", "trainer.checkpoint_dir=runs/r",
            "trackers.0.directory=runs/r"]
    assert main(["train", "tiny-lm", *args]) == 0
    monkeypatch.chdir(tmp_path / "runs")  # resumed from another folder, by the run's path from there
    assert main(["train", "--resume", "r", "trainer.steps=2"]) == 0
    recorded = json.loads((tmp_path / "runs" / "r" / "run.json").read_text())
    assert recorded["trainer"]["checkpoint_dir"] == "runs/r" and recorded["trainer"]["steps"] == 2
    assert (tmp_path / "runs" / "r" / "2").is_dir() and not (tmp_path / "runs" / "runs").exists()

def test_a_run_stopped_at_its_last_step_journals_its_sample_when_resumed(tmp_path, monkeypatch):
    """The stop ended the run before its end-of-run sample, and the resume, finding nothing left to
    train, printed the sample without journaling it: the run had no previews at all."""

    from dew.plugins import hookimpl, registered
    from dew.recipes.config import RunConfig
    from dew.recipes.run import train
    from dew.training.runtime import Preempted, PreemptionNotice

    class StopAtTheLast:
        @hookimpl
        def dew_step_end(self, step):
            if step == 1:  # read while the last step, 2, is dispatched
                PreemptionNotice.send()

    monkeypatch.chdir(tmp_path)
    args = ["trainer.steps=2", "data.batch=2", "model.num_layers=1", "trainer.eval_every=null",
            "trainer.checkpoint_dir=runs/r", "trackers.0.directory=runs/r", "objective.preview_tokens=4"]
    with registered(StopAtTheLast()), pytest.raises(Preempted):
        train(RunConfig.load("tiny-lm", args))
    previews = tmp_path / "runs" / "r" / "previews.jsonl"
    assert not previews.exists()
    assert main(["train", "--resume", "runs/r"]) == 0
    assert [json.loads(line)["step"] for line in previews.read_text().splitlines()] == [2]
    assert main(["train", "--resume", "runs/r"]) == 0  # given once: a second resume adds none
    assert len(previews.read_text().splitlines()) == 1

def test_a_resume_that_fails_keeps_its_steps_and_says_how_to_resume_not_that_nothing_was_kept(
        tmp_path, monkeypatch, capsys):
    """A resume whose new tracker folder was made and removed as it failed said "Nothing was kept: the
    run failed before it wrote anything", of a run holding its checkpoints, and gave no resume command."""
    monkeypatch.chdir(tmp_path)
    args = ["trainer.steps=1", "data.batch=2", "model.num_layers=1", "trainer.checkpoint_dir=runs/r",
            "trackers.0.directory=runs/r"]
    assert main(["train", "tiny-lm", *args]) == 0
    capsys.readouterr()
    code = main(["train", "--resume", "runs/r", "trainer.steps=2", "trackers+={name: local, directory: logs/new}",
                 "trainer.evaluate=[{task: perplexity, every: 1, file: nosuch.jsonl}]"])
    err = capsys.readouterr().err
    assert code == 2 and "nosuch.jsonl' does not exist" in err
    assert "Nothing was kept" not in err and "its newest checkpoint is step 1" in err, err
    assert (tmp_path / "runs" / "r" / "1").is_dir() and not (tmp_path / "logs").exists()


def test_dew_eval_says_when_the_runs_data_holds_other_contents_than_it_trained_on(tmp_path, monkeypatch, capsys):
    """dew eval scored whatever the recipe's paths held now (a run copied elsewhere, a file edited) without
    a word, though the step's saved position keeps the data's digest and a resume refuses it."""
    import shutil
    import sysconfig

    data = tmp_path / "data"
    data.mkdir()
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("a*.py")):
        shutil.copy(source, data / source.name)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny-lm", "trainer.steps=1", "data.batch=2", "model.num_layers=1", "data.files=data/*.py",
                 "trainer.checkpoint_dir=run", "trackers.0.directory=run"]) == 0
    capsys.readouterr()
    assert main(["eval", "run"]) == 0
    assert "holds other contents" not in capsys.readouterr().err
    first = sorted(data.iterdir())[0]
    first.write_bytes(first.read_bytes().replace(b"e", b"E", 1))  # as many records, other text
    assert main(["eval", "run"]) == 0
    assert "dew eval: the data the run's recipe names holds other contents than step 1 was trained on" \
        in capsys.readouterr().err


def test_a_flag_xla_does_not_know_is_refused_in_one_line_and_leaves_no_folder(tmp_path, capsys):
    """XLA aborts a process at its first device call on an unknown XLA_FLAGS entry: the run died
    with XLA's fatal log line alone (status 1), leaving a run folder holding started.json, and
    --check passed the recipe."""
    flags = "trainer.xla_flags=[--xla_force_host_platform_device_count=2, --xla_no_such_flag_dew]"
    assert main(["train", "tiny-lm", flags, "--check"]) == 2
    assert "XLA does not know the flag(s) --xla_no_such_flag_dew" in capsys.readouterr().err
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([str(DEW), "train", "tiny-lm", "trainer.steps=1", flags, "trackers=[]",
                             f"trainer.checkpoint_dir={tmp_path}/runs/a"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    (line,) = [text for text in result.stderr.splitlines() if "--xla_no_such_flag_dew" in text]
    assert line.startswith("dew train: UnknownXlaFlagError: XLA does not know the flag(s) --xla_no_such_flag_dew")
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()
