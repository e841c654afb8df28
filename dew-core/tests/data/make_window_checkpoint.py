"""Writes window_checkpoint/: a run checkpointed halfway through an accumulation window.

Run once, by the trainer that wrote the old layout (accumulation as a
grads-sized window carried across steps): two microbatches per update, a
dynamic loss scale and an EMA, stopped after three steps, so the saved
state holds a window with one microbatch in it. expected.json records what
that trainer computed when the run went on to step 6, so a later trainer
that resumes the old layout can be checked against it.

Orbax writes the directory it committed into commit_success.txt; the
committed copy was written to /tmp/dew-fixture/window_checkpoint and then
copied here (``python make_window_checkpoint.py /tmp/dew-fixture/window_checkpoint``).
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
    """A 2 -> 1 dense layer fitting y = x0 - 2 x1, with an EMA of every leaf."""

    ema = EMASpec(decay=0.5)

    def __init__(self) -> None:
        self.model = nn.Dense(features=1)

    def init(self, key, variables=None):
        return variables if variables is not None else self.model.init(key, jnp.zeros((1, 2), jnp.float32))

    def loss(self, variables, batch, step):
        errors = (self.model.apply(variables, batch["x"])[:, 0] - batch["y"]) ** 2
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
    return Trainer(Line(), optax.adam(0.05), key=jax.random.key(3), accumulation=2, dynamic_scale=True,
                   checkpoints=Checkpoints(directory, keep=None))


def main(target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    run = trainer(target / "run")
    state = run.fit(DATA, steps=3, checkpoint_every=3)
    run.checkpoints.close()
    assert int(state.step) == 3 and int(state.updates) == 1 and int(state.window.filled) == 1
    # The continuation this trainer computes from the saved step, in a scratch copy.
    scratch = target.parent / ".window_checkpoint_scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(target / "run", scratch)
    again = trainer(scratch)
    final = again.fit(DATA, steps=6)
    again.checkpoints.close()
    shutil.rmtree(scratch)

    def leaves(tree):
        return {"/".join(str(p.key) for p in path): np.asarray(leaf).tolist()
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    expected = {"step": int(final.step), "updates": int(final.updates), "microstep": int(final.microstep),
                "params": leaves(final.params), "ema": leaves(final.ema),
                "loss_scale": float(final.scaler.scale)}
    (target / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "window_checkpoint")
