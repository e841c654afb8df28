"""The initializer compiles for one run: unoptimized on CPU for a small model, with XLA's defaults above."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import linen as nn

from dew import Trainer
from dew.data import Dataset
from dew.testing.doubles import NextToken
from dew.training.execution import QUICK_INIT_PARAMETERS, run_once_options
from dew.training.state import stream


def test_a_small_cpu_model_compiles_its_initializer_unoptimized_and_a_large_one_with_the_defaults():
    mesh = jax.make_mesh((1,), ("data",))
    small = {"params": {"w": jax.ShapeDtypeStruct((QUICK_INIT_PARAMETERS,), np.float32)}}
    large = {"params": {"w": jax.ShapeDtypeStruct((QUICK_INIT_PARAMETERS + 1,), np.float32)}}
    assert run_once_options(mesh, small) == {"xla_backend_optimization_level": 0}
    assert run_once_options(mesh, large) is None


def test_a_fresh_runs_weights_are_the_objectives_init_compiled_as_the_trainer_says():
    objective = NextToken(nn.Sequential([nn.Embed(97, 16), nn.Dense(97)]), seq_len=8)
    trainer = Trainer(objective, optax.sgd(0.0), key=jax.random.key(5))
    rows = np.random.default_rng(0).integers(0, 97, size=(4, 9)).astype(np.int32)
    state = trainer.fit(Dataset(train=lambda p: iter([{"text": rows}] * 2), batch=4), steps=1)
    options = run_once_options(trainer.device_mesh, trainer.start.boxed)
    assert options is not None  # a model this small, on CPU
    init = jax.jit(lambda k: nn.meta.unbox(objective.init(stream(k, "init"))), compiler_options=options)
    expected = jax.device_get(init(trainer.key)["params"])
    got = jax.device_get(state.params["params"])  # sgd at rate 0 leaves them as they started
    # (a default-compiled init differs from these in 117 of its 3,201 values)
    assert jax.tree.all(jax.tree.map(np.array_equal, got, expected))
