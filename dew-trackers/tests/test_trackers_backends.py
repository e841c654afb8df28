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


def test_a_checkpoint_is_handed_over_after_its_steps_are_in_the_event_file(tmp_path):
    # A checkpoint committed before its step's scalars were written left a gap that a resume
    # from it never filled (killed between the two, or a tracker failing on a full disk).
    import jax
    import optax
    from tensorboard.backend.event_processing import event_accumulator as ea

    import dew
    from dew.testing.doubles import Regression, regression_dataset
    from dew.trackers.tensorboard import TensorBoardTracker

    seen = []

    class Watched(dew.Checkpoints):
        def save(self, step, state, **kwargs):
            reader = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0})
            reader.Reload()
            seen.append((step, [e.step for e in reader.Scalars("train/loss")]))
            return super().save(step, state, **kwargs)

    tracker = TensorBoardTracker(tmp_path / "tb")
    trainer = dew.Trainer(Regression(), optax.sgd(0.01), key=jax.random.key(0), tracker=tracker,
                          checkpoints=Watched(tmp_path / "checkpoints"))
    trainer.fit(regression_dataset(), steps=6, log_every=1, checkpoint_every=3)
    tracker.close()
    assert seen == [(3, [1, 2, 3]), (6, [1, 2, 3, 4, 5, 6])]


def test_a_resumed_fit_replaces_the_steps_logged_past_its_checkpoint(tmp_path):
    # A run killed at step 8 after its step-5 checkpoint resumes at 5 and logs 6, 7, 8 again:
    # TensorBoard showed each of those twice, the old value and the new.
    from tensorboard.backend.event_processing import event_accumulator as ea

    from dew.telemetry.records import RunStarted
    from dew.trackers.tensorboard import TensorBoardTracker

    first = TensorBoardTracker(tmp_path / "tb")
    first.artifact(RunStarted(config={}, start=0, steps=10), step=0)
    for step in range(1, 9):
        first.log({"loss": 1.0}, step=step)
    first.close()
    resumed = TensorBoardTracker(tmp_path / "tb")
    resumed.artifact(RunStarted(config={}, start=5, steps=10), step=5)
    for step in range(6, 11):
        resumed.log({"loss": 2.0}, step=step)
    resumed.close()
    reader = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0})
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("loss")] == \
        [(step, 1.0) for step in range(1, 6)] + [(step, 2.0) for step in range(6, 11)]
