"""dew.recipes.folder without training: what `dew train --resume RUN` reads back from a run's folder."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from dew.recipes import RecipeError, RunConfig
from dew.recipes.folder import (
    STARTED,
    NotARunFolderError,
    RunFolder,
    SharedTrackerFolderWarning,
    resume_command,
    resumed,
)


def _run_folder(root: Path, *overrides: str) -> Path:
    folder = root / "runs" / "tiny-lm" / "2026-01-02_03-04-05"
    RunConfig.load("tiny-lm", overrides=list(overrides)).save(folder)
    return folder


def test_a_folder_written_before_started_json_gives_its_timestamp_and_directory_back(tmp_path, monkeypatch):
    folder = _run_folder(tmp_path)
    monkeypatch.chdir(tmp_path / "runs")  # resumed from elsewhere
    config, where = resumed(folder, ["trainer.steps=700"])
    assert (where.timestamp, where.cwd, where.directory) == ("2026-01-02_03:04:05", tmp_path, folder)
    # the recipe's own checkpoint_dir, which names the folder again where the run started (an
    # absolute path here went into run.json as the recipe's)
    assert config.trainer.steps == 700 and config.trainer.checkpoint_dir == "runs/tiny-lm/{timestamp}"
    # every {timestamp} folder of the run (its journal's) is the first run's
    assert where.directories(config) == [folder]


def test_a_pools_run_resumes_on_one_process(tmp_path):
    """A pool's run.json keeps the trainer.multi_host=true dew launch gave its ranks: dew train --resume
    looked for a pool to join, failed, and printed the same command as the way to resume it."""
    folder = _run_folder(tmp_path, "trainer.multi_host=true")
    config, _ = resumed(folder)
    assert config.trainer.multi_host is False
    assert resumed(folder, ["trainer.multi_host=true"])[0].trainer.multi_host is True  # asked for: kept


def test_started_json_is_read_first(tmp_path):
    folder = _run_folder(tmp_path, "trainer.checkpoint_dir=elsewhere/{timestamp}")
    (folder / STARTED).write_text(json.dumps({"timestamp": "2030-05-06_07:08:09", "cwd": str(tmp_path / "w")}))
    _, where = resumed(folder)
    assert (where.timestamp, where.cwd) == ("2030-05-06_07:08:09", tmp_path / "w")
    RunFolder(folder, "2031-01-01_00:00:00", tmp_path).record(RunConfig.read(folder))  # never overwrites the first run's
    assert json.loads((folder / STARTED).read_text())["timestamp"] == "2030-05-06_07:08:09"


def test_what_resume_refuses(tmp_path):
    with pytest.raises(NotARunFolderError, match="does not exist, so there is no run to resume"):
        resumed(tmp_path / "nowhere")
    with pytest.raises(NotARunFolderError, match="holds no run.json"):
        resumed(tmp_path)
    folder = _run_folder(tmp_path, "trackers+={name: mlflow, experiment: e, uri: 'http://ann:hunter2@host:5000'}")
    assert json.loads((folder / "run.json").read_text())["trackers"][1]["uri"] == "http://ann:***@host:5000"
    with pytest.raises(RecipeError, match=r"redacted secrets \(trackers\.1\.uri\).*trackers\.1\.uri=\.\.\."):
        resumed(folder)
    given = "trackers.1.uri=http://ann:hunter2@host:5000"  # given again, the run resumes
    assert resumed(folder, [given])[0].trackers[1].fields["uri"] == "http://ann:hunter2@host:5000"


def test_stars_in_a_recipes_text_are_not_taken_for_a_redacted_secret(tmp_path):
    """Any text holding *** (a prompt, an experiment's name) was refused as a redacted secret, and giving
    it again was refused the same way; only what redaction writes (a whole field, a URI's password or a
    secret query value) is one."""
    folder = _run_folder(tmp_path, "trackers+={name: mlflow, experiment: '*** 17+25=', "
                                   "uri: 'http://host:5000/?token=abc&note=***'}")
    recorded = json.loads((folder / "run.json").read_text())["trackers"][1]
    assert recorded == {"name": "mlflow", "experiment": "*** 17+25=", "uri": "http://host:5000/?token=***&note=***"}
    with pytest.raises(RecipeError, match=r"redacted secrets \(trackers\.1\.uri\)"):  # the token is one
        resumed(folder)
    config, _ = resumed(folder, ["trackers.1.uri=http://host:5000/?token=abc&note=***"])
    assert config.trackers[1].fields["experiment"] == "*** 17+25="


def test_a_resume_refuses_to_move_its_folder_rather_than_drop_the_override(tmp_path, monkeypatch):
    """--resume RUN trainer.checkpoint_dir=OTHER trained on in RUN, OTHER never made, and said to set
    trainer.checkpoint_dir to start fresh."""
    folder = _run_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=r"continues the run in its own folder, so "
                                          r"trainer\.checkpoint_dir=runs/other cannot move it"):
        resumed(folder, ["trainer.checkpoint_dir=runs/other"])
    for same in (str(folder), "runs/tiny-lm/2026-01-02_03-04-05"):  # naming its own folder is no move
        assert resumed(folder, [f"trainer.checkpoint_dir={same}"])[1].directory == folder


def test_the_resume_command_is_the_folder_as_typed_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resume_command(tmp_path / "runs" / "a b") == "dew train --resume 'runs/a b'"
    assert resume_command("/elsewhere/run") == "dew train --resume /elsewhere/run"


def test_a_resume_keeps_what_the_weights_compute_but_not_how(tmp_path):
    """Read against the saved run.json with every model default filled in: a field a resume changes
    that the weights compute (a rope base, a LoRA alpha) is refused; how they compute is not."""
    from dew.recipes.run import ResumedFunctionChangedError, refuse_changed_function

    folder = tmp_path / "run"
    RunConfig.load("tiny-lm-lora").save(folder)
    for same in ([], ["model.rope_base=10000"], ["model.remat=full", "model.dtype=bfloat16", "trainer.steps=9",
                                                 "optimizer.learning_rate=0.1"]):
        refuse_changed_function(RunConfig.load("tiny-lm-lora", overrides=same), folder, 4)  # accepted
    for changed, said in ((["model.rope_base=500000"], "model.rope_base: trained as 10000.0, now 500000"),
                          (["lora.alpha=32"], "lora.alpha: trained as 16.0, now 32.0"),
                          (["model.mlp_activation=gelu"], "model.mlp_activation: trained as 'swiglu', now 'gelu'"),
                          # The base a LoRA run froze, which its exports name: another one trained nothing
                          # else, but run.json then sent `dew export --adapters` to the wrong base.
                          (["init.pretrained=elsewhere"], "init.pretrained: trained as None, now 'elsewhere')")):
        with pytest.raises(ResumedFunctionChangedError, match=re.escape(said)):
            refuse_changed_function(RunConfig.load("tiny-lm-lora", overrides=changed), folder, 4)


def test_a_resume_names_the_fields_its_recipe_changed_beside_the_steps(tmp_path):
    """A resume with data.batch=16 where the checkpoints trained with 8 said nothing of it; the run
    folder written relative then absolute (as a resume records it) is no change."""
    from dew.recipes.resuming import changes_line

    saved = RunConfig.load("tiny-lm", overrides=["trainer.checkpoint_dir=runs/a"]).recorded()

    def line(*overrides):
        return changes_line(saved, RunConfig.load("tiny-lm", overrides=list(overrides)).recorded(), cwd=tmp_path)

    assert line("trainer.checkpoint_dir=runs/a", "trainer.steps=9") is None
    assert line(f"trainer.checkpoint_dir={tmp_path / 'runs/a'}", "trainer.steps=9") is None
    # a moved run's resume rewrites where it lives, which the user did not change
    assert line("trainer.checkpoint_dir=/elsewhere/a", "trackers.0.directory=/elsewhere/a") is None
    assert line("trainer.checkpoint_dir=runs/a", "data.batch=16", "optimizer.learning_rate=0.001") == (
        "The recipe differs from the one its checkpoints trained with: data.batch 32 -> 16, "
        "optimizer.learning_rate 0.003 -> 0.001.")


def test_a_default_a_later_dew_changed_is_read_from_run_json_not_from_this_dew(tmp_path):
    """run.json records the model's defaults as they were when it trained: after an upgrade that
    changes one (here a model registered anew with another rope base), the run's own recipe still
    builds the model it trained, and the shipped recipe that would now build another is refused."""
    from dew import registry
    from dew.nn.backbones import CausalTransformer
    from dew.recipes.run import ResumedFunctionChangedError, build_parts, refuse_changed_function

    class Upgraded(CausalTransformer):  # the same model, as a later dew would default it
        rope_base: float = 500000.0

    folder = tmp_path / "run"
    RunConfig.load("tiny-lm").save(folder)
    recorded = json.loads((folder / "run.json").read_text())["model"]
    assert recorded["rope_base"] == 10000.0 and recorded["norm_epsilon"] == CausalTransformer.norm_epsilon
    with registry.models.temporary("causal_transformer", Upgraded):
        assert build_parts(RunConfig.read(folder), with_data=False).model.rope_base == 10000.0  # as trained
        assert build_parts(RunConfig.load("tiny-lm"), with_data=False).model.rope_base == 500000.0
        refuse_changed_function(RunConfig.read(folder), folder, 4)  # its own recipe resumes
        said = "model.rope_base: trained as 10000.0, now 500000.0"
        with pytest.raises(ResumedFunctionChangedError, match=re.escape(said) + ".*dew train --resume"):
            refuse_changed_function(RunConfig.load("tiny-lm"), folder, 4)


def test_a_write_that_failed_asks_for_a_writable_directory_only_of_a_directory_field(tmp_path):
    """An MLflow URI the library refused is no directory to make writable: the note names the field
    and leaves the what-to-do to the error (it asked to point trackers.0.uri at a directory)."""
    from dew.recipes.folder import _field_note
    from dew.tracking.background import TrackerWriteError

    refused = TrackerWriteError("got unsupported URI 'htp:/bad uri'")
    assert _field_note("trackers.0.uri", tmp_path / "htp:", refused) == "The recipe's trackers.0.uri names it."
    assert _field_note("trackers.0.directory", tmp_path, refused) == (
        "The recipe's trackers.0.directory names it: point trackers.0.directory at a directory this process "
        "can write.")


def test_a_moved_or_copied_folder_keeps_its_trackers_writing_beside_its_checkpoints(tmp_path, monkeypatch):
    """Resumed after a move, the scalars went back to the old path while the checkpoints stayed
    in the folder; after a copy, into the original run's own journal."""
    import shutil

    folder = _run_folder(tmp_path, "trackers+={name: local, directory: shared/tb}")
    (folder / STARTED).write_text(json.dumps({"timestamp": "2026-01-02_03:04:05", "cwd": str(tmp_path)}))
    monkeypatch.chdir(tmp_path)
    config, _ = resumed(folder)  # where it started: nothing moves
    assert [t.fields["directory"] for t in config.trackers] == ["runs/tiny-lm/{timestamp}", "shared/tb"]
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(folder, moved)
    with pytest.warns(SharedTrackerFolderWarning, match=r"a copy of runs/tiny-lm/.*trackers.1.directory \(shared/tb\)"):
        config, where = resumed(moved)
    assert config.trackers[0].fields["directory"] == str(moved)  # it wrote into the run's folder: it follows
    assert config.trackers[1].fields["directory"] == "shared/tb"  # outside it: where the recipe put it
    assert config.trainer.checkpoint_dir == str(moved) and moved in where.directories(config)
    assert folder not in where.directories(config)
    with pytest.warns(SharedTrackerFolderWarning, match=r"trackers.1.directory"):  # shared/tb still is
        given = resumed(moved, [f"trackers.0.directory={tmp_path / 'mine'}"])[0]  # an override still wins
    resumed(moved, [f"trackers.1.directory={tmp_path / 'apart'}"])  # given apart: no word
    assert given.trackers[0].fields["directory"] == str(tmp_path / "mine")


def test_a_tracker_folder_beside_the_run_follows_it_when_it_was_copied_with_it(tmp_path, monkeypatch):
    """exp/ckpt with its journal in exp/logs, copied as exp2: resumed, exp2/ckpt wrote its steps into
    exp/logs, the original's journal. The folder beside the run now follows it when the copy holds it."""
    import shutil

    folder = _run_folder(tmp_path, "trainer.checkpoint_dir=exp/ckpt", "trackers=[{name: local, directory: exp/logs}]")
    (folder / STARTED).write_text(json.dumps({"timestamp": "2026-01-02_03:04:05", "cwd": str(tmp_path)}))
    (tmp_path / "exp" / "logs").mkdir(parents=True)
    shutil.copytree(folder, tmp_path / "exp" / "ckpt")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tmp_path / "exp", tmp_path / "exp2")
    config, _ = resumed(tmp_path / "exp2" / "ckpt")
    assert config.trackers[0].fields["directory"] == str(tmp_path / "exp2" / "logs")
    shutil.move(tmp_path / "exp2", tmp_path / "deeper" / "exp3")  # moved, with the folder beside it
    config, _ = resumed(tmp_path / "deeper" / "exp3" / "ckpt")
    assert config.trackers[0].fields["directory"] == str(tmp_path / "deeper" / "exp3" / "logs")
    (tmp_path / "link").symlink_to(tmp_path / "exp")  # the same folder through a link: no copy, no word
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config, _ = resumed(tmp_path / "link" / "ckpt", ["trackers.0.directory=/elsewhere"])
        assert resumed(tmp_path / "link" / "ckpt")[0].trackers[0].fields["directory"] == "exp/logs"
    shutil.copytree(tmp_path / "exp" / "ckpt", tmp_path / "alone" / "ckpt")  # copied without it: said
    with pytest.warns(SharedTrackerFolderWarning, match=r"a copy of exp/ckpt.*\(exp/logs\) is the original's"):
        config, _ = resumed(tmp_path / "alone" / "ckpt")
    assert config.trackers[0].fields["directory"] == "exp/logs"


def test_a_fresh_run_refuses_the_folder_of_an_exported_model_and_leaves_it_as_it_was(tmp_path, monkeypatch,
                                                                                       capsys):
    """Trained into an export's folder, a run wrote its steps beside the model, and dew generate then
    sampled from the run instead of the model."""
    import jax
    import jax.numpy as jnp

    from dew.cli import main
    from dew.nn.backbones import CausalTransformer
    from dew.pretrained import Pretrained

    model = CausalTransformer(vocab_size=64, emb_features=8, num_layers=1, num_heads=1, mlp_features=16,
                              max_seq_len=8)
    exported = Pretrained(model, model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))).save(tmp_path / "model")
    before = sorted(p.relative_to(exported) for p in exported.rglob("*"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny-lm", "trainer.checkpoint_dir=model", "trainer.steps=1", "trackers=[]"]) == 2
    err = capsys.readouterr().err
    assert "trainer.checkpoint_dir=model holds an exported model (its config.json), not a run" in err, err
    assert "set init.pretrained=model" in err and "Traceback" not in err
    assert sorted(p.relative_to(exported) for p in exported.rglob("*")) == before


def test_started_json_is_written_before_the_first_step(tmp_path, monkeypatch, capsys):
    """A run killed with SIGKILL never reached the record written at its end, so a moved folder's
    --resume could not tell its {timestamp} and sent its journal to a new folder elsewhere."""
    from dew.cli import main
    from dew.plugins import hookimpl, registered

    seen: list[dict] = []

    class Look:
        @hookimpl
        def dew_step_end(self, step):
            seen.extend(json.loads(p.read_text()) for p in tmp_path.glob(f"runs/tiny-lm/*/{STARTED}"))

    monkeypatch.chdir(tmp_path)
    with registered(Look()):
        assert main(["train", "tiny-lm", "trainer.steps=1", "trainer.log_every=1"]) == 0, capsys.readouterr().err
    (folder,) = tmp_path.glob("runs/tiny-lm/*")
    assert [record["timestamp"].replace(":", "-") for record in seen] == [folder.name]
    assert seen[0]["cwd"] == str(tmp_path)


def test_a_run_refused_for_another_writer_leaves_that_writers_new_folder_alone(tmp_path, monkeypatch, capsys):
    """Two runs started at once on one new folder: the refused one removed the folder it had found
    missing, with the winner's lease in it, and a third run then wrote beside the winner."""
    import subprocess
    import sys

    from dew.cli import main

    folder = tmp_path / "runs" / "x"
    holder_code = (
        "import pathlib, sys, time\n"
        "from dew import Checkpoints\n"
        f"folder = pathlib.Path({str(folder)!r})\n"
        "Checkpoints(folder).acquire()\n"
        "(folder / 'run.json').write_text('{}')\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")
    holders: list[subprocess.Popen] = []
    original = RunFolder.record

    def the_other_starts_first(self, config):  # after this run found the folder missing
        holder = subprocess.Popen([sys.executable, "-c", holder_code], stdout=subprocess.PIPE, text=True)
        holders.append(holder)
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        original(self, config)

    monkeypatch.setattr(RunFolder, "record", the_other_starts_first)
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["train", "tiny-lm", "trainer.steps=1", f"trainer.checkpoint_dir={folder}", "trackers=[]"])
        err = capsys.readouterr().err
        assert code == 2 and "CheckpointLeaseHeldError" in err, err
        assert "removed" not in err and "Nothing was kept" not in err
        assert {p.name for p in folder.iterdir()} >= {"run.json", ".dew-writer.json"}
        assert json.loads((folder / ".dew-writer.json").read_text())["pid"] == holders[0].pid
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def test_a_folder_moved_before_it_recorded_its_start_still_keeps_its_journal_beside_it(tmp_path, monkeypatch):
    """No started.json and a path that no longer matches the recipe's {timestamp} template: the
    timestamp is unknown, and every resume sent the scalars to a new folder named for the time then."""
    folder = _run_folder(tmp_path, "trackers+={name: local, directory: 'runs/tiny-lm/{timestamp}/more'}",
                         "trackers+={name: local, directory: 'shared/{timestamp}'}")
    moved = tmp_path / "archive" / "kept"
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.rename(moved.parent.mkdir(parents=True) or moved)
    monkeypatch.chdir(tmp_path)
    config, where = resumed(moved)
    assert where.timestamp is None
    assert [t.fields["directory"] for t in config.trackers] == [
        str(moved), str(moved / "more"), "shared/{timestamp}"]  # the last was never inside the run


def test_a_path_that_starts_in_the_home_folder_is_read_as_a_shell_reads_it(tmp_path, monkeypatch):
    """trainer.checkpoint_dir read ~/ as the home folder, a tracker's directory and data files did not:
    the journal went to a folder named '~' in the working directory, apart from the checkpoints."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    config = RunConfig.load("tiny-lm", ["trainer.checkpoint_dir=~/runs/x", "trackers.0.directory=~/runs/x",
                                        "data.files=~/corpus/*.txt"])
    tracker = config.build_trackers("2026-01-02_03:04:05")
    try:
        assert [t.directory for t in tracker.trackers] == [tmp_path / "home" / "runs" / "x"]
    finally:
        tracker.close()
    assert config.trainer.build_checkpoints("t").directory == tmp_path / "home" / "runs" / "x"
    from dew.placeholders import expand

    assert expand(config.data.fields["files"], "") == str(tmp_path / "home" / "corpus" / "*.txt")
    assert not (tmp_path / "~").exists()


def test_the_profile_window_writes_into_its_expanded_folder(tmp_path, monkeypatch):
    """trainer.profile.directory kept {timestamp} as written: a folder named '{timestamp}' beside the run."""
    from dew.recipes.run import _profile_expanded

    monkeypatch.chdir(tmp_path)
    config = RunConfig.load("tiny-lm", ["trainer.profile={directory: 'runs/prof/{timestamp}', steps: 2}"])
    expanded = _profile_expanded(config.trainer, "2026-01-02_03:04:05")
    assert expanded.profile.directory == str(tmp_path / "runs" / "prof" / "2026-01-02_03-04-05")
    assert expanded.profile.steps == 2 and config.trainer.profile.directory == "runs/prof/{timestamp}"


def test_a_run_started_in_a_folder_this_user_cannot_enter_is_read_from_here(tmp_path, monkeypatch):
    """Another user's run, trained from their home (mode 700): every reader failed with 'Permission
    denied' on the folder it started in, though the recipe named no relative path. (The test runs as
    root, which enters any folder, so the refusal is the system's, made here by os.chdir.)"""
    import os

    from dew.recipes.resuming import started_in

    folder = _run_folder(tmp_path)
    private = tmp_path / "private"
    private.mkdir()
    (folder / STARTED).write_text(json.dumps({"timestamp": "2026-01-02_03:04:05", "cwd": str(private)}))
    chdir = os.chdir

    def refused(path):
        if os.fspath(path) == str(private):
            raise PermissionError(13, "Permission denied", str(path))
        chdir(path)

    monkeypatch.setattr(os, "chdir", refused)
    monkeypatch.chdir(tmp_path)
    with started_in(folder):
        assert os.getcwd() == str(tmp_path)


def test_a_run_whose_start_folder_is_gone_says_its_relative_paths_are_read_from_here(tmp_path, monkeypatch):
    """Moved, and the folder it was trained from removed: dew eval scored whatever data/x.py the
    current folder held, without a word."""
    import os

    from dew.recipes.resuming import StartFolderGoneWarning, started_in

    folder = _run_folder(tmp_path)
    (folder / STARTED).write_text(json.dumps({"timestamp": "2026-01-02_03:04:05", "cwd": str(tmp_path / "gone")}))
    monkeypatch.chdir(tmp_path)
    with pytest.warns(StartFolderGoneWarning, match=f"{tmp_path / 'gone'}, is gone, so the relative paths"):
        with started_in(folder):
            assert os.getcwd() == str(tmp_path)


def test_a_run_started_in_the_second_of_the_last_takes_the_next_seconds_folder(tmp_path, monkeypatch):
    """Two dew train RECIPE run back to back in one second named the same folder, and the second was
    refused (CheckpointLeaseHeldError) where the docs promise each a new one."""
    import dew.recipes.folder as folder_module
    import dew.training.runtime.process as process

    clock = iter(["2026-01-02_03:04:05", "2026-01-02_03:04:05", "2026-01-02_03:04:06"])
    monkeypatch.setattr(process, "run_timestamp", lambda: next(clock))
    monkeypatch.setattr(folder_module.time, "sleep", lambda seconds: None)
    monkeypatch.chdir(tmp_path)
    config = RunConfig.load("tiny-lm", overrides=["trainer.checkpoint_dir=runs/{timestamp}"])
    first = RunFolder.new(config)
    assert first.directory == tmp_path / "runs" / "2026-01-02_03-04-05"
    first.directory.mkdir(parents=True)  # the first run made its folder
    second = RunFolder.new(config)
    assert (second.timestamp, second.directory) == ("2026-01-02_03:04:06", tmp_path / "runs" / "2026-01-02_03-04-06")


def test_a_resume_is_checked_where_it_started_as_it_trains(tmp_path, monkeypatch, capsys):
    """`dew train --resume RUN --check` from another directory refused the run's relative tokenizer
    path, which the resume itself reads from the folder the run started in."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dew.cli import main

    (tmp_path / "start" / "tok").mkdir(parents=True)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "<stop>": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "start" / "tok" / "tokenizer.json"))
    (tmp_path / "start" / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<stop>"}))
    monkeypatch.chdir(tmp_path / "start")
    folder = _run_folder(tmp_path / "start", "data.tokenizer=tok")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["train", "--resume", str(folder), "--check"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["data"]["tokenizer"] == "tok"  # stdout stays the recipe alone
    assert f"Resuming in {tmp_path / 'start'}" in err and Path.cwd() == tmp_path / "elsewhere"


def test_a_lease_recovered_on_resume_is_said_as_dews_own_line(tmp_path, monkeypatch, capsys):
    """After a kill -9, the resume's "Recovering the writer's lease" was printed as
    WARNING:dew.checkpoints:... by the root handler Orbax installs, unlike every other line dew prints."""
    from dew.checkpoints.lease import LEASE, this_process
    from dew.cli import main

    monkeypatch.chdir(tmp_path)
    small = ["model.num_layers=1", "model.emb_features=32", "model.mlp_features=64", "model.num_heads=2",
             "model.max_seq_len=32", "objective.seq_len=16", "objective.preview_tokens=8", "data.length=16",
             "data.batch=4", "data.files={stdlib}/abc.py", "trackers=[]", "trainer.checkpoint_dir=runs/x"]
    assert main(["train", "tiny-lm", *small, "trainer.steps=1"]) == 0
    me = this_process()  # this process, started at another time: a killed writer whose id was reused
    (tmp_path / "runs/x" / LEASE).write_text(json.dumps({"host": me.host, "pid": me.pid, "start": "another-boot/1",
                                                         "taken": 0.0}))
    capsys.readouterr()
    assert main(["train", "--resume", "runs/x", "trainer.steps=2"]) == 0
    err = capsys.readouterr().err
    assert f"dew train: Recovering the writer's lease of {tmp_path / 'runs/x'} from " in err, err
    assert "WARNING:dew" not in err
