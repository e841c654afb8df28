"""A batch ramp (dew.data.ramped) compiles the step once per size it names, in a real fit."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.data import Dataset
from dew.testing.doubles import Regression


@pytest.mark.slow
def test_a_batch_ramp_compiles_once_per_size_it_names():
    from dew.data import ramped
    from dew.data.sources import ArrayRecords
    from dew.data.stream import StreamReader

    x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    records = ArrayRecords({"x": x, "y": x @ np.ones((4, 1), np.float32)})
    data = ramped(Dataset(train=StreamReader(records, batch=8), batch=8), [(0, 2), (2, 4), (3, 8)])
    objective = Regression()
    state = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0)).fit(data, steps=6, log_every=2)
    assert objective.traces == 3
    assert int(state.updates) == 6
