"""What a fit says and checks before its first step: an unsaved run says a preemption cannot be
saved, and a tracker directory that cannot be written is refused before anything trains."""

from __future__ import annotations

import jax
import optax
import pytest

from dew import Trainer
from dew.testing.doubles import Regression, regression_dataset
from dew.tracking.background import TrackerWriteError
from dew.tracking.local import LocalTracker


def test_a_fit_without_checkpoints_says_a_preemption_cannot_be_saved(capsys):
    Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0)).fit(regression_dataset(), steps=2, log_every=1)
    out = capsys.readouterr().out
    assert "no checkpoints: a preemption notice (SIGTERM) stops this run without saving it (exit 143); set a " \
           "recipe's trainer.checkpoint_dir (or give the Trainer checkpoints=Checkpoints(directory))" in out
    assert out.index("no checkpoints") < out.index("step 1")  # said at the start, before any step


def test_a_tracker_directory_that_cannot_be_written_is_refused_before_step_one(tmp_path, capsys):
    (tmp_path / "a-file").write_text("in the way")
    trainer = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0),
                      tracker=LocalTracker(tmp_path / "a-file" / "run"))
    with pytest.raises(TrackerWriteError, match=r"a-file/run cannot be written \(NotADirectoryError"):
        trainer.fit(regression_dataset(), steps=300, log_every=100)
    assert "compiling the step" not in capsys.readouterr().out  # refused before anything compiled or trained
    assert (tmp_path / "a-file").read_text() == "in the way"
