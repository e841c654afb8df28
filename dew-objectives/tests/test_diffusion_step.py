"""The diffusion training step carries no host callback, and a bad label is refused on the host.

A host callback in a compiled program, even one that never fires, makes a
CPU step run synchronously with the Python loop; the label and token-id
range checks therefore run in check_batch, before the step, and stay in
the program only for evaluation.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.data import Dataset
from dew.inputs import InvalidConditionError
from dew.nn.dit import DiT
from dew.objectives.diffusion import DiffusionObjective

MODEL = DiT(image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1, num_heads=2,
            mlp_features=32, num_classes=3)


def _batch(labels):
    rng = np.random.default_rng(0)
    return {"image": rng.integers(0, 256, (4, 8, 8, 1)).astype(np.uint8),
            "label": np.asarray(labels, np.int32)}


def test_the_compiled_step_has_no_host_callback():
    trainer = Trainer(DiffusionObjective(MODEL), optax.adam(1e-3), key=jax.random.key(0))
    state, _, _ = trainer.place()
    compiled = trainer.compile(state, jax.device_put(_batch([0, 1, 2, 3])))
    hlo = compiled.executable.as_text()
    assert "custom-call" not in hlo  # a host callback compiles to one


def test_a_label_out_of_range_is_refused_before_the_step():
    trainer = Trainer(DiffusionObjective(MODEL), optax.adam(1e-3), key=jax.random.key(0))
    data = Dataset(train=lambda partition: itertools.repeat(_batch([0, 1, 7, 2])), batch=4)
    with pytest.raises(InvalidConditionError, match=r"'label' holds 7.*num_classes=3"):
        trainer.fit(data, steps=1, log_every=1)
