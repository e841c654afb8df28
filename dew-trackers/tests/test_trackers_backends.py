"""The tracker backends as dew-core names them: registry names and extras, imports deferred until a tracker logs, TensorBoard read back through its own reader."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from dew.registry import UnknownNameError, trackers
from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import ProfileWindowRecord
from dew.tracking.local import LocalTracker
from test_trackers import IMAGE, TEXT  # every test folder is on sys.path (conftest.py)


def test_unknown_tracker_lists_names_and_extras():
    with pytest.raises(UnknownNameError) as caught:
        trackers.load("tensorbord")
    message = str(caught.value)
    assert "tensorboard" in message and "Did you mean 'tensorboard'" in message
    for name, requirement in [("local", "dew-core"), ("tensorboard", "dew-trackers[tensorboard]"),
                              ("mlflow", "dew-trackers[mlflow]"), ("wandb", "dew-trackers[wandb]")]:
        assert f"{name} ({requirement})" in message


def test_registered_trackers_resolve_to_the_classes():
    from dew.trackers.mlflow import MLflowTracker
    from dew.trackers.tensorboard import TensorBoardTracker
    from dew.trackers.wandb import WandbTracker

    assert trackers.load("local") is LocalTracker
    assert trackers.load("tensorboard") is TensorBoardTracker
    assert trackers.load("mlflow") is MLflowTracker
    assert trackers.load("wandb") is WandbTracker


def test_missing_backend_names_the_extra(python_in_subprocess):
    out = python_in_subprocess("""
        import sys
        sys.modules["mlflow"] = None  # as if the extra were not installed
        from dew import MissingDistributionError
        from dew.trackers.mlflow import MLflowTracker
        try:
            MLflowTracker("exp")
        except MissingDistributionError as error:
            print(error)
    """)
    assert "pip install 'dew-trackers[mlflow]'" in out


def test_importing_dew_imports_no_backend(python_in_subprocess):
    out = python_in_subprocess("""
        import sys
        import dew, dew.training, dew.trackers
        from dew.training import LocalTracker, Trackers, Tracker
        from dew.training import TensorBoardTracker, MLflowTracker, WandbTracker
        TensorBoardTracker("/tmp/never-written"); WandbTracker("p", offline=True)
        print(sorted(m for m in ("wandb", "mlflow", "tensorboard") if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_tensorboard_read_back_through_its_event_reader(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator as ea

    from dew.trackers.tensorboard import TensorBoardTracker

    tracker = TensorBoardTracker(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()  # opened on the first value
    tracker.log({"loss": 0.5, "val/loss": 0.75}, step=1)
    tracker.log({"loss": 0.25}, step=2)
    tracker.log({"loss": float("nan")}, step=3)
    tracker.artifact(Artifact("samples", "image", IMAGE), step=2)
    tracker.artifact(Artifact("story", "text", TEXT), step=2)
    tracker.artifact(ProfileWindowRecord("/tmp/trace", 5, 3), step=8)
    tracker.close()

    reader = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={
        ea.SCALARS: 0, ea.IMAGES: 0, ea.TENSORS: 0})
    reader.Reload()
    loss = [(e.step, e.value) for e in reader.Scalars("loss")]
    assert loss[:2] == [(1, 0.5), (2, 0.25)] and loss[2][0] == 3 and math.isnan(loss[2][1])
    assert [(e.step, e.value) for e in reader.Scalars("val/loss")] == [(1, 0.75)]

    (image,) = reader.Images("previews/samples")
    assert (image.step, image.height, image.width) == (2, 4, 10)
    path = tmp_path / "samples.png"
    path.write_bytes(image.encoded_image_string)
    grid = np.asarray(Image.open(path))
    np.testing.assert_array_equal(grid, np.concatenate([IMAGE[0], IMAGE[1]], axis=1))

    (text,) = reader.Tensors("previews/story")
    assert text.tensor_proto.string_val[0].decode() == TEXT
    (record,) = reader.Tensors("reporting/profile_window")
    assert json.loads(record.tensor_proto.string_val[0]) == {
        "step": 8, "type": "profile_window",
        "record": {"directory": "/tmp/trace", "start": 5, "steps": 3}}
