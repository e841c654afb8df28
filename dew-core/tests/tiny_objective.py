"""The smallest objective a fit trains (one Dense unit towards 1.0) and its endless stream of ones:
for tests about the loop, its checkpoints and its stops rather than about learning. Shared by
dew-core's tests, in-process and in the scripts they run in a child process."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective


class Tiny(Objective):
    def __init__(self) -> None:
        self.model = nn.Dense(features=1)

    def init(self, key, variables=None):
        return self.model.init(key, jnp.zeros((1, 2), jnp.float32))

    def loss(self, variables, batch, step):
        errors = (self.model.apply(variables, batch["x"]) - 1.0) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size)), Aux(metrics={})


def ones(partition):
    while True:
        yield {"x": np.ones((4, 2), np.float32)}


DATA = Dataset(train=ones, batch=4)
