"""Writes narrow_ema_checkpoint/: a bfloat16 run whose EMA was kept in bfloat16, as dew did before it
kept the EMA of reduced-precision weights in float32.

Run once, by that dew: a 2 -> 1 dense layer with bfloat16 weights and an EMA,
saved after three steps. expected.json records the saved EMA and weights
(as float32 numbers, which bfloat16 widens to exactly), so a later dew
that reads the checkpoint can be checked against them.

Orbax writes the directory it committed into commit_success.txt; the
committed copy was written to /tmp/dew-fixture/narrow_ema_checkpoint and
then copied here (``python make_narrow_ema_checkpoint.py /tmp/dew-fixture/narrow_ema_checkpoint``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.objectives.base import Aux, EMASpec, Mean, Objective


class Line(Objective):
    """A 2 -> 1 dense layer in bfloat16 fitting y = x0 - 2 x1, with an EMA of every leaf."""

    ema = EMASpec(decay=0.5)

    def __init__(self) -> None:
        self.model = nn.Dense(features=1, param_dtype=jnp.bfloat16)

    def init(self, key, variables=None):
        return variables if variables is not None else self.model.init(key, jnp.zeros((1, 2), jnp.float32))

    def loss(self, variables, batch, step):
        errors = (self.model.apply(variables, batch["x"])[:, 0].astype(jnp.float32) - batch["y"]) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size)), Aux(metrics={})


def batches(partition):
    """Batch i: four rows drawn from a generator seeded with i (the same on every run)."""
    index = 0
    while True:
        x = np.random.default_rng(index).normal(size=(4, 2)).astype(np.float32)
        yield {"x": x, "y": (x[:, 0] - 2 * x[:, 1]).astype(np.float32)}
        index += 1


DATA = Dataset(train=batches, batch=4)


def trainer(directory: Path) -> Trainer:
    return Trainer(Line(), optax.adam(0.05), key=jax.random.key(3), checkpoints=Checkpoints(directory, keep=None))


def main(target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    run = trainer(target / "run")
    state = run.fit(DATA, steps=3, checkpoint_every=3)
    run.checkpoints.close()
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(state.ema))  # the old layout

    def leaves(tree):
        return {"/".join(str(p.key) for p in path): np.asarray(leaf, np.float32).tolist()
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    expected = {"step": int(state.step), "params": leaves(state.params), "ema": leaves(state.ema)}
    (target / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "narrow_ema_checkpoint")
