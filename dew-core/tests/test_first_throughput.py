"""The first logged step carries a throughput figure, timed without the compile.

The spec (Trainer.fit): "Every log_every steps the tracker receives the
loss, the objective's metrics and the throughput." Before, the first log
step had no earlier log to time from and so no throughput. Now its rate is
timed from the end of the first step's compile (the first step alone: until
its result was ready), and the console says the compile is excluded. The
bound it is checked against is the fit's own Goodput record: the first step
took first_step_seconds from the start of the fit, compile_seconds of which
were compiling.
"""

from __future__ import annotations

import jax
import optax
import pytest

from dew import Trainer
from dew.telemetry.records import Goodput
from dew.testing.doubles import Regression, regression_dataset


@pytest.mark.parametrize("log_every", [1, 3])
def test_the_first_logged_step_has_a_throughput_with_the_compile_excluded(log_every, recorder, capsys):
    Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0), tracker=recorder).fit(
        regression_dataset(rows=8), steps=3, log_every=log_every)
    rates = recorder.series("throughput/steps_per_second")
    assert rates and rates[0][0] == log_every  # the first log step has one
    step_time = dict(recorder.series("train/step_time"))[log_every]
    assert step_time == pytest.approx(1 / rates[0][1])
    assert dict(recorder.series("throughput/examples_per_second"))[log_every] == pytest.approx(8 * rates[0][1])
    goodput = next(value for _, value in recorder.artifacts if isinstance(value, Goodput))
    assert goodput.compile_seconds > 0
    if log_every == 1:  # the first step's own time: less than its share of the fit without the compile
        assert step_time < goodput.first_step_seconds - goodput.compile_seconds
    else:  # three steps since the compile ended, within the fit's wall time less the compile
        assert 3 * step_time < goodput.wall_seconds - goodput.compile_seconds
    out = capsys.readouterr().out
    assert (f"step {log_every}: throughput is timed from the end of the first step's compile; "
            f"the {goodput.compile_seconds:.2f} s of compiling are excluded") in out


def test_a_growing_batch_is_counted_at_each_steps_own_size_and_its_compiles_are_no_steps_time(recorder):
    """A step is logged after the next one's batch was measured, so at each size change the rates
    counted the next step's rows; and the compile of each new size was timed as the step's own (a
    step of 0.04 s logged as 8 s)."""
    from dew.data import Dataset
    from dew.testing.doubles import RegressionStream, regression_batch

    sizes = [4, 4, 8, 8, 16, 16]  # the rows of steps 1 to 6
    ramp = Dataset(train=lambda partition: RegressionStream(lambda i: regression_batch(i, sizes[min(i, 5)])),
                   batch=16, ramp=((0, 4), (2, 8), (4, 16)))
    Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0), tracker=recorder).fit(ramp, steps=6, log_every=1)
    rates = dict(recorder.series("throughput/steps_per_second"))
    examples = dict(recorder.series("throughput/examples_per_second"))
    assert [round(examples[step] / rates[step]) for step in range(1, 7)] == sizes
    goodput = next(value for _, value in recorder.artifacts if isinstance(value, Goodput))
    # three compiles, one per size: every step's time together is the fit's time without them
    assert sum(dict(recorder.series("train/step_time")).values()) < goodput.wall_seconds - goodput.compile_seconds
