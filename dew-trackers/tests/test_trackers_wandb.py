"""WandbTracker offline, read back from the run directory W&B writes: its history from
the run's .wandb datastore (parsed with W&B's own protobuf), its media and files."""

from __future__ import annotations

import json
import math

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
