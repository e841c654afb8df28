"""evaluate(): a finite prefix of the validation split, reduced on the host."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.objectives.base import Aux, Mean, MeanMetric, Objective
from dew.training.evaluation import Evaluation, evaluate


class Scale(Objective):
    """loss = mean((w * x - y)^2) with a fixed w, so the expected scores are plain numpy."""

    def init(self, key, variables=None):
        return {"params": {"w": jnp.asarray(2.0)}}

    def loss(self, variables, batch, step):
        errors = (variables["params"]["w"] * batch["x"] - batch["y"]) ** 2
        return Mean(errors.sum(), jnp.asarray(errors.size, jnp.float32)), Aux(
            metrics={"abs": Mean(jnp.sqrt(errors).sum(), jnp.asarray(errors.size, jnp.float32))})


def val_batches(count, rows=4):
    def reader(partition):
        rng = np.random.default_rng(7)
        for _ in range(count):
            yield {"x": rng.normal(size=(rows,)).astype(np.float32),
                   "y": rng.normal(size=(rows,)).astype(np.float32)}
    return reader


def test_scores_are_the_mean_over_every_row_of_the_pass():
    objective = Scale()
    variables = objective.init(None)
    batches = list(val_batches(3)(None))
    x = np.concatenate([b["x"] for b in batches])
    y = np.concatenate([b["y"] for b in batches])
    errors = (2.0 * x - y) ** 2
    result = evaluate(objective, variables, val_batches(3), key=jax.random.key(0), step=7,
                      metrics=[MeanMetric("loss"), MeanMetric("abs")])
    assert isinstance(result, Evaluation)
    assert result.scores["val/loss"] == pytest.approx(errors.mean(), rel=1e-6)
    assert result.scores["val/abs"] == pytest.approx(np.sqrt(errors).mean(), rel=1e-6)
    assert result.coordinated_batches == 3 and result.records == 12 and not result.uneven_shards
    assert result.step == 7 and result.split == "val"
    assert result.scalars["evaluation/records"] == 12.0
    assert result.to_json()["scores"] == result.scores


def test_a_metric_reading_an_output_evaluate_never_returns_is_named_with_both():
    """A plugin's metrics() named 'accuracy', which its evaluate never returned: the run stopped with a
    bare KeyError: 'accuracy' traceback from inside MeanMetric."""
    from dew.training.evaluation import MetricOutputError

    with pytest.raises(MetricOutputError) as refused:
        evaluate(Scale(), Scale().init(None), val_batches(1), key=jax.random.key(0), step=1,
                 metrics=[MeanMetric("loss"), MeanMetric("accuracy")])
    assert str(refused.value) == ("The validation metric 'accuracy' of Scale.metrics() reads the output 'accuracy', "
                                  "which its evaluate does not return (it returns abs, loss): return it from "
                                  "evaluate, or leave the metric out of metrics().")


def test_no_metrics_means_no_reading_at_all():
    def reader(partition):
        raise AssertionError("the split must not be opened")

    result = evaluate(Scale(), Scale().init(None), reader, key=jax.random.key(0))
    assert result.scores == {} and result.coordinated_batches == 0


def test_an_endless_split_is_read_only_as_far_as_it_is_consumed():
    consumed = []

    def reader(partition):
        for i in itertools.count():
            consumed.append(i)
            if i == 2:
                return
            yield {"x": np.ones(4, np.float32), "y": np.zeros(4, np.float32)}

    result = evaluate(Scale(), Scale().init(None), reader, key=jax.random.key(0),
                      metrics=[MeanMetric("loss")])
    assert result.scores["val/loss"] == pytest.approx(4.0)
    assert result.coordinated_batches == 2


def test_fit_scores_the_split_every_eval_every_steps_and_at_the_end():
    import optax

    from dew import Trainer
    from dew.data import Dataset
    from dew.testing.doubles import RecordingTracker

    def train(partition):
        rng = np.random.default_rng(0)
        while True:
            x = rng.normal(size=(4,)).astype(np.float32)
            yield {"x": x, "y": 3 * x}

    recorder = RecordingTracker()
    trainer = Trainer(Scale(), optax.sgd(0.05), key=jax.random.key(0), tracker=recorder)
    state = trainer.fit(Dataset(train=train, val=val_batches(2), batch=4), steps=6, log_every=3,
                        eval_every=2)
    evaluations = [v for _, v in recorder.artifacts if isinstance(v, Evaluation)]
    assert [e.step for e in evaluations] == [2, 4, 6]
    expected = evaluate(Scale(), state.params, val_batches(2), key=jax.random.key(0),
                        metrics=[MeanMetric("loss")], step=6)
    assert evaluations[-1].scores["val/loss"] == pytest.approx(expected.scores["val/loss"], rel=1e-6)
    logged = [s for step, s in recorder.rows if "val/loss" in s]
    assert len(logged) == 3


# -- elapsed_seconds is rank zero's (the spec's words) ------------------------------------------

RANK_CLOCKS = r"""
import json, time
import jax, jax.numpy as jnp, numpy as np
from dew.training.runtime.process import ProcessSettings, prepare_process
prepare_process(ProcessSettings(multi_host=True))  # the pool run_pool describes
from dew.objectives.base import Aux, Mean, MeanMetric, Objective
from dew.training.evaluation import evaluate

class Scale(Objective):
    def init(self, key, variables=None):
        return {"params": {"w": jnp.asarray(2.0)}}

    def loss(self, variables, batch, step):
        errors = (variables["params"]["w"] * batch["x"] - batch["y"]) ** 2
        return Mean(errors.sum(), jnp.asarray(errors.size, jnp.float32)), Aux()

rank = jax.process_index()

class Batches:  # two batches, then an iterator cleanup that takes each rank its own time
    left = 2
    def __iter__(self):
        return self
    def __next__(self):
        if not self.left:
            raise StopIteration
        self.left -= 1
        return {"x": np.ones(4, np.float32), "y": np.zeros(4, np.float32)}
    def close(self):
        time.sleep(0.3 if rank == 0 else 3.0)

began = time.perf_counter()
result = evaluate(Scale(), {"params": {"w": jnp.asarray(2.0)}}, lambda partition: Batches(),
                  key=jax.random.key(0), metrics=(MeanMetric("loss"),))
print(json.dumps({"rank": rank, "elapsed": result.elapsed_seconds,
                  "own": time.perf_counter() - began, "loss": result.scores["val/loss"]}))
"""


@pytest.mark.slow  # a pool of two interpreters
def test_elapsed_seconds_is_rank_zeros_wall_time_through_cleanup_on_every_rank():
    # The spec (dew.training, Evaluation): "elapsed_seconds is rank zero's wall time through
    # iterator cleanup." Rank 1's cleanup takes 3 s, rank 0's 0.3 s: both ranks report the
    # same number, which is rank 0's clock (its cleanup included), not rank 1's.
    import json

    from dew.testing.processes import run_pool

    finished = run_pool(RANK_CLOCKS, processes=2, devices=1, timeout=600)
    for done in finished:
        assert done.returncode == 0, done.stderr[-3000:]
    zero, one = (json.loads(done.stdout.strip().splitlines()[-1]) for done in finished)
    assert zero["loss"] == one["loss"] == 4.0  # (2 * 1 - 0) ** 2 on every row
    assert zero["elapsed"] == one["elapsed"]
    assert 0.3 <= zero["elapsed"] <= zero["own"]  # rank 0's cleanup is inside its own clock
    assert zero["elapsed"] + 1.5 < one["own"]  # rank 1's 3 s cleanup is not
