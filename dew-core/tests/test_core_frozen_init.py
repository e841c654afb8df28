"""Frozen leaves, starting weights and random streams, against independent computations."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.objectives.base import Aux, EMASpec, Mean, Objective, under
from dew.testing.doubles import RecordingTracker
from dew.training.initializers import InitializerMismatchError, ParamsFrom
from dew.training.optim import OptimizerConfig, ParamGroup, build_optimizer
from dew.training.state import STREAMS, stream
from dew.training.trainer import FrozenTrainedError

WIDTH = 8


def dense(name, features):
    return nn.Dense(features, name=name, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))


class Pair(nn.Module):
    """A student and a teacher of the same shape, side by side."""

    width: int = WIDTH

    @nn.compact
    def __call__(self, x):
        return dense("student", self.width)(x), dense("teacher", self.width)(x)


class Distill(Objective):
    """The student learns to match a frozen teacher."""

    frozen = staticmethod(under("params/teacher"))

    def __init__(self, ema=None, width=WIDTH):
        self.model = Pair(width)
        self.ema = ema
        self.width = width

    def init(self, key, variables=None):
        return variables if variables is not None else self.model.init(key, jnp.zeros((1, self.width)))

    def loss(self, variables, batch, step):
        student, teacher = self.model.apply(variables, batch["x"])
        errors = (student - teacher) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size, jnp.float32)), Aux()


def batches(rows=8, width=WIDTH):
    def make(index):
        return {"x": np.random.default_rng(index).normal(size=(rows, width)).astype(np.float32)}

    class Counting:
        def __init__(self):
            self.index = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.index += 1
            return make(self.index - 1)

        def get_state(self):
            return str(self.index).encode()

        def set_state(self, state):
            self.index = int(state)

    return Dataset(train=lambda partition: Counting(), batch=rows), make


def paths_of(tree):
    return ["/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.slow
def test_frozen_leaves_never_train_and_exist_once():
    objective = Distill(ema=EMASpec(decay=0.5))
    data, make = batches()
    trainer = Trainer(objective, optax.adam(0.05), key=jax.random.key(0))
    initial = jax.device_get(trainer.initial_state().params)
    state = trainer.fit(data, steps=4, log_every=4)

    # An independent loop: adam on the student alone, the teacher a constant.
    student, teacher = initial["params"]["student"], initial["params"]["teacher"]
    tx = optax.adam(0.05)
    opt = tx.init(student)
    ema = student
    for i in range(4):
        def loss(p, x=make(i)["x"]):
            s = x @ p["kernel"] + p["bias"][None, :]
            t = x @ teacher["kernel"] + teacher["bias"][None, :]
            return jnp.sum((s - t) ** 2) / s.size
        grads = jax.grad(loss)(student)
        updates, opt = tx.update(grads, opt, student)
        student = optax.apply_updates(student, updates)
        ema = jax.tree.map(lambda e, s: 0.5 * e + 0.5 * s, ema, student)

    final = jax.device_get(state.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
                 final["params"]["student"], student)
    jax.tree.map(np.testing.assert_array_equal, final["params"]["teacher"], teacher)
    # No optimizer state, window or EMA copy holds the teacher; averaged still reads whole.
    assert not [p for p in paths_of(state.opt_state) if "teacher" in p]
    assert not [p for p in paths_of(state.ema) if "teacher" in p]
    averaged = jax.device_get(state.averaged)
    jax.tree.map(np.testing.assert_array_equal, averaged["params"]["teacher"], teacher)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
                 averaged["params"]["student"], ema)
    # Device bytes: the teacher once, the student in params, adam's two moments and the EMA.
    size = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    one = size(teacher)
    assert size(state.params) == 2 * one
    assert size(state.ema) == one
    assert size([x for x in jax.tree.leaves(state.opt_state) if x.ndim]) == 2 * one


def test_a_frozen_leaf_an_optimizer_group_trains_is_refused_naming_it():
    config = OptimizerConfig(solver="sgd", learning_rate=0.1,
                             groups=(ParamGroup(match=("params/teacher/*",), lr_scale=2.0),))
    trainer = Trainer(Distill(), build_optimizer(config), key=jax.random.key(0))
    with pytest.raises(FrozenTrainedError, match=r"params/teacher/(bias|kernel).*declares frozen"):
        trainer.place()


@pytest.mark.slow
def test_frozen_leaves_shard_by_the_layout_and_restore_from_a_checkpoint(python_in_subprocess, tmp_path):
    out = python_in_subprocess(f"""
        import sys
        import jax, numpy as np, optax
        from dew import Checkpoints, Trainer
        from dew.training.placement.mesh import MeshSpec
        sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})
        from test_core_frozen_init import Distill, batches
        data, _ = batches(rows=8, width=256)
        trainer = Trainer(Distill(width=256), optax.adam(1e-3), key=jax.random.key(0),
                          mesh=MeshSpec(fsdp=8), checkpoints=Checkpoints({str(tmp_path)!r}))
        state = trainer.fit(data, steps=2, log_every=2)
        kernel = state.params["params"]["teacher"]["kernel"]
        assert not kernel.sharding.is_fully_replicated, kernel.sharding
        assert len({{str(s.index) for s in kernel.addressable_shards}}) == 8
        before = jax.device_get(state.params)
        again = Trainer(Distill(width=256), optax.adam(1e-3), key=jax.random.key(0),
                        mesh=MeshSpec(fsdp=8), checkpoints=Checkpoints({str(tmp_path)!r}))
        restored, _, _ = again.place()
        jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(restored.params))
        print("ok", kernel.sharding.spec)
    """, devices=8)
    assert "\nok P('fsdp'" in out, out


def big_weights(width):
    model = Pair(width)
    return jax.device_get(nn.meta.unbox(model.init(jax.random.key(7), jnp.zeros((1, width)))))


def test_starting_weights_reach_the_initializer_as_arguments_not_constants():
    width = 256  # 256 KiB per kernel: far above any constant the initializer may hold
    weights = big_weights(width)
    trainer = Trainer(Distill(width=width), optax.adam(1e-3), key=jax.random.key(0), initializer=weights)
    state, shardings, _ = trainer.place()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), weights)
    placed = trainer.start.weights_on_mesh(shardings)
    text = jax.jit(trainer.initial_state, out_shardings=shardings).lower(placed, trainer.key).as_text()
    sizes = [int(np.prod([int(d) for d in dims.split("x")[:-1]] or [1])) * 4
             for dims in re.findall(r"constant dense<[^>]*> : tensor<([0-9x]*[a-z0-9]+)>", text)]
    assert sizes and max(sizes) <= 4096, max(sizes)
    assert "tensor<256x256xf32>" in text  # the kernels are there, as arguments


def test_weights_of_another_shape_are_refused_naming_the_leaf_and_both_shapes():
    weights = big_weights(WIDTH)
    weights["params"]["teacher"]["kernel"] = np.zeros((WIDTH, 3), np.float32)
    trainer = Trainer(Distill(), optax.adam(1e-3), key=jax.random.key(0), initializer=weights)
    with pytest.raises(InitializerMismatchError, match=r"params/teacher/kernel: shape \(8, 3\), expected \(8, 8\)"):
        trainer.place()


def test_params_from_another_runs_checkpoint_start_a_run_and_a_resume_ignores_them(tmp_path):
    data, _ = batches()
    first = Trainer(Distill(), optax.adam(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path / "a"))
    trained = jax.device_get(first.fit(data, steps=3, log_every=3).params)

    second = Trainer(Distill(), optax.adam(0.05), key=jax.random.key(1),
                     initializer=ParamsFrom(tmp_path / "a"), checkpoints=Checkpoints(tmp_path / "b"))
    state, _, _ = second.place()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), trained)
    assert int(state.step) == 0 and int(state.updates) == 0
    assert all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(jax.device_get(state.opt_state)) if x.ndim)
    second.fit(data, steps=2, log_every=2)
    resumed_params = jax.device_get(second.place()[0].params)

    # Its own checkpoint wins over the initializer when the run restarts.
    third = Trainer(Distill(), optax.adam(0.05), key=jax.random.key(1),
                    initializer=ParamsFrom(tmp_path / "a"), checkpoints=Checkpoints(tmp_path / "b"))
    restarted, _, _ = third.place()
    assert int(restarted.step) == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restarted.params), resumed_params)


def test_random_streams_never_meet_over_the_first_100000_steps():
    root = jax.random.key(0)
    count = 100_000
    steps = jnp.arange(count, dtype=jnp.uint32)

    def folded(branch, *more):
        def one(s):
            key = jax.random.fold_in(branch, s)
            for value in more:
                key = jax.random.fold_in(key, value)
            return jax.random.key_data(key)
        return jax.vmap(one)(steps)

    import zlib

    keys = [
        jax.random.key_data(stream(root, "init"))[None],
        folded(stream(root, "step")),
        folded(stream(root, "rollout")),
        folded(stream(root, "evaluation"), zlib.crc32(b"val")),
        folded(stream(root, "preview")),
    ]
    rows = np.concatenate([np.asarray(k, np.uint32).reshape(-1, 2) for k in keys])
    packed = rows[:, 0].astype(np.uint64) << np.uint64(32) | rows[:, 1].astype(np.uint64)
    assert len(np.unique(packed)) == len(packed) == 1 + 4 * count
    assert len(STREAMS) == 5


def test_the_step_and_the_rollout_draw_their_own_streams():
    class Draw(Objective):
        def init(self, key, variables=None):
            return {"params": {"w": jnp.zeros(())}}

        def loss(self, variables, batch, step):
            draw = jax.random.uniform(step.key)
            return Mean(variables["params"]["w"] ** 2, jnp.asarray(1.0)), Aux(metrics={"draw": draw})

    rollout_keys = []

    def rollout(state, batch, key):
        rollout_keys.append(np.asarray(jax.random.key_data(key)))
        return batch

    data = Dataset(train=lambda p: itertools.repeat({"x": np.zeros((1,), np.float32)}), batch=1)
    recording = RecordingTracker()
    trainer = Trainer(Draw(), optax.sgd(0.1), key=jax.random.key(3), tracker=recording, rollout=rollout)
    state = trainer.fit(data, steps=3, log_every=1)
    seen = recording.series("train/draw")
    assert len(seen) == 3
    for step, draw in seen:
        assert draw == pytest.approx(float(jax.random.uniform(state.key_for(step - 1))))
    for step, key in enumerate(rollout_keys):
        np.testing.assert_array_equal(key, jax.random.key_data(state.key_for(step, purpose="rollout")))
        assert not np.array_equal(key, jax.random.key_data(state.key_for(step)))
