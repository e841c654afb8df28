"""The resuming guide's example, copied verbatim from the spec, runs and prints its line."""

from __future__ import annotations

EXAMPLE = """
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective


class Regression(Objective):
    def __init__(self):
        self.model = nn.Dense(features=1)

    def init(self, key, variables=None):
        return self.model.init(key, jnp.zeros((1, 1), jnp.float32))

    def loss(self, variables, batch, step):
        prediction = self.model.apply(variables, batch["x"])
        errors = (prediction - batch["y"]) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size)), Aux(metrics={})


class Batches:
    def __init__(self):
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self):
        rng = np.random.default_rng(self.index)
        x = rng.normal(size=(8, 1)).astype(np.float32)
        self.index += 1
        return {"x": x, "y": 2 * x + 1}

    def get_state(self):
        return str(self.index).encode()

    def set_state(self, state):
        self.index = int(state.decode())


data = Dataset(train=lambda partition: Batches(), val=None, records=None, batch=8)
with tempfile.TemporaryDirectory(prefix="dew-checkpoint-") as directory:
    checkpoints = Checkpoints(directory)
    trainer = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0),
                      checkpoints=checkpoints)
    trainer.fit(data, steps=5, checkpoint_every=5)
    checkpoints.wait()
    assert checkpoints.latest == 5
    assert Path(checkpoints.path(5)).is_dir()
    assert not (Path(directory) / "run.json").exists()

    resumed = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0),
                      checkpoints=checkpoints)
    restored, _, position = resumed.place()
    assert int(restored.step) == 5
    assert position == b"5"
    final = resumed.fit(data, steps=10, checkpoint_every=5)
    assert int(final.step) == 10
    assert checkpoints.latest == 10
    print("Restored step 5 and data position 5; continued to step 10.")
"""


def test_the_resuming_example_runs_unchanged(python_in_subprocess) -> None:
    out = python_in_subprocess(EXAMPLE, timeout=300)
    assert out.strip().splitlines()[-1] == "Restored step 5 and data position 5; continued to step 10."
