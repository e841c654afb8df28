"""A plugin's own model and objective, trained from a recipe, exported and sampled from the export.

A plugin's pipeline returns a Pretrained of its model and variables (docs/plugins.md). Its export
recorded no task, so dew generate on the exported folder was refused, advising the very route that
had been taken; dew export now records the run's objective as the task of a model that is no
language model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from dew import registry
from dew.cli import main
from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective
from dew.objectives.inference import Generated, Pipeline, variables_of
from dew.pretrained import Pretrained
from dew.recipes import RunConfig


class Slope(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(x)


@dataclass(frozen=True)
class Values(Pipeline):
    model: Any
    variables: Any
    scale: float
    accepts = "numbers, one value each"

    def generate(self, request):
        x = np.array([[float(p)] for p in request.inputs], np.float32)
        y = np.asarray(self.model.apply(self.variables, x))[:, 0] * self.scale
        return Generated(texts=tuple(f"{p} -> {v:.3f}" for p, v in zip(request.inputs, y, strict=True)),
                         samples=len(y))

    def pretrained(self):
        return Pretrained(self.model, self.variables)  # no task: the run's objective is recorded by the export


@dataclass(frozen=True)
class Fit(Objective):
    run_inputs: ClassVar[frozenset[str]] = frozenset({"model"})
    model: Any = None
    scale: float = 1.0

    def init(self, key, variables=None):
        return self.model.init(key, jnp.zeros((1, 1)))

    def loss(self, variables, batch, step):
        errors = (self.model.apply(variables, batch["x"]) - 2 * batch["x"]) ** 2
        return Mean(errors.sum(), jnp.asarray(errors.size, jnp.float32)), Aux()

    def pipeline(self, state):
        return Values(self.model, variables_of(state), self.scale)


class Points:
    def __init__(self, count: int = 8):
        self.x = np.linspace(-1, 1, count, dtype=np.float32)[:, None]

    def load(self, *, batch, seed=0):
        rows = {"x": self.x[:batch]}
        return Dataset(train=lambda partition: iter(lambda: rows, None), records=len(self.x), batch=batch)


def test_a_plugins_run_exports_a_folder_dew_generate_reads_back(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe = {"model": {"name": "slope"}, "objective": {"name": "fit", "scale": 3.0},
              "data": {"name": "points", "count": 8, "batch": 8},
              "optimizer": {"solver": "sgd", "learning_rate": 0.1, "schedule": "constant"},
              "trainer": {"steps": 20, "log_every": 10, "checkpoint_dir": "runs/fit"}}
    with (registry.models.temporary("slope", Slope), registry.objectives.temporary("fit", Fit),
          registry.datasets.temporary("points", Points)):
        RunConfig.parse(recipe).train()
        capsys.readouterr()
        assert main(["generate", "runs/fit", "0.5"]) == 0
        from_run = capsys.readouterr().out
        assert main(["export", "runs/fit", "exported"]) == 0
        capsys.readouterr()
        assert main(["generate", "exported", "0.5"]) == 0  # refused: "These Slope weights record no task"
        from_export = capsys.readouterr().out
    assert "0.5 -> " in from_export and from_export == from_run  # scale 3.0 came back with the task
