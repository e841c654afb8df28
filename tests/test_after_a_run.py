"""What a person meets after a run, through the real `dew` command.

A run is one folder, resumed by name: Ctrl-C and SIGTERM print the command that resumes it,
that command continues the same folder (checkpoints and journal together) and `dew report`
shows the whole run; a crash after a checkpoint says the same. A fixed-folder recipe run again
says in one line that it resumes and how to start fresh. A missing prerequisite is one message,
status 2, and leaves no folder. A run shorter than log_every logs ten times and its last step.

The runs a signal stops, and the fixture's two runs, are `dew` subprocesses sharing one compilation
cache, so only the first compiles the small model's step. A command that ends without a signal (a
refusal, a missing prerequisite, a crash, a report) runs through ``dew.cli.main`` in this process
instead (the function the console script calls; test_recipe_matrix checks they agree, exit codes
included), in the directory it is typed in, its stdout and stderr read.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dew.testing.processes import device_env, shared_compilation_cache

pytestmark = pytest.mark.slow  # every test here runs `dew` (the fixture trains twice)

DEW = Path(sys.executable).with_name("dew")

# tiny-lm, shrunk: the shipped recipe (its {timestamp} folder, its local journal) on a small model.
SMALL = ["model.num_layers=1", "model.emb_features=32", "model.mlp_features=64", "model.num_heads=2",
         "model.max_seq_len=32", "objective.seq_len=16", "objective.preview_tokens=8",
         "data.length=16", "data.batch=4", "data.files={stdlib}/abc.py"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_compilation_cache(tmp_path_factory.mktemp("xla-cache"))


def _env(cache: Path) -> dict[str, str]:
    env = device_env(1, compilation_cache=cache)
    env.pop("DEW_TRACEBACK", None)
    return env


def _dew(args: list[str], cwd: Path, cache: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(DEW), *args], capture_output=True, text=True, cwd=cwd, env=_env(cache),
                          timeout=timeout)


def _logged(run: Path, name: str = "train/loss") -> list[int]:
    return [row["step"] for row in map(json.loads, (run / "scalars.jsonl").read_text().splitlines())
            if name in row]


def _committed(run: Path) -> list[int]:
    return sorted(int(p.name) for p in run.iterdir() if p.name.isdigit() and (p / "dew.json").is_file())


# -- one small run in a fixed folder, then the same command with two more steps ------------------------

class Trained:
    def __init__(self, root: Path, first: subprocess.CompletedProcess, again: subprocess.CompletedProcess):
        self.root, self.first, self.again = root, first, again
        self.run = root / "runs" / "fixed"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Trained:
    root = tmp_path_factory.mktemp("after")
    # no validation split, so dew eval's refusal of a run without one is seen on it
    fixed = ["trainer.checkpoint_dir=runs/fixed", "trackers.0.directory=runs/fixed", "data.load.val_fraction=0",
             "trainer.preview=true"]
    first = _dew(["train", "tiny-lm", *SMALL, *fixed, "trainer.steps=20"], root, cache)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    again = _dew(["train", "tiny-lm", *SMALL, *fixed, "trainer.steps=22"], root, cache)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    return Trained(root, first, again)


def test_a_short_run_logs_ten_times_and_its_last_step(trained: Trained) -> None:
    out = trained.first.stdout
    note = "log_every=100 is more than the run's 20 steps: logging every 2 steps instead (and the last)"
    assert out.count(note) == 1, out[-3000:]
    # the first run logged every other step to its last; the second, 22 steps, its last
    assert _logged(trained.run) == [*range(2, 21, 2), 22]
    assert re.search(r"^step 20: loss \d", out, re.M) and re.search(r"^step 22: loss \d", trained.again.stdout, re.M)


def test_a_closed_pipe_ends_dew_eval_quietly(trained: Trained, cache: Path) -> None:
    """`dew eval RUN | head -2`: eval prints inside the block that turns bad input into one line,
    and a closed pipe is an OSError, so it said "dew eval: [Errno 32] Broken pipe" with status 2."""
    process = subprocess.Popen([str(DEW), "eval", str(trained.run), "--split", "train", "--batches", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=trained.root, env=_env(cache))
    process.stdout.close()  # the reader is gone before eval prints its first line
    _, err = process.communicate(timeout=300)
    assert process.returncode == 141 and not err.strip(), err.decode()


def test_rerunning_a_fixed_folder_says_it_resumes_and_how_to_start_fresh(trained: Trained) -> None:
    lines = [line for line in trained.again.stdout.splitlines() if "runs/fixed" in line and "Resum" in line]
    assert lines == ["Resuming runs/fixed at step 20 (its checkpoints trained with trainer.steps=20), to step "
                     "22; to start fresh instead, train the recipe (not --resume) with trainer.checkpoint_dir set to "
                     "a new folder, or remove "
                     "runs/fixed."], trained.again.stdout[-3000:]
    # the schedule's change is one line of dew's, not Python's warning with its source line
    err = trained.again.stderr.strip().splitlines()
    said = [line for line in err if "learning-rate schedule" in line]
    assert len(said) == 1 and said[0].startswith("dew train: This run resumes at step 20 of checkpoints "
                                                 "trained for 20 steps;"), err
    assert not [line for line in err if "Warning" in line or "warnings.warn" in line or ".py:" in line], err
    assert _committed(trained.run) == [20, 22] and "Resum" not in trained.first.stdout


def test_rerunning_a_finished_folder_with_fewer_steps_keeps_its_recipe_and_reshapes_nothing(
        trained: Trained, tmp_path: Path, cache: Path) -> None:
    """The same command with fewer steps trains nothing, yet it rewrote run.json with those steps (a
    later resume then named the wrong schedule length) and warned that the schedule was reshaped."""
    shutil.copytree(trained.run, tmp_path / "runs" / "fixed")
    recipe = (tmp_path / "runs" / "fixed" / "run.json").read_text()
    fixed = ["trainer.checkpoint_dir=runs/fixed", "trackers.0.directory=runs/fixed", "data.load.val_fraction=0",
             "trainer.preview=true"]
    fewer = _dew(["train", "tiny-lm", *SMALL, *fixed, "trainer.steps=10"], tmp_path, cache)
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert "already holds step 22 (its checkpoints trained with trainer.steps=22), at or past trainer.steps=10: "\
           "nothing to train" in fewer.stdout, fewer.stdout
    # trainer.steps=+2 read as 2 and trained nothing without saying why: the line says what N counts
    assert "trainer.steps=122 trains 100 more; +100 reads as 100" in fewer.stdout, fewer.stdout
    assert "learning-rate schedule" not in fewer.stderr, fewer.stderr
    assert (tmp_path / "runs" / "fixed" / "run.json").read_text() == recipe
    assert json.loads(recipe)["trainer"]["steps"] == 22
    # Another recipe in the finished folder trained nothing and drew its sample from these weights,
    # without a word of the difference (which a resume that trains says).
    other = _dew(["train", "tiny-lm", *SMALL, *fixed, "trainer.steps=10", "optimizer.learning_rate=0.5"],
                 tmp_path, cache)
    assert other.returncode == 0, other.stderr[-3000:]
    assert ("The recipe differs from the one its checkpoints trained with: optimizer.learning_rate 0.003 -> 0.5; "
            "it trains nothing here, as this folder's run is finished") in other.stdout, other.stdout
    assert (tmp_path / "runs" / "fixed" / "run.json").read_text() == recipe
    assert "recipe differs" not in fewer.stdout  # trainer.steps alone is the resuming line's to say


def test_a_resume_whose_newest_step_lost_a_file_does_not_announce_that_step(
        trained: Trained, tmp_path: Path, cache: Path) -> None:
    """It said "Resuming runs/fixed at step 22", then the restore found step 22 damaged and went on
    from step 20."""
    shutil.copytree(trained.run, tmp_path / "runs" / "fixed")
    (tmp_path / "runs" / "fixed" / "22" / "dew.json").unlink()
    fixed = ["trainer.checkpoint_dir=runs/fixed", "trackers.0.directory=runs/fixed", "data.load.val_fraction=0",
             "trainer.preview=true"]
    more = _dew(["train", "tiny-lm", *SMALL, *fixed, "trainer.steps=23"], tmp_path, cache)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "at step 22" not in more.stdout, more.stdout
    assert "step 22 is corrupt" in more.stderr and "Restoring step 20 instead" in more.stderr, more.stderr
    assert _committed(tmp_path / "runs" / "fixed") == [20, 23]


def test_a_resume_of_a_step_another_dew_wrote_says_which_dew_wrote_it(
        trained: Trained, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture) -> None:
    """Each step records the dew that wrote it; a resume after an upgrade says so, once, before training."""
    from importlib import metadata

    from dew.checkpoints.manifest import render_manifest

    run = tmp_path / "runs" / "fixed"
    shutil.copytree(trained.run, run)
    manifest = json.loads((run / "22" / "dew.json").read_text())
    assert manifest["meta"]["dew"]["dew-core"] == metadata.version("dew-core")  # as this dew wrote it
    manifest["meta"]["dew"] = {"dew-core": "0.0.1"}
    (run / "22" / "dew.json").write_bytes(render_manifest({k: v for k, v in manifest.items()
                                                           if k not in ("format", "digest")}))
    # A run.json field this dew does not know, refused: the refusal says which dew wrote the run.
    from dew.cli import main

    recipe = (run / "run.json").read_text()
    (run / "run.json").write_text(json.dumps({**json.loads(recipe), "goodput_every": 10}))
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "goodput_every: unknown field" in err and "The run's newest step was written by dew-core 0.0.1; " \
        f"this is dew-core {metadata.version('dew-core')}" in err and "pip install 'dew-core==0.0.1'" in err, err
    (run / "run.json").write_text(recipe)

    more = _dew(["train", "--resume", "runs/fixed", "trainer.steps=23"], tmp_path, cache)
    assert more.returncode == 0, more.stderr[-3000:]
    said = [line for line in more.stdout.splitlines() if "was written by" in line]
    assert len(said) == 1 and said[0].startswith(
        f"Step 22 was written by dew-core 0.0.1; this is dew-core {metadata.version('dew-core')}"), more.stdout


def test_samples_that_cannot_be_written_are_shown_and_the_folder_named(trained: Trained, tmp_path: Path,
                                                                     cache: Path) -> None:
    """A --out the disk refused said only "[Errno 28] No space left on device" (no file, no fix),
    and the text generated was lost."""
    (tmp_path / "afile").write_text("")
    done = _dew(["generate", str(trained.run), "def ", "--max-new-tokens", "4", "--out", "afile/samples"],
                tmp_path, cache)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("dew generate: The samples could not be written to afile/samples ("), done.stderr
    # not a full disk here (a file where the folder goes): the advice is the folder's, not the disk's
    assert "(Not a directory); choose another --out, a folder (or a name for one) you may write; the text is " \
           "printed above." in done.stderr
    assert done.stdout.startswith("def ")  # the prompt and its continuation, printed all the same


def test_the_sample_is_journaled_with_its_step(trained: Trained) -> None:
    rows = [json.loads(line) for line in (trained.run / "previews.jsonl").read_text().splitlines()]
    assert [(row["step"], row["name"], row["kind"]) for row in rows] == [(20, "sample", "text"), (22, "sample", "text")]
    printed = trained.first.stdout.split("Sample (sample):\n", 1)[1].split("\nUse the run:")[0]
    assert (trained.run / rows[0]["path"]).read_text() == printed  # the text the console showed
    assert printed.startswith("def __init__(self")  # the recipe's prompt, continued


def test_the_report_of_the_run_shows_its_work_in_a_headless_browser(trained: Trained, dew_command,
                                                                     tmp_path: Path) -> None:
    from test_report_browser import rendered

    result = dew_command("report", "runs/fixed", cwd=trained.root)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = rendered(trained.run / "report" / "index.html", tmp_path)
    assert seen["headings"][:2] == ["previews", "charts"]
    # the samples each session journaled, with their steps, as the console printed them
    assert seen["steps"] == ["step 20", "step 22"]
    assert seen["samples"][0] == (trained.run / "previews/sample/step_00000020.txt").read_text().strip()
    charts = {Path(i["src"]).stem: i for i in seen["images"] if i["src"].startswith("plots/")}
    for name in ("loss", "learning_rate", "tokens_per_second", "examples_per_second", "steps_per_second",
                 "step_time", "goodput"):
        assert charts[name]["loaded"] and charts[name]["width"] > 300, (name, sorted(charts))
    assert seen["notes"] == []  # nothing missing: the run logged often and ended
    # the recipe: what this run set beside each default; the full recipe folded away
    chosen = {row[0]: row[1:] for row in seen["set"]}
    assert chosen["trainer.steps"] == ["22", "null"] and chosen["model.num_layers"][0] == "1"
    assert chosen["trainer.checkpoint_dir"] == ["runs/fixed", "null"]
    assert "optimizer.solver" not in chosen and "seed" not in chosen  # left at their defaults
    assert seen["full"] == {"open": False, "shown": False}


def test_after_a_run_refusals_are_one_message(trained: Trained, capsys: pytest.CaptureFixture) -> None:
    from dew.cli import main

    cases = [
        (["train", "--resume", str(trained.root / "nowhere")], "does not exist, so there is no run to resume"),
        (["train", str(trained.run)], "is a run's folder, not a recipe: continue it with dew train --resume"),
        # A live run's resume is refused by its lease: its recipe file is what dew plan reads.
        (["plan", str(trained.run), "--devices", "2"], f"or give its recipe, {trained.run / 'run.json'}, where"),
        (["train", str(trained.root)], "is a directory, not a recipe: give a recipe's YAML file or a shipped"),
        (["train", "--resume", str(trained.run), "tiny-lm"], "give key=value overrides after it"),
        (["eval", str(trained.run)], "the run's data has no validation split; set data.load.val_fraction in "
                                     "its recipe, or pass --split train"),
        (["generate", str(trained.root), "x"], "holds neither run.json"),
        # the file for its folder: it was said to hold neither file
        (["generate", str(trained.run / "run.json"), "x"],
         f"run.json is a file, not a directory: a run's directory (its trainer.checkpoint_dir) or an exported "
         f"model's is what is read; give the folder that holds it, {trained.run}."),
        (["eval", str(trained.run / "scalars.jsonl")], "scalars.jsonl is a file, not a directory"),
        (["eval", str(trained.run), "--task", "generation", "--split", "train"],
         "--split and --batches choose what the objective's own metrics score"),
        (["eval", str(trained.run), "--task", "generation", "--batches", "2"], "a --task scores its own file"),
        (["eval", str(trained.run), "--set", "file=x.jsonl"], "--set gives a field of an evaluation task"),
        (["generate", str(trained.run), "x", "--top-k", "5"], "top_k only narrows what sampling draws from"),
        (["generate", str(trained.run), "x", "--count", "2"], "count=2 without a temperature (or at 0) repeats one"),
        # named as typed, where Sampling's own field was named ("Sampling.top_p ... or be None")
        (["generate", str(trained.run), "x", "--temperature", "1", "--top-p", "0"],
         "top_p (--top-p) must be above 0 and at most 1, got 0.0."),
        # past 64 bits: an OverflowError's traceback from jax.random.key
        (["generate", str(trained.run), "x", "--temperature", "1", "--seed", str(2**63)],
         "seed must be a 64-bit integer (below 2**63 = 9223372036854775808 in size), got 9223372036854775808"),
        (["train", "--resume", str(trained.run), "model.rope_base=500000"],
         "this recipe changes what the run's weights compute (model.rope_base: trained as 10000.0, now 500000)"),
    ]
    recipe = (trained.run / "run.json").read_text()
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"dew {argv[0]}: ") and expected in err and "Traceback" not in err, (argv, err)
        assert "trackers.0.directory names it" not in err, err  # the run's own folder is no prerequisite
    assert (trained.run / "run.json").read_text() == recipe  # a refused resume rewrites no recipe
    # the error itself, with its traceback, one flag away (before or after the command)
    from dew.recipes.folder import NotARunFolderError

    for argv in (["--traceback", "train", "--resume", "nowhere"], ["train", "--resume", "nowhere", "--traceback"]):
        with pytest.raises(NotARunFolderError):
            main(argv)


def test_a_run_folder_named_in_bytes_that_are_no_utf8_is_refused_by_name_and_reported(
        trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Orbax's storage cannot open such a path: training failed at its first save with pybind11's
    "Unable to cast Python instance", and generate, eval and export showed that traceback; the
    report's page could not be written (UnicodeEncodeError)."""
    import os

    from dew.cli import main

    odd = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xff"))
    run = shutil.copytree(trained.run, odd / "run")
    for argv in (["generate", str(run), "x"], ["export", str(run), str(tmp_path / "out")],
                 ["eval", str(run), "--split", "train", "--batches", "1"],
                 ["train", "tiny-lm", f"trainer.checkpoint_dir={odd / 'fresh'}", "trainer.steps=1"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "bad\\udcff" in err and "names bytes that are no UTF-8 text" in err, (argv, err)
        assert "Rename the folder" in err and "Traceback" not in err, err
    assert not (odd / "fresh").exists() and not (tmp_path / "out").exists()
    assert main(["report", str(run), "--out", str(tmp_path / "page")]) == 0
    page = (tmp_path / "page" / "index.html").read_text(encoding="utf-8")
    assert "bad\\udcff" in page  # the folder's name, escaped, on a page that is UTF-8


def test_a_damaged_step_or_recipe_is_named_with_what_to_read_instead(trained: Trained, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:

    from dew.cli import main

    kept = _committed(trained.run)
    assert len(kept) >= 2, kept
    copy = shutil.copytree(trained.run, tmp_path / "copy")
    (copy / str(kept[-1]) / "dew.json").unlink()
    assert main(["generate", str(copy), "def "]) == 2
    err = capsys.readouterr().err
    assert f"Checkpoint step {kept[-1]} is corrupt: {copy / str(kept[-1]) / 'dew.json'}: dew's manifest is missing" in err
    assert f"read an intact kept step with --step {kept[-2]} (kept: {kept})" in err and "Traceback" not in err
    assert main(["generate", str(copy), "def ", "--step", str(kept[-2]), "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    # The manifest whole again, but the step's largest file cut short: the same way on.
    shutil.copy(trained.run / str(kept[-1]) / "dew.json", copy / str(kept[-1]) / "dew.json")
    largest = max((p for p in (copy / str(kept[-1]) / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    assert main(["generate", str(copy), "def "]) == 2
    err = capsys.readouterr().err
    assert f"Checkpoint step {kept[-1]} is corrupt" in err and "Traceback" not in err, err
    assert f"read an intact kept step with --step {kept[-2]} (kept: {kept}), or resume the run (dew train " \
        f"--resume), which trains on from step {kept[-2]}" in err, err
    # Every kept step damaged: the older step was advised though it was damaged too, and a resume was
    # said to start over (it stops: nothing is intact) and then called the run's training done.
    ruined = shutil.copytree(copy, tmp_path / "ruined")
    for step in kept[:-1]:
        cut = max((p for p in (ruined / str(step) / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        cut.write_bytes(cut.read_bytes()[:1000])
    for argv in (["generate", str(ruined), "def "], ["eval", str(ruined), "--step", str(kept[-2])]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"no other kept step is intact (kept: {kept}), so the run cannot be resumed: restore its steps' " \
            "files from a copy, or train it again in a new folder" in err and "--step" not in err, err
    assert main(["train", "--resume", str(ruined)]) == 2
    err = capsys.readouterr().err
    assert "none of its kept steps is intact, so it cannot be resumed" in err and "training is done" not in err, err
    assert _committed(ruined) == kept  # nothing set aside or removed
    # Resumed as it stands, the finished run falls back to the older step and trains on: it said
    # "nothing to train" first.
    again = shutil.copytree(copy, tmp_path / "again")
    assert main(["train", "--resume", str(again)]) == 0
    out, err = capsys.readouterr()
    assert "nothing to train" not in out + err and f"Restoring step {kept[-2]} instead" in err, (out, err)
    assert _committed(again)[-1] == kept[-1]
    # An exported model keeps no steps: --step is refused rather than ignored.
    assert main(["export", str(trained.run), str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "exported"), "def ", "--step", "3"]) == 2
    assert "is an exported model, which keeps no steps, so --step 3 has nothing to choose" in capsys.readouterr().err

    (copy / "run.json").write_text((trained.run / "run.json").read_text()[:50])  # torn mid-string
    assert main(["generate", str(copy), "def "]) == 2
    err = capsys.readouterr().err
    assert f"{copy / 'run.json'} cannot be read as a run's recipe (Unterminated string" in err, err

    # a run that is not there, and an export whose folder is a file, are one message each
    assert main(["generate", str(tmp_path / "nowhere"), "x"]) == 2
    assert f"{tmp_path / 'nowhere'} does not exist. Give a run's directory" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("in the way")
    assert main(["export", str(trained.run), str(tmp_path / "a-file" / "out")]) == 2
    err = capsys.readouterr().err
    assert f"dew export: {tmp_path / 'a-file' / 'out'}'s folder {tmp_path / 'a-file'} cannot be made" in err, err
    assert (tmp_path / "a-file").read_text() == "in the way"

    # a count of zero or less is refused where it is typed, not read as the default
    for argv in (["generate", str(trained.run), "x", "--max-new-tokens", "0"], ["eval", str(trained.run), "--batches", "-1"]):
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2
        assert "is not at least 1" in capsys.readouterr().err


# -- Ctrl-C, then the printed command, then SIGTERM, then dew report: one folder -------------------------

def _stopped(command: list[str], cwd: Path, cache: Path, at: str, sig: int) -> tuple[int, str, str]:
    """Run command and send sig once it prints the line at (the run is then past that step)."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                             env=_env(cache))
    assert child.stdout is not None and child.stderr is not None
    lines = []
    for line in child.stdout:
        lines.append(line)
        if re.match(at, line):
            child.send_signal(sig)
            break
    out, err = child.communicate(timeout=300)
    return child.returncode, "".join(lines) + out, err


def test_ctrl_c_and_sigterm_print_the_command_that_resumes_one_folder(tmp_path: Path, cache: Path,
                                                                     dew_command) -> None:
    code, out, err = _stopped([str(DEW), "train", "tiny-lm", *SMALL, "trainer.steps=100000",
                               "trainer.log_every=1"], tmp_path, cache, r"^step 3: loss", signal.SIGINT)
    assert code == 130, err[-3000:]
    said = err.strip().splitlines()[-1]
    found = re.fullmatch(r"dew train: interrupted \(Ctrl-C\) at step (\d+); its checkpoint, data position and "
                         r"journal are in (runs/tiny-lm/[\d_-]+)\. Resume with: (dew train --resume \2)", said)
    assert found, err[-3000:]
    first, folder, command = int(found.group(1)), found.group(2), found.group(3)
    assert "Traceback" not in err and first >= 3

    code, out, err = _stopped(shlex.split(command.replace("dew", str(DEW), 1)), tmp_path, cache,
                              rf"^step {first + 2}: loss", signal.SIGTERM)
    assert code == 143, err[-3000:]
    assert f"Training from step {first} to 100000" in out
    said = err.strip().splitlines()[-1]
    second = int(re.fullmatch(rf"dew train: preempted at step (\d+); its checkpoint, data position and journal "
                              rf"are in {folder}\. Resume with: {command}", said).group(1))
    assert second > first

    report = dew_command("report", folder, cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    run = tmp_path / folder
    assert [p.name for p in (tmp_path / "runs" / "tiny-lm").iterdir()] == [run.name]  # one folder
    assert _committed(run) == [first, second]  # both stops' checkpoints
    assert _logged(run) == list(range(1, second + 1))  # the journal continues, each step once
    started = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [row["record"]["start"] for row in started if row["type"] == "run_started"] == [0, first]
    page = (run / "report" / "index.html").read_text()
    assert re.search(rf"<td>train/loss</td><td>{second}</td>", page)


def test_a_crash_after_a_checkpoint_prints_the_command_that_resumes(tmp_path: Path, dew_command) -> None:
    """A learning rate of 1e30 makes every step after the first non-finite: the run stops, named."""
    result = dew_command("train", "tiny-lm", *SMALL, "trainer.steps=100", "trainer.log_every=1",
                         "trainer.checkpoint_every=1", "optimizer.learning_rate=1e30", "optimizer.clip_norm=null",
                         cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("dew train: NonFiniteLossError: ") and "Traceback" not in result.stderr
    resume = next(line for line in lines if "resume it with" in line)
    folder = re.search(r"The run is in (runs/tiny-lm/[\d_-]+) \(its newest checkpoint is step (\d+)\); once "
                       r"fixed, resume it with: dew train --resume \1$", resume.strip())
    assert folder, lines
    assert _committed(tmp_path / folder.group(1))[-1] == int(folder.group(2))


# -- a missing prerequisite: one message, status 2, no folder --------------------------------------------

PREREQUISITES = {
    "teacher": (["tiny-distill", "data.files={stdlib}/abc.py", "data.load.val_fraction=0",
                             "trainer.eval_every=null"], "CheckpointNotFoundError",
                "objective.teacher_checkpoint"),
    "base run": (["addition-dpo"], "CheckpointNotFoundError", "init.run"),
    "export": (["tiny-lm-sft"], "NoPretrainedModelError", "init.pretrained"),
    "tokenizer": (["tiny-lm", *SMALL, "data.tokenizer=missing/tokenizer.json"], "does not exist",
                  "data.tokenizer"),
    "validation split": (["tiny-lm", *SMALL, "data.load.val_fraction=0", "trainer.eval_every=5"], "holds none out",
                         "data.load.val_fraction"),
    "data glob": (["tiny-lm", *SMALL, "data.files=nothing/*.py"], "matches no file", "data.files"),
}


@pytest.mark.parametrize("missing", sorted(PREREQUISITES))
def test_a_missing_prerequisite_is_one_message_and_no_folder(missing: str, tmp_path: Path, dew_command) -> None:
    args, error, field = PREREQUISITES[missing]
    result = dew_command("train", *args, "trainer.steps=2", cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    first = result.stderr.strip().splitlines()[0]
    assert first.startswith("dew train: ") and error in first, result.stderr
    assert field in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "ParamsFrom" not in result.stderr, result.stderr  # the recipe's words, not dew's internals
    assert len(result.stderr.strip().splitlines()) <= 4, result.stderr
    assert not (tmp_path / "runs").exists(), list(tmp_path.rglob("*"))  # nothing left behind
    assert "Nothing was kept: the run failed before" in result.stderr, result.stderr  # and it says so


def test_a_warmup_as_long_as_the_run_is_noted_once(trained: Trained) -> None:
    """tiny-lm warms up over 20 updates: shortened to 20 steps (as the docs' first command shortens
    it), its learning rate never reaches the recipe's peak and the cosine decay never starts."""
    out = trained.first.stdout
    assert out.count("note: optimizer.warmup_steps=20 spans all of the run's 20 updates") == 1, out[-3000:]
    assert "warmup_steps" not in trained.again.stdout  # 22 steps: the warmup ends within the run


def test_a_newest_step_the_live_run_removes_while_it_is_read_is_read_again_at_the_new_newest(
        trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run training with trainer.keep=1 saves step N+1 and removes step N while `dew generate` reads
    N: the read failed (as 'corrupt', a mismatch, or a traceback from Orbax) in 21 of 48 tries. Here
    the writer's save and removal land between the reader's listing and its read, as they did."""
    from dew.checkpoints.manifest import render_manifest
    from dew.checkpoints.store import Store, remove_step
    from dew.recipes import opening

    run = shutil.copytree(trained.run, tmp_path / "run")
    read = opening._read_step
    calls = []

    def racing(objective, directory, store, kept, number):
        calls.append(number)
        if len(calls) == 1:  # the live writer commits the next step and removes this one
            shutil.copytree(run / str(number), run / str(number + 2))
            manifest = json.loads((run / str(number + 2) / "dew.json").read_text())
            manifest["step"] = number + 2
            (run / str(number + 2) / "dew.json").write_bytes(render_manifest(
                {k: v for k, v in manifest.items() if k not in ("format", "digest")}))
            remove_step(Store(run, local=False), number)
        return read(objective, directory, store, kept, number)

    monkeypatch.setattr(opening, "_read_step", racing)
    opened = opening.open_run(run)
    assert calls == [22, 24] and opened.step == 24
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # nothing of the removal left
    calls.clear()
    with pytest.raises(opening.NoCheckpointError, match="Step 24 of .* was removed while it was read"):
        opening.open_run(run, step=24)


def test_the_audit_vouches_only_for_steps_a_committed_checkpoint_holds(trained: Trained, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """The ledger's lines of a step are written as its checkpoint's save begins: killed during that save
    (or read while it is under way), the audit called the run identical through a step no checkpoint holds."""
    from dew.cli import main

    run = shutil.copytree(trained.run, tmp_path / "run")
    lines = (run / "ledger.jsonl").read_text().splitlines()
    last = json.loads(next(line for line in reversed(lines) if '"kind": "step"' in line or '"kind":"step"' in line))
    assert last["step"] == 22 and _committed(run)[-1] == 22
    size = last["end"] - last["first"]
    more = [{"kind": "step", "step": 22 + i, "first": last["end"] + (i - 1) * size, "end": last["end"] + i * size,
             "digest": "d"} for i in (1, 2)]  # steps 23 and 24, consistent positions, their save not committed
    (run / "ledger.jsonl").write_text("\n".join([*lines, *map(json.dumps, more)]) + "\n")
    assert main(["audit", str(run)]) == 0
    out = capsys.readouterr().out
    assert "identical through step 22 to an uninterrupted run" in out, out
    assert "2 step(s) after step 22 are in the ledger but in no committed checkpoint" in out, out


def test_a_resume_over_a_corpus_edited_in_place_is_refused_naming_it(tmp_path: Path, cache: Path) -> None:
    """The same number of bytes, other text: the saved position (records, seed, size) fitted, and the
    resume trained on other records without a word (dew audit then called it identical)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i:03d} of the corpus with some words\n" for i in range(200)))
    shrunk = [o for o in SMALL if not o.startswith("data.files")]
    args = ["train", "tiny-lm", *shrunk, f"data.files={corpus}", "data.load.val_fraction=0",
            "trainer.eval_every=null", "trainer.checkpoint_dir=runs/r", "trackers.0.directory=runs/r"]
    first = _dew([*args, "trainer.steps=3"], tmp_path, cache)
    assert first.returncode == 0, first.stderr[-3000:]
    corpus.write_text(corpus.read_text().upper()[::-1])  # as many bytes, so as many windows
    again = _dew(["train", "--resume", "runs/r", "trainer.steps=5"], tmp_path, cache)
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-3000:]
    assert "as many records, other contents" in again.stderr and "Traceback" not in again.stderr, again.stderr
    assert _committed(tmp_path / "runs" / "r") == [3]


def test_a_run_whose_folder_is_a_numbered_folder_inside_another_run_is_refused(
        trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """It trained there; the outer run then took the folder for its step 9: dew generate called that
    step corrupt, and the outer run's resume set it aside as damaged."""
    from dew.cli import main

    run = shutil.copytree(trained.run, tmp_path / "run")
    inner = run / "9"
    assert main(["train", "tiny-lm", *SMALL, f"trainer.checkpoint_dir={inner}", f"trackers.0.directory={inner}",
                 "trainer.steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dew train: trainer.checkpoint_dir=") and "is a numbered folder inside the run" in err, err
    assert not inner.exists() and _committed(run) == [20, 22]
