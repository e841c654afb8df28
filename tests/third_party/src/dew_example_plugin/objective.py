"""Least-squares regression of batch["y"] on batch["x"] with the example Regressor."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew.objectives.base import Aux, Batch, Mean, Objective, Step, Variables
from dew_example_plugin.model import Regressor

__all__ = ["RegressionObjective"]


class RegressionObjective(Objective):
    """Mean squared error of Regressor(features) on inputs-wide rows."""

    def __init__(self, inputs: int = 4, features: int = 1) -> None:
        self.inputs = inputs
        self.model = Regressor(features=features)

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        if variables is not None:
            return variables
        return self.model.init(key, jnp.zeros((1, self.inputs), jnp.float32))

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        errors = (self.model.apply(variables, batch["x"]) - batch["y"]) ** 2
        return Mean.of(errors), Aux()

    def required_keys(self) -> tuple[str, ...]:
        return ("x", "y")
