"""A smoke run of the installed stack: a linear regression trained for a few steps.

The trainer's console prints the loss at each log step.

scripts/run falls back to this while no default recipe is installed.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import dew
from dew.data.base import Dataset
from dew.objectives.base import Aux, Mean, Objective


class Regression(Objective):
    def __init__(self) -> None:
        import flax.linen as nn

        self.model = nn.Dense(1)

    def init(self, key, variables=None):
        return variables or self.model.init(key, np.zeros((1, 4), np.float32))

    def loss(self, variables, batch, step):
        errors = (self.model.apply(variables, batch["x"]) - batch["y"]) ** 2
        return Mean.of(errors), Aux()


def stream(partition):
    rng = np.random.default_rng(0)
    while True:
        x = rng.normal(size=(8, 4)).astype(np.float32)
        yield {"x": x, "y": x @ np.arange(1, 5, dtype=np.float32)[:, None] + 1}


if __name__ == "__main__":
    print("registered models:", dew.models.names())
    trainer = dew.Trainer(Regression(), optax.sgd(0.05), key=jax.random.key(0))
    trainer.fit(Dataset(train=stream, batch=8), steps=20, log_every=5)
    print("smoke run finished")
