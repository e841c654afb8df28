"""A preemption notice to a fit without Checkpoints: no Preempted at the stop, which says nothing was saved.

The spec (Preempted): "Trainer.fit stopped at a preemption notice, at step,
and wrote that step's checkpoint and data position." A fit that has no
Checkpoints cannot write one, so at the notice it exits with the documented status
(143) through UnsavedStopError, whose message says nothing was saved.
"""

from __future__ import annotations

import jax
import optax
import pytest

from dew import Trainer
from dew.plugins import hookimpl, registered
from dew.testing.doubles import Regression, regression_dataset
from dew.training.runtime import Preempted, PreemptionNotice, UnsavedStopError


class NoticeAt:
    """Sends a preemption notice at one step, as a scheduler would."""

    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def dew_step_end(self, step, metrics):
        if step == self.step:
            PreemptionNotice.send()


def test_a_fit_without_checkpoints_stops_without_claiming_a_save(capsys):
    trainer = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0))
    with registered(NoticeAt(2)), pytest.raises(UnsavedStopError) as stopped:
        trainer.fit(regression_dataset(), steps=10, log_every=1)
    error = stopped.value
    assert not isinstance(error, Preempted) and isinstance(error, SystemExit)
    assert 2 <= error.step < 10 and error.code == 143  # the notice, read at a log step, stops the next
    assert capsys.readouterr().err.strip().endswith(
        f"dew: preempted at step {error.step}; nothing was saved, because the trainer has no Checkpoints, so "
        "running again starts over. Set a recipe's trainer.checkpoint_dir (or give the Trainer "
        "checkpoints=Checkpoints(directory)) to make a stop resumable.")


SIGTERM = r"""
import os, signal
import jax, optax
from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.testing.doubles import Regression, regression_batch

def train(partition):
    step = 0
    while True:
        step += 1
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, mid-run
        yield regression_batch(step)

Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0)).fit(
    Dataset(train=train, batch=8), steps=50, log_every=1)
print("finished")
"""


@pytest.mark.slow
def test_sigterm_ends_an_unsaved_fit_with_143_and_says_nothing_was_saved():
    from dew.testing.processes import run_python

    result = run_python(SIGTERM)
    assert result.returncode == 143, result.stderr[-3000:]
    assert "finished" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("dew: preempted at step ") and "nothing was saved" in last, last
    assert "checkpoint and data position are written" not in result.stderr
