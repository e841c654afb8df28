"""WandbTracker offline, read back from the run directory W&B writes: its history from
the run's .wandb datastore (parsed with W&B's own protobuf), its media and files."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from PIL import Image

from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import RunStarted

pytest.importorskip("wandb")

from wandb_datastore import finished_records  # noqa: E402 - a helper beside the tests


def test_wandb_offline_read_back(tmp_path, monkeypatch):
    from dew.trackers.wandb import WandbTracker

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    tracker = WandbTracker("dew-tests", "offline-read-back", offline=True, config={"lr": 0.5})
    assert not (tmp_path / "wandb").exists()  # opened on the first value
    tracker.log({"loss": 0.5, "val/loss": 0.75}, step=1)
    tracker.log({"loss": 0.25}, step=2)
    tracker.log({"loss": float("nan")}, step=3)
    image = np.arange(5 * 3 * 3, dtype=np.uint8).reshape(5, 3, 3)
    tracker.artifact(Artifact("samples", "image", image), step=3)
    tracker.artifact(Artifact("story", "text", "a text preview"), step=3)
    tracker.artifact(RunStarted({"lr": 0.5}, 0, 3, {"data": 1}, 1), step=3)
    tracker.close()

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (datastore,) = run_dir.glob("run-*.wandb")
    records = finished_records(datastore)
    kinds = [r.WhichOneof("record_type") for r in records]
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert len(runs) == 1, kinds
    run = runs[0]
    assert run.display_name == "offline-read-back" and run.project == "dew-tests"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["lr"] == 0.5

    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): item.value_json
                         for item in record.history.item})
    history = {int(row["_step"]): row for row in rows}
    assert float(history[1]["loss"]) == 0.5 and float(history[1]["val/loss"]) == 0.75
    assert float(history[2]["loss"]) == 0.25
    assert math.isnan(json.loads(history[3]["loss"]))
    # the image is in the history and in the run's media, with its pixels
    media = json.loads(history[3]["previews/samples/path"])
    np.testing.assert_array_equal(np.asarray(Image.open(run_dir / "files" / media)), image)

    files = run_dir / "files"
    assert (files / "previews/story/step_00000003.txt").read_text() == "a text preview"
    np.testing.assert_array_equal(
        np.asarray(Image.open(files / "previews/samples/step_00000003.png")), image)
    row = json.loads((files / "records/run_started/step_00000003.json").read_text())
    assert row["record"]["mesh"] == {"data": 1} and row["record"]["steps"] == 3


SERVICE_OWNER = """
import os, sys, wandb
run = wandb.init(project="owner", name="owner", mode="offline")  # starts this process's W&B service
print(os.environ["WANDB_SERVICE"], flush=True)  # the address W&B hands to child processes
sys.stdin.readline()
run.finish()
"""  # and at exit W&B's own hook shuts the service down

LOG_EVERY_STEP = """
import sys, time
from dew.trackers.wandb import WandbTracker
closed = WandbTracker("dew-tests", "closed", offline=True)
left_open = WandbTracker("dew-tests", "left-open", offline=True)  # its owner never closes it
for step in range(300):
    closed.log({"loss": 1.0 / (step + 1)}, step)
    left_open.log({"loss": 1.0 / (step + 1)}, step)
    if step == 100:
        print("halfway", flush=True)
        sys.stdin.readline()  # meanwhile the process whose service was inherited exits
    if step % 50 == 0:
        time.sleep(0.6)  # some batches go out during the run, the rest at close or at exit
closed.close()
print("logged", flush=True)
"""


@pytest.mark.slow  # two interpreters that start W&B (~10 s)
def test_wandb_offline_keeps_every_step_when_the_parents_service_stops_and_at_exit(tmp_path):
    """Every step logged reaches the run's datastore with no lost connection, in a process that
    inherited another's W&B service address (WANDB_SERVICE) and outlives it, whether its
    tracker is closed or left open at exit.

    The two ways W&B offline lost its connection (ConnectionResetError: Connection lost) and
    the reports after: a run on a service another process started, which stopped it; and a
    tracker left open, whose last batch was sent after W&B's own exit hook had stopped the
    service."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "WANDB_API_KEY": ""}
    owner = subprocess.Popen([sys.executable, "-c", SERVICE_OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    child = None
    try:
        address = owner.stdout.readline().strip()
        assert address, "the service owner printed no address"
        child = subprocess.Popen([sys.executable, "-c", LOG_EVERY_STEP], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**env, "WANDB_SERVICE": address}, cwd=tmp_path)
        assert child.stdout.readline().strip() == "halfway"
        owner.communicate("go\n", timeout=120)  # the service the child was handed stops
        out, err = child.communicate("go\n", timeout=300)
    finally:
        for process in (owner, child):
            if process is not None and process.poll() is None:
                process.kill()
    assert child.returncode == 0 and "logged" in out, err[-3000:]
    assert "ConnectionResetError" not in err and "TrackerWarning" not in err, err[-3000:]
    runs = {}
    for datastore in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb"):
        records = finished_records(datastore)
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        losses = {}
        for record in records:
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                if "loss" in row:  # W&B's own rows (runtime, timestamps) carry no loss
                    losses[int(row["_step"])] = row["loss"]
        runs[run.display_name] = losses
    assert set(runs) == {"owner", "closed", "left-open"}
    for name in ("closed", "left-open"):
        assert runs[name] == {step: 1.0 / (step + 1) for step in range(300)}, name


def test_a_resumed_fit_continues_its_folders_run_without_an_id(tmp_path, monkeypatch):
    """A resume without the recipe's id: started a second W&B run, so one training run's charts were split."""
    import wandb

    from dew.trackers.wandb import RUN_ID_FILE, WandbTracker

    wandb.teardown()  # W&B keeps the first WANDB_DIR it read (an earlier test's) until its setup is torn down
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "")
    monkeypatch.delenv("WANDB_MODE", raising=False)

    def fit(folder, start, stop, project="dew-resumes", id=None):
        began = int(time.time())  # W&B names an offline run's folder by its second and id: two in one second
        while int(time.time()) == began:  # would share one, so each fit starts in a second of its own
            time.sleep(0.05)
        folder.mkdir(exist_ok=True)
        tracker = WandbTracker(project, "a-run", offline=True, id=id)
        tracker.artifact(RunStarted(config={"trainer": {"checkpoint_dir": "runs/{timestamp}"}}, start=start,
                                    steps=10, folder=str(folder)), step=start)  # the folder, not the recipe's text
        for step in range(start + 1, stop + 1):
            tracker.log({"loss": float(step)}, step=step)
        run_id = tracker.run.id
        tracker.close()
        return run_id

    def logged(run_id):  # the steps every offline run of that id holds, in the order they were written
        steps = []
        for datastore in sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
            steps += [int(json.loads(i.value_json)) for r in finished_records(datastore)
                      if r.WhichOneof("record_type") == "history" for i in r.history.item if (i.key or "/".join(i.nested_key)) == "_step"]
        return steps

    first = fit(tmp_path / "run", 0, 5)
    assert json.loads((tmp_path / "run" / RUN_ID_FILE).read_text())["id"] == first
    assert fit(tmp_path / "run", 3, 7) == first  # resumed from its step-3 checkpoint: the same run
    assert logged(first) == [1, 2, 3, 4, 5, 4, 5, 6, 7]  # W&B keeps the first 4 and 5 when it syncs
    # Another run: trained afresh in the folder, a copy of the folder resumed, another project.
    fresh = fit(tmp_path / "run", 0, 2)
    assert fresh != first and json.loads((tmp_path / "run" / RUN_ID_FILE).read_text())["id"] == fresh
    import shutil

    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    assert fit(tmp_path / "copy", 2, 3) not in (first, fresh)
    assert fit(tmp_path / "run", 2, 3, project="elsewhere") != fresh
    assert fit(tmp_path / "run", 2, 3, id="named") == "named"  # the recipe's id still wins
    # The folder holds the last run a fit without an id started there ('elsewhere': the project differs now).
    assert json.loads((tmp_path / "run" / RUN_ID_FILE).read_text())["project"] == "elsewhere"
    # A link planted at the name in a folder someone handed over is replaced, not written through.
    (tmp_path / "theirs.txt").write_text("kept")
    (tmp_path / "run" / RUN_ID_FILE).unlink()
    (tmp_path / "run" / RUN_ID_FILE).symlink_to(tmp_path / "theirs.txt")
    fit(tmp_path / "run", 0, 1)
    assert (tmp_path / "theirs.txt").read_text() == "kept" and not (tmp_path / "run" / RUN_ID_FILE).is_symlink()
    wandb.teardown()


@pytest.mark.parametrize("outcome, code", [(None, 0), ("finished", 0), ("failed", 1), ("killed", 130)])
def test_a_wandb_run_ends_with_the_outcome_it_was_told(tmp_path, monkeypatch, outcome, code):
    """WandbTracker had no conclude: a run that failed or was stopped ended in W&B with exit code 0,
    read as finished, where MLflow's said FAILED or KILLED."""
    import wandb

    from dew.trackers.wandb import WandbTracker

    wandb.teardown()  # W&B keeps the first WANDB_DIR it read (an earlier test's) until its setup is torn down
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    tracker = WandbTracker("dew-tests", "outcome", offline=True)
    tracker.log({"loss": 0.5}, step=1)
    if outcome is not None:  # a tracker closed without being told takes the run as finished
        tracker.conclude(outcome)
    run_id = tracker.run.id
    tracker.close()
    (datastore,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    exits = [r.exit.exit_code for r in finished_records(datastore) if r.WhichOneof("record_type") == "exit"]
    assert exits == [code]
