"""`dew diff` and `dew audit` on real runs of the shipped tiny-lm recipe (shrunk by overrides).

The runs are trained once per module, each by `dew train` (or `dew launch`) in a fresh
interpreter sharing one compilation cache, and shared between the tests:

* ref: one process, one device, 10 steps, a checkpoint every step, a batch ramp (4 then 8 rows);
* again: ref trained again into another directory;
* lr: ref with another learning rate;
* eight: ref on 8 fake devices (data 4 x tensor 2);
* pool: `dew launch -n 2` (two processes, two data shares), stopped by SIGTERM early, resumed
  with `dew launch -n 1` to step 10.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dew.cli import main
from dew.data.order import RecordOrder
from dew.testing.processes import device_env, shared_compilation_cache
from dew.training.ledger import records_digest

STEPS = 10
COMMON = [
    "model.num_layers=1", "model.emb_features=32", "model.mlp_features=64", "model.num_heads=2",
    "data.files={stdlib}/[a-b]*.py", "data.batch=8", "trainer.batch_ramp={start: 4, steps: 4}",
    "objective.prompt=null", "optimizer.schedule=constant", "optimizer.warmup_steps=0",
    "trainer.log_every=1", "trainer.keep=null",
]


def _recipe(run: Path, *extra: str) -> list[str]:
    return ["tiny-lm", *COMMON, f"trainer.checkpoint_dir={run}", f"trackers.0.directory={run}", *extra]


class Runs:
    """Trains each run on first use, in a fresh interpreter; later uses share it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache = shared_compilation_cache(root / "compilation-cache")
        self.made: dict[str, Path] = {}

    def env(self, devices: int = 1) -> dict[str, str]:
        return device_env(devices, compilation_cache=self.cache)

    def train(self, name: str, *extra: str, devices: int = 1, steps: int = STEPS) -> Path:
        if name not in self.made:
            run = self.root / name
            done = subprocess.run([sys.executable, "-m", "dew.cli", "train",
                                   *_recipe(run, f"trainer.steps={steps}", "trainer.checkpoint_every=1", *extra)],
                                  capture_output=True, text=True, env=self.env(devices), cwd=self.root, timeout=600)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            self.made[name] = run
        return self.made[name]

    @property
    def ref(self) -> Path:
        return self.train("ref")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"))


def _dew(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- dew diff -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_identical_runs_are_identical_through_their_last_step(runs, capsys):
    again = runs.train("again")
    code, out, _ = _dew(["diff", str(runs.ref), str(again)], capsys)
    assert code == 0, out
    assert out.splitlines()[0] == f"identical through step {STEPS}"
    assert f"states: identical at every common kept step ({STEPS}, through step {STEPS})" in out
    # The recipes differ only in where each run writes.
    differing = re.findall(r"^  (\S+): ", out.split("recipes differ:")[1], flags=re.M)
    assert set(differing) == {"trainer.checkpoint_dir", "trackers.0.directory"}


@pytest.mark.slow
def test_a_non_finite_loss_is_spelt_in_diff_json_as_the_journal_spells_it(runs, tmp_path, capsys):
    """dew diff --json wrote a bare NaN, which JSON has not (a strict parser refuses the output)."""
    import shutil

    copy = shutil.copytree(runs.ref, tmp_path / "diverged")
    rows = [json.loads(line) for line in (copy / "scalars.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "train/loss" in row]
    logged[0]["train/loss"] = "NaN"  # as the journal holds a rejected step's loss
    (copy / "scalars.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is no JSON")

    code, out, _ = _dew(["diff", str(copy), str(runs.ref), "--json"], capsys)
    result = json.loads(out, parse_constant=strict)
    assert result["first_loss"]["step"] == logged[0]["step"] and result["first_loss"]["a"] == "NaN", result


@pytest.mark.slow
def test_a_plugin_upgraded_between_two_runs_is_a_row_of_the_recipe_diff(runs, tmp_path, capsys):
    """started.json records which distribution and version registered each component; two runs made
    with different versions of one are told apart, though their recipes are the same."""
    import shutil

    copy = shutil.copytree(runs.ref, tmp_path / "upgraded")
    started = json.loads((copy / "started.json").read_text())
    before = started["components"]["objectives/lm"]
    assert before.startswith("dew-objectives ")
    started["components"]["objectives/lm"] = "dew-objectives 99.0"
    (copy / "started.json").write_text(json.dumps(started))
    code, out, _ = _dew(["diff", str(runs.ref), str(copy), "--json"], capsys)
    rows = {key: (a, b) for key, a, b in json.loads(out)["recipe"]}
    assert rows == {"installed.objectives/lm": (before, "dew-objectives 99.0")}, rows


@pytest.mark.slow
def test_a_changed_learning_rate_parts_at_step_one_at_the_parameters_alone(runs, capsys):
    changed = runs.train("lr", "optimizer.learning_rate=0.001")
    code, out, _ = _dew(["diff", str(runs.ref), str(changed), "--json"], capsys)
    assert code == 1
    result = json.loads(out)
    assert result["first_state_step"] == 1
    # Independently: at step 1 both runs differentiate the same parameters on the same batch, so
    # Adam's moments agree, and only the update (the learning rate times it) differs; every
    # trainable parameter moves at step 1 (no warmup), so the parameters, all of them, part.
    manifest = json.loads((runs.ref / "1" / "dew.json").read_text())
    parameters = [leaf["path"] for leaf in manifest["leaves"] if leaf["path"].startswith(".params['params']")]
    assert result["differing"] == parameters
    assert result["differing"][0] == manifest["leaves"][0]["path"] == ".params['params']['embed']['embedding']"
    assert result["first_loss"]["step"] == 2  # the first loss computed with the updated weights
    assert ["optimizer.learning_rate", 0.003, 0.001] in result["recipe"]


@pytest.mark.slow
def test_eight_devices_agree_with_one_within_the_tolerance(runs, capsys, caplog):
    eight = runs.train("eight", "trainer.mesh.tensor=2", devices=8)
    code, out, err = _dew(["diff", str(runs.ref), str(eight), "--load", "--rtol", "1e-3", "--atol", "1e-5"], capsys)
    assert code == 0, out
    warned = [r.getMessage() for r in caplog.records if "Metadata file does not exist" in r.getMessage()]
    assert not warned and "Metadata file does not exist" not in err, warned  # Orbax's, at each read of leaves
    assert out.splitlines()[0].startswith("agree within the tolerance (rtol 0.001, atol 1e-05) through step 10")
    assert "losses: within the tolerance at all 10 common logged steps" in out or "losses: equal" in out
    # The gaps were measured, in the state's own leaves, at two steps.
    gaps = re.findall(r"^  step (\d+) (\S+): largest gap (\S+)", out, flags=re.M)
    assert gaps and all(float(gap) <= 1e-5 + 1e-3 for _, _, gap in gaps)


@pytest.mark.slow
def test_runs_of_different_models_are_compared_where_comparable(runs, capsys):
    other = runs.train("heads", "model.num_heads=4", steps=2)
    code, out, _ = _dew(["diff", str(runs.ref), str(other), "--json"], capsys)
    result = json.loads(out)
    assert code == 1
    assert "model.num_heads" in result["models_differ"]
    # The attention kernels change shape with the head count: not comparable; the rest is.
    assert ".params['params']['layers_0']['attention']['query']" in result["incomparable"]
    assert result["first_state_step"] == 1
    assert ".params['params']['layers_0']['mlp']['wi']" in result["differing"]
    assert result["common_steps"] == [1, 2]
    text = _dew(["diff", str(runs.ref), str(other)], capsys)[1]
    assert "the runs train different models (model.num_heads)" in text


def test_runs_whose_weights_share_no_shape_are_not_called_identical_at_their_kept_steps(runs, capsys):
    """Two widths: every parameter differs in shape, only counters and keys were compared, and the
    diff said "states: identical at every common kept step"."""
    other = runs.train("wider", "model.emb_features=48", "model.mlp_features=96", steps=2)
    code, out, _ = _dew(["diff", str(runs.ref), str(other), "--json"], capsys)
    result = json.loads(out)
    assert code == 1 and result["weights_compared"] is False and result["first_state_step"] is None
    text = _dew(["diff", str(runs.ref), str(other)], capsys)[1]
    assert "identical at every common kept step" not in text
    assert "states: no parameter is held by both runs in one shape and dtype, so their weights were not " \
           "compared" in text
    heads = _dew(["diff", str(runs.ref), str(runs.train("heads", "model.num_heads=4", steps=2)), "--json"],
                 capsys)[1]
    assert json.loads(heads)["weights_compared"] is True


@pytest.mark.slow
def test_losses_that_are_nan_in_both_runs_are_the_same(runs, tmp_path, capsys):
    """A diverged run and its rerun log NaN at the same steps: identical, not parted at the first NaN."""
    def copy(name: str, losses: dict[int, object]) -> Path:
        run = tmp_path / name
        shutil.copytree(runs.ref, run)
        rows = [json.loads(line) for line in (run / "scalars.jsonl").read_text().splitlines()]
        for row in rows:
            if row.get("step") in losses and "train/loss" in row:
                row["train/loss"] = losses[row["step"]]
        (run / "scalars.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return run

    diverged = {step: "NaN" for step in range(3, STEPS + 1)}  # as LocalTracker journals a NaN
    first, second = copy("nan-a", diverged), copy("nan-b", diverged)
    code, out, _ = _dew(["diff", str(first), str(second)], capsys)
    assert code == 0 and out.splitlines()[0] == f"identical through step {STEPS}", out
    assert f"losses: equal at all {STEPS} common logged steps (largest gap 0 at step" in out
    # A number where the other run logged NaN parts there, and is the largest gap.
    third = copy("nan-c", {**diverged, 5: 1.5})
    code, out, _ = _dew(["diff", str(first), str(third), "--json"], capsys)
    result = json.loads(out)
    assert code == 1 and result["first_loss"]["step"] == 5 and result["largest_loss"]["step"] == 5, out


def test_runs_of_different_objectives_do_not_part_at_their_losses(runs, tmp_path, capsys):
    """A GRPO run and a DPO run were said to part at step 1 by their losses (a policy loss beside a
    sigmoid loss); the objectives are named and the losses left uncompared."""
    other = shutil.copytree(runs.ref, tmp_path / "other")
    recipe = json.loads((other / "run.json").read_text())
    named = recipe["objective"]["name"]
    recipe["objective"]["name"] = "distill"
    (other / "run.json").write_text(json.dumps(recipe))
    code, out, _ = _dew(["diff", str(runs.ref), str(other)], capsys)
    assert f"objective.name: {named} -> distill" in out, out  # the states are the same, and are compared
    assert f"note: the runs train different objectives ({named} and distill): their losses measure different " \
        "things, so they are not compared" in out, out
    assert not any(line.startswith("losses: ") for line in out.splitlines()) and "hold none" not in out, out


def test_the_tools_say_when_a_run_is_still_being_trained(runs, tmp_path, capsys):
    """dew audit, diff and report on a run a live process still trained answered as if it had ended
    (audit: "identical through step 14", exit 0); each says the run is still being trained, by whom."""
    from dew.checkpoints.lease import acquire, release

    live = shutil.copytree(runs.ref, tmp_path / "live")
    acquire(live)  # the writer's lease, as a training holds it: this process, alive
    try:
        for argv in (["audit", str(live)], ["diff", str(runs.ref), str(live)],
                     ["report", str(live), "--out", str(tmp_path / "page")]):
            code, _, err = _dew(argv, capsys)
            assert code == 0, (argv, err)
            assert f"note: {live} is still being trained (process {os.getpid()} on host" in err, (argv, err)
            assert str(runs.ref) + " is still" not in err
    finally:
        release(live)
    code, _, err = _dew(["audit", str(live)], capsys)
    assert code == 0 and "still being trained" not in err


@pytest.mark.slow
def test_leaves_one_run_lacks_are_named_and_its_journal_found_from_anywhere(runs, tmp_path, monkeypatch, capsys):
    """A run with a loss scale holds leaves the other does not: not identical, and named in the text.
    Its tracker wrote, by a relative path, outside its checkpoint directory; dew diff run elsewhere
    finds that journal where the run started."""
    runs.train("scaled", "trainer.dynamic_scale=true", "trainer.checkpoint_dir=scaled/ckpt",
               "trackers.0.directory=scaled/log", steps=2)
    scaled = runs.root / "scaled" / "ckpt"
    assert (runs.root / "scaled" / "log" / "scalars.jsonl").is_file() and not (scaled / "scalars.jsonl").exists()
    monkeypatch.chdir(tmp_path)
    code, out, _ = _dew(["diff", str(runs.ref), str(scaled)], capsys)
    assert code == 1 and out.splitlines()[0].startswith("the runs differ"), out
    (named,) = [line for line in out.splitlines() if "not comparable" in line]
    assert ".scaler.scale" in named and ".scaler.streak" in named, named
    assert any(line.startswith("losses: ") for line in out.splitlines()), out
    assert "hold none" not in out


def test_a_copy_whose_recipe_names_the_originals_journal_is_not_compared_by_it(runs, tmp_path, capsys):
    """A copied run without its own journal: its recipe still names the original's tracker folder, and
    dew diff compared the original's losses with themselves ("equal at all 10 common logged steps")."""
    copy = tmp_path / "copy"
    shutil.copytree(runs.ref, copy)
    (copy / "scalars.jsonl").unlink()
    code, out, _ = _dew(["diff", str(runs.ref), str(copy)], capsys)
    assert f"both runs name one journal, {runs.ref / 'scalars.jsonl'}" in out, out
    assert "losses: equal" not in out and "hold none" not in out, out


@pytest.mark.slow
def test_dew_report_reads_a_run_whose_tracker_wrote_outside_its_folder(runs, tmp_path, monkeypatch, capsys):
    """dew report RUN said the run's folder holds no scalars.jsonl when its recipe's local tracker
    wrote elsewhere, where dew diff found it."""
    runs.train("scaled", "trainer.dynamic_scale=true", "trainer.checkpoint_dir=scaled/ckpt",
               "trackers.0.directory=scaled/log", steps=2)
    monkeypatch.chdir(tmp_path)
    code, out, err = _dew(["report", str(runs.root / "scaled" / "ckpt"), "--out", str(tmp_path / "page")], capsys)
    assert code == 0, err
    page = (tmp_path / "page" / "index.html").read_text()
    assert "train/loss" in page and str(runs.root / "scaled" / "log") in page


def test_runs_that_keep_no_step_in_common_are_not_called_identical(runs, tmp_path, capsys):
    """Equal losses alone said "identical" with exit 0 though no state was compared; and tolerances
    that are no tolerance were taken."""
    bare = tmp_path / "bare"
    shutil.copytree(runs.ref, bare)
    for step in [p for p in bare.iterdir() if p.is_dir() and p.name.isdigit()]:
        shutil.rmtree(step)
    code, out, _ = _dew(["diff", str(runs.ref), str(bare)], capsys)
    assert code == 2 and out.splitlines()[0].startswith("not compared: the runs keep no step in common"), out
    assert f"losses: equal at all {STEPS} common logged steps" in out
    for flag in (["--rtol", "-5"], ["--atol", "nan"]):
        code, _, err = _dew(["diff", str(runs.ref), str(runs.ref), *flag], capsys)
        assert code == 2 and f"{flag[0]} " in err and "is not a tolerance" in err, err


def test_a_path_that_is_not_a_run_is_named(tmp_path, capsys):
    code, _, err = _dew(["diff", str(tmp_path), str(tmp_path / "missing")], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "is not a run directory" in err
    (tmp_path / "run.json").write_text("{bad")  # damaged, and no kept step beside it
    code, _, err = _dew(["diff", str(tmp_path), str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 1 and "an unreadable run.json and no kept checkpoint step" in err


@pytest.mark.slow
def test_a_damaged_recipe_is_noted_and_the_states_still_compared(runs, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(runs.ref, damaged)
    (damaged / "run.json").write_text("{bad")
    (damaged / "started.json").write_text('{"x":')
    code, out, _ = _dew(["diff", str(runs.ref), str(damaged)], capsys)
    assert code == 0 and out.splitlines()[0] == f"identical through step {STEPS}", out
    assert f"{damaged.resolve() / 'run.json'} cannot be read" in out and "that run's recipe is not compared" in out
    # It said "recipes: the same" of the recipe it could not read, and nothing of the damaged started.json.
    assert "recipes: not compared (a note below says why)" in out and "recipes: the same" not in out, out
    assert f"{damaged.resolve() / 'started.json'} cannot be read" in out, out


@pytest.mark.slow
def test_states_kept_through_an_earlier_step_than_the_losses_are_not_called_identical_through_the_last(
        runs, tmp_path, capsys):
    """A copy lacking its last kept steps was 'identical through step 10', its states compared through 4."""
    copy = tmp_path / "fewer"
    shutil.copytree(runs.ref, copy)
    for step in range(5, STEPS + 1):
        shutil.rmtree(copy / str(step))
    code, out, _ = _dew(["diff", str(runs.ref), str(copy)], capsys)
    assert code == 0, out
    assert out.splitlines()[0] == (f"identical through step {STEPS} (the states, kept through step 4; the losses "
                                   "after it)"), out
    assert "states: identical at every common kept step (4, through step 4)" in out, out


# -- dew audit ------------------------------------------------------------------------------------------
def _launch(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dew.cli", "launch", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_pool_stopped_and_resumed_on_one_process_consumed_the_uninterrupted_records(runs, capsys):
    run = runs.root / "pool"
    env = runs.env(1)
    pool = _launch(["-n", "2", "--grace", "120", *_recipe(run, "trainer.steps=100000")], env, runs.root)
    lines = []
    signalled = False
    for line in pool.stdout:
        lines.append(line)
        if not signalled and re.match(r"^step 2: loss", line):
            pool.send_signal(signal.SIGTERM)
            signalled = True
    assert pool.wait(timeout=300) == 143, "".join(lines)
    stopped = int(re.search(r"preempted at step (\d+)", "".join(lines)).group(1))
    assert 2 <= stopped < STEPS, "".join(lines)
    resumed = _launch(["-n", "1", *_recipe(run, f"trainer.steps={STEPS}")], env, runs.root)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output

    code, out, _ = _dew(["audit", str(run), "--against", str(runs.ref)], capsys)
    assert code == 0, out
    assert f"from step 0 on 2 processes (2 data shares); from step {stopped} on 1 process (1 data share)" in out
    # The ramp: 4 steps of 4 records, then 6 of 8.
    assert (f"identical through step {STEPS} to {runs.ref}: 64 records consumed, 64 expected; 0 skipped, "
            "0 repeated, 0 never in the reference") in out
    # And step by step, as the two ledgers say, with the checkpoint's position where the pool stopped.
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (runs.ref / "ledger.jsonl").read_text().splitlines()]
    steps = {row["step"]: row for row in ledger if row["kind"] == "step"}
    assert [(r["first"], r["end"], r["digest"]) for r in reference if r["kind"] == "step"] == \
        [(steps[s]["first"], steps[s]["end"], steps[s]["digest"]) for s in range(1, STEPS + 1)]
    checkpoint = next(r for r in ledger if r["kind"] == "checkpoint" and r["step"] == stopped)
    assert checkpoint["position"]["records"] == steps[stopped]["end"]
    assert _dew(["audit", str(run)], capsys)[0] == 0


_SKIPPING = """
import sys
from dew.data import ramp
from dew.recipes.config import RunConfig

resumed = ramp.RampedStream.set_state

def skipping(self, state):  # a resume that loses one batch: the fault this test plants
    resumed(self, state)
    self.records += ramp.batch_at(self.schedule, self.step)

ramp.RampedStream.set_state = skipping
RunConfig.load("tiny-lm", overrides=sys.argv[1:]).train()
"""


@pytest.mark.slow
def test_a_resume_that_skipped_a_batch_is_caught_at_that_step(runs, capsys):
    run = runs.root / "skipped"
    shutil.copytree(runs.ref, run)
    for step in range(5, STEPS + 1):
        shutil.rmtree(run / str(step))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_SKIPPING),
                           *_recipe(run, f"trainer.steps={STEPS}", "trainer.checkpoint_every=1")[1:]],
                          capture_output=True, text=True, env=runs.env(1), cwd=runs.root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    code, out, _ = _dew(["audit", str(run)], capsys)
    assert code == 1, out
    # Step 5 should have read positions 16-23 (after 4 steps of 4); it read 24-31. From then on
    # everything is one batch late: 8 records skipped, 8 read past the uninterrupted run's end.
    assert ("the records differ from step 5 from an uninterrupted run (every position of the global order "
            "from the first, once): 64 records consumed, 64 expected; 8 skipped, 0 repeated, "
            "8 never in the reference") in out
    assert "6 step(s) trained after a checkpoint were undone by a resume and trained again" in out
    against = _dew(["audit", str(run), "--against", str(runs.ref), "--json"], capsys)[1]
    assert json.loads(against)["first_difference"] == 5


@pytest.mark.slow
def test_a_step_whose_ledger_line_is_gone_is_named(runs, tmp_path, capsys):
    """With step 3's line removed, the audit said the records differ from step 4 and named no step
    without a line (the reference was built from the ledger's own steps, so it lacked step 3 too)."""
    lines = (runs.ref / "ledger.jsonl").read_text().splitlines()
    third = next(i for i, line in enumerate(lines) if json.loads(line) == {**json.loads(line), "kind": "step", "step": 3})
    run = shutil.copytree(runs.ref, tmp_path / "unlined")
    (run / "ledger.jsonl").write_text("\n".join([*lines[:third], *lines[third + 1:]]) + "\n")
    code, out, _ = _dew(["audit", str(run)], capsys)
    assert code == 1, out
    assert "the records differ from step 3 from an uninterrupted run" in out, out
    assert "steps without a ledger entry: [3]" in out, out
    result = json.loads(_dew(["audit", str(run), "--json"], capsys)[1])
    assert result["first_difference"] == 3 and result["missing_steps"] == [3], result


def test_a_ledger_edited_by_hand_or_never_committed_is_not_vouched_for(runs, tmp_path, capsys):
    """A step's digest changed by hand, or the order's seed, was called identical to an uninterrupted run
    (exit 0): only the positions were compared. A run killed while its first checkpoint was written holds
    a ledger that names that save and no committed step; it was called identical through that step."""
    lines = (runs.ref / "ledger.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    third = next(i for i, r in enumerate(rows) if r["kind"] == "step" and r["step"] == 3)
    order = next(i for i, r in enumerate(rows) if r["kind"] == "order")
    seed = rows[order]["seed"]
    for name, index, edit in (("digest", third, {"digest": "0" * 32}), ("seed", order, {"seed": seed + 7})):
        run = shutil.copytree(runs.ref, tmp_path / name)
        edited = [*lines[:index], json.dumps({**rows[index], **edit}), *lines[index + 1:]]
        (run / "ledger.jsonl").write_text("\n".join(edited) + "\n")
        code, out, err = _dew(["audit", str(run)], capsys)
        step = 3 if name == "digest" else 1
        assert code == 2 and not out and err.count("\n") == 1, (name, out, err)
        assert f"Line {index + 1 if name == 'digest' else order + 2} of {run / 'ledger.jsonl'} gives step {step} " \
            "a digest other than that of the records dew's global order" in err, err
        assert _dew(["audit", str(run), "--against", str(runs.ref)], capsys)[0] == 2
    killed = shutil.copytree(runs.ref, tmp_path / "killed")
    for step in killed.iterdir():
        if step.name.isdigit():
            shutil.rmtree(step)
    code, out, err = _dew(["audit", str(killed)], capsys)
    assert code == 2 and "records no step: the run kept none" in err and not out, (out, err)


@pytest.mark.slow
def test_an_audit_against_a_run_on_other_text_at_the_same_positions_is_not_identical(runs, capsys):
    """The ledgers name records by their positions: a run on the same files with one byte changed read
    the same positions under the same order, and the audit called it identical to the reference."""
    import sysconfig

    copied = runs.root / "edited-stdlib"
    copied.mkdir(exist_ok=True)
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-b]*.py")):
        shutil.copy(source, copied / source.name)
    first = sorted(copied.iterdir())[0]
    text = first.read_bytes()
    first.write_bytes(text.replace(b"e", b"E", 1))  # the same length: the same windows, other text
    run = runs.train("edited", f"data.files={copied}/[a-b]*.py")
    code, out, _ = _dew(["audit", str(run), "--against", str(runs.ref)], capsys)
    assert code == 1 and "identical" not in out.splitlines()[0], out
    assert "the runs read different data" in out and "the same positions hold other records" in out, out


def test_a_run_without_a_ledger_says_the_audit_needs_one(tmp_path, capsys):
    (tmp_path / "run.json").write_text("{}")
    code, _, err = _dew(["audit", str(tmp_path)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "holds no data ledger (ledger.jsonl), and an audit needs one" in err
    # A recipe's folder of {timestamp} runs is no run: resuming it (the advice above) cannot work.
    run = tmp_path / "runs" / "tiny-lm" / "2026-12-04_21-33-45"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    code, _, err = _dew(["audit", str(tmp_path / "runs" / "tiny-lm")], capsys)
    assert code == 2 and err.count("\n") == 1 and "is not a run's folder (it holds no run.json)" in err
    assert f"Its runs: {run}." in err and "Resume" not in err


def test_a_ledger_that_proves_nothing_is_refused_in_one_line(tmp_path, capsys):
    """A missing directory, a damaged line, a step line without its positions and a ledger of no step:
    each exit status 2 with what is wrong, never a traceback nor an exact verdict."""
    opened = {"kind": "open", "step": 0, "position": None, "processes": 1, "shares": 1}
    step = {"kind": "step", "step": 1, "first": 0, "end": 4, "digest": "d1"}
    cases = {
        "missing": (None, "does not exist or is not a directory"),
        "damaged": ([json.dumps(opened), "{garbage", json.dumps(step)], "Line 2 of"),
        "keyless": ([json.dumps(opened), json.dumps({k: v for k, v in step.items() if k != "first"})],
                    "Line 2 of"),
        "stepless": ([json.dumps(opened)], "records no step"),
    }
    for name, (lines, said) in cases.items():
        run = tmp_path / name
        if lines is not None:
            run.mkdir()
            (run / "ledger.jsonl").write_text("\n".join(lines) + "\n")
        code, out, err = _dew(["audit", str(run)], capsys)
        assert code == 2 and not out and err.count("\n") == 1 and said in err, (name, out, err)
    assert "has no 'first'" in _dew(["audit", str(tmp_path / "keyless")], capsys)[2]
    # The same lines whole are audited: an exact run of one step.
    (tmp_path / "damaged" / "ledger.jsonl").write_text(json.dumps(opened) + "\n" + json.dumps(step) + "\n")
    assert _dew(["audit", str(tmp_path / "damaged")], capsys)[0] == 0


def test_the_ledger_replays_a_resume_over_the_steps_it_undid(tmp_path):
    """A crash after step 3's checkpoint undid steps 4-5; the resumed fit's lines replace them."""
    from dew.provenance.ledger import audit, read_ledger

    def step(s: int, first: int) -> dict:  # the digest of the records the order puts at its positions
        return {"kind": "step", "step": s, "first": first, "end": first + 4,
                "digest": records_digest(RecordOrder(100, 0)(np.arange(first, first + 4)))}

    rows = [{"kind": "open", "step": 0, "position": None, "processes": 2, "shares": 2},
            {"kind": "order", "step": 1, "seed": 0, "size": 100}]
    rows += [step(s, 4 * (s - 1)) for s in range(1, 4)] + [step(4, 40), step(5, 44)]  # undone: other positions
    rows += [{"kind": "checkpoint", "step": 3, "position": {"records": 12}},
             {"kind": "open", "step": 3, "position": {"records": 12}, "processes": 1, "shares": 1},
             {"kind": "order", "step": 4, "seed": 0, "size": 100}]
    rows += [step(s, 4 * (s - 1)) for s in range(4, 7)]
    rows += [{"kind": "checkpoint", "step": 6, "position": {"records": 24}}]
    (tmp_path / "6").mkdir()  # the step the resumed fit committed
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "st')
    ledger = read_ledger(tmp_path)
    assert [(s.first, s.digest) for s in ledger.steps] == [(r["first"], r["digest"]) for r in (*rows[2:5], *rows[-4:-1])]
    assert [s.first for s in ledger.steps] == [0, 4, 8, 12, 16, 20]
    assert ledger.undone == 2 and [s.processes for s in ledger.segments] == [2, 1]
    assert audit(ledger).exact
    # A repeated batch: step 5 reads step 4's positions again.
    rows[-3], rows[-2] = step(5, 12), step(6, 16)
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = audit(read_ledger(tmp_path))
    assert (result.first_difference, result.skipped, result.repeated, result.extra) == (5, 4, 4, 0)


def test_a_ledger_that_begins_at_a_resume_vouches_only_for_the_steps_after_it(tmp_path, capsys):
    """A ledger removed (or a run older than the ledger) and then resumed at step 4: steps 5-6 agree with
    an uninterrupted run, steps 1-4 have no line, so the audit is not exact (status 1) and says why."""
    rows = [{"kind": "open", "step": 4, "position": {"records": 16}, "processes": 1, "shares": 1}]
    rows += [{"kind": "step", "step": s, "first": 4 * (s - 1), "end": 4 * s, "digest": f"d{s}"} for s in (5, 6)]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = _dew(["audit", str(tmp_path)], capsys)
    assert code == 1, out
    assert ("identical from step 5 through step 6 to an uninterrupted run (every position of the global order "
            "from the first, once): 8 records consumed, 8 expected; 0 skipped, 0 repeated, 0 never in the "
            "reference; steps 1 to 4 have no ledger lines") in out
    shown = json.loads(_dew(["audit", str(tmp_path), "--json"], capsys)[1])
    assert shown["exact"] is False and shown["unledgered"] == 4


def test_every_consumed_step_reports_the_records_the_shares_read():
    """The global batch a stream reports is what its shares read, at any share count (TokenWindows)."""
    import numpy as np

    from dew.data import DataPartition
    from dew.data.sources import ArrayRecords
    from dew.data.stream import StreamReader

    source = ArrayRecords({"id": np.arange(37)})
    reader = StreamReader(source, batch=6, seed=3)
    shares = [reader(DataPartition(s, 3)) for s in range(3)]
    for _ in range(9):  # past one epoch of 37 records
        rows = np.concatenate([next(stream)["id"] for stream in shares])
        reported = [stream.consumption() for stream in shares]
        assert all((r.first, r.end) == (reported[0].first, reported[0].end) for r in reported)
        assert list(reported[0].records) == list(rows)
