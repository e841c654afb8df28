"""A one-layer regression and its endless data stream: the smallest fit, for tests of what a
fit reports (trackers, profiler windows) rather than of what it learns."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective


class Linear(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(x)


class Regression(Objective):
    def __init__(self):
        self.model = Linear()

    def init(self, key, variables=None):
        return variables if variables is not None else self.model.init(key, jnp.zeros((1, 4)))

    def loss(self, variables, batch, step):
        errors = (self.model.apply(variables, batch["x"]) - batch["y"]) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size, jnp.float32)), Aux()


def dataset() -> Dataset:
    """Eight rows of four features a step, whose target is their sum."""
    def stream(partition):
        index = 0
        while True:
            rng = np.random.default_rng(index)
            x = rng.normal(size=(8, 4)).astype(np.float32)
            yield {"x": x, "y": x.sum(axis=1, keepdims=True)}
            index += 1

    return Dataset(train=stream, val=None, records=None, batch=8)
