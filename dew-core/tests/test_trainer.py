"""Trainer.fit against independent computations: a hand-written optax loop,
one larger batch for accumulation, hand-computed EMA; and its refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.data import Dataset
from dew.objectives.base import EMASpec, under
from dew.testing import doubles
from dew.training.placement.mesh import (
    BatchMismatchError,
    MeshSizeError,
    MeshSpec,
    build_mesh,
    shard_batch,
)
from dew.training.step import write_back
from dew.training.trainer import NonFiniteLossError

MLP = doubles.MLP
Regression = doubles.Regression
Recorder = doubles.RecordingTracker
Stream = doubles.RegressionStream
batch_at = doubles.regression_batch


def dataset(make=batch_at, rows=8) -> Dataset:
    return Dataset(train=lambda partition: Stream(make), val=None, records=None, batch=rows)


@pytest.mark.slow
def test_fit_matches_a_hand_written_optax_loop():
    objective, recorder = Regression(), Recorder()
    optimizer = optax.adam(1e-2)
    trainer = Trainer(objective, optimizer, key=jax.random.key(3), tracker=recorder)
    initial = trainer.initial_state().params
    state = trainer.fit(dataset(), steps=12, log_every=1)
    losses = [row["train/loss"] for _, row in recorder.rows]

    params = initial["params"]
    opt_state = optimizer.init({"params": params})

    def mean_loss(p, batch):
        errors = (objective.model.apply({"params": p["params"]}, batch["x"]) - batch["y"]) ** 2
        return jnp.mean(errors)

    @jax.jit
    def step(p, s, batch):
        loss, grads = jax.value_and_grad(mean_loss)(p, batch)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    expected, p = [], {"params": params}
    for i in range(12):
        p, opt_state, loss = step(p, opt_state, batch_at(i))
        expected.append(float(loss))
    np.testing.assert_allclose(losses, expected, rtol=2e-5)
    assert [s for s, _ in recorder.rows] == list(range(1, 13))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 state.params["params"], p["params"])
    assert int(state.step) == int(state.microstep) == int(state.updates) == 12


def test_bfloat16_parameters_train_as_a_hand_written_loop_and_keep_their_dtype():
    """Parameters stored in bfloat16 under a scheduled AdamW: the state keeps every dtype it was made
    with (the step used to promote the moments to float32 and its accept/reject branches disagreed)."""
    from flax import linen as nn

    objective = doubles.Linear()
    objective.model = nn.Dense(1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    optimizer = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 6), weight_decay=0.01)
    trainer = Trainer(objective, optimizer, key=jax.random.key(0))
    initial = trainer.initial_state()
    state = trainer.fit(dataset(), steps=6, log_every=6)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert jax.tree.map(lambda x: x.dtype, state.opt_state) == jax.tree.map(lambda x: x.dtype, initial.opt_state)

    def total(p, batch):  # the objective's loss, written out: the squared errors' sum over their count
        errors = (objective.model.apply(p, batch["x"]) - batch["y"]) ** 2
        return jnp.sum(errors), errors.size

    p, s = initial.params, optimizer.init(initial.params)
    for i in range(6):
        grads, count = jax.grad(total, has_aux=True)(p, batch_at(i))
        grads = jax.tree.map(lambda g, n=count: (g / n).astype(g.dtype), grads)
        updates, s = optimizer.update(grads, s, p)
        p = optax.apply_updates(p, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=2e-2, atol=2e-2),
                 state.params, p)


def test_float16_parameters_train_with_a_float32_optimizer_state_as_a_hand_written_loop():
    """float16 weights: every step was rejected as non-finite (the gradients' norm was summed in
    float16 and overflowed while each entry was finite), and with the norm aside Adam's second
    moment, held and updated in float16, underflowed to zero and the run went to NaN."""
    from flax import linen as nn

    def large(i):  # totals of squared errors whose gradient entries fit float16, their squares do not
        batch = batch_at(i, 16)
        return {"x": batch["x"] * 3, "y": batch["y"] * 3}

    objective = doubles.Linear()
    objective.model = nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float16)
    optimizer = optax.adam(1e-2)
    trainer = Trainer(objective, optimizer, key=jax.random.key(0))
    initial = trainer.initial_state()
    state = trainer.fit(dataset(large, 16), steps=6, log_every=6)
    assert int(state.updates) == 6  # none rejected
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float16)}
    assert {leaf.dtype for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim} == {jnp.dtype(jnp.float32)}

    def total(p, batch):
        errors = (objective.model.apply(p, batch["x"]) - batch["y"]) ** 2
        return jnp.sum(errors), errors.size

    grads, _ = jax.grad(total, has_aux=True)(initial.params, large(0))
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert not np.isfinite(optax.tree.norm(grads))  # in float16, the norm alone overflows
    wide = lambda tree: jax.tree.map(lambda leaf: leaf.astype(jnp.float32), tree)  # noqa: E731
    p, s = initial.params, optimizer.init(wide(initial.params))
    for i in range(6):
        grads, count = jax.grad(total, has_aux=True)(p, large(i))
        grads = jax.tree.map(lambda g, n=count: (g / n).astype(g.dtype), grads)
        updates, s = optimizer.update(wide(grads), s, p)
        p = optax.apply_updates(p, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-2, atol=1e-2),
                 state.params, p)


def test_a_loss_scale_and_accumulation_keep_bfloat16_gradients_in_their_window():
    """Unscaled by the float32 loss scale, bfloat16 gradients came back float32 and the window's
    accept/reject branches disagreed: a jax TypeError before the first step."""
    from flax import linen as nn

    objective = doubles.Linear()
    objective.model = nn.Dense(1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), dynamic_scale=True, accumulation=2)
    state = trainer.fit(dataset(), steps=4, log_every=4)
    assert int(state.updates) == 2 and int(state.microstep) == 4
    assert {leaf.dtype for leaf in jax.tree.leaves(state.window.grads)} == {jnp.dtype(jnp.bfloat16)}


def test_an_ema_of_bfloat16_weights_moves_as_a_float32_average_does():
    """At a decay of 0.999 a step moves the average by a thousandth of its gap to the weights, below
    bfloat16's resolution: kept in bfloat16, the average never left its first value. It is kept in
    float32 and read (state.averaged) in the weights' dtype."""
    from flax import linen as nn

    objective = doubles.Linear(ema=EMASpec(0.999))
    objective.model = nn.Dense(1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    trainer = Trainer(objective, optax.sgd(0.05), key=jax.random.key(0))
    state, _, _ = trainer.place()
    partition = trainer_partition(trainer)
    compiled = trainer.compile(state, shard_batch(batch_at(0), trainer.device_mesh, partition))
    average = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(state.params))
    for i in range(20):
        rate = np.float32(objective.ema.rate(jnp.int32(i)))
        state, _ = compiled(state, shard_batch(batch_at(i), trainer.device_mesh, partition))
        weights = jax.device_get(state.params)
        average = jax.tree.map(lambda a, w, r=rate: r * a + (np.float32(1) - r) * np.float32(w), average, weights)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.ema)} == {jnp.dtype(jnp.float32)}
    # The average moved as the float32 one did, to within a tenth of its way (XLA may hand it each
    # update before the weights are rounded to bfloat16); kept in bfloat16 it did not move at all.
    initial = jax.device_get(trainer.initial_state().params)
    for got, want, start in zip(jax.tree.leaves(jax.device_get(state.ema)), jax.tree.leaves(average),
                                jax.tree.leaves(initial), strict=True):
        way = np.abs(want - np.float32(start))
        assert way.min() > 1e-4 and np.all(np.abs(np.asarray(got) - want) < 0.1 * way), (got, want, start)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.averaged)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.slow
def test_accumulation_equals_one_batch_k_times_larger():
    k, rows = 4, 2
    small = Trainer(Regression(), optax.sgd(0.05, momentum=0.9), key=jax.random.key(0), accumulation=k)
    accumulated = small.fit(dataset(lambda i: batch_at(i, rows), rows), steps=3 * k, log_every=k)

    def big(i):
        parts = [batch_at(i * k + j, rows) for j in range(k)]
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    large = Trainer(Regression(), optax.sgd(0.05, momentum=0.9), key=jax.random.key(0))
    reference = large.fit(dataset(big, rows * k), steps=3, log_every=3)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 accumulated.params, reference.params)
    assert int(accumulated.updates) == 3 and int(accumulated.microstep) == 3 * k
    assert int(accumulated.window.filled) == 0


@pytest.mark.slow
def test_the_step_traces_once_and_donates_the_state_not_the_batch():
    objective = Regression()
    trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0))
    trainer.fit(dataset(), steps=15, log_every=4)
    assert objective.traces == 1

    state, _, _ = trainer.place()
    batch = shard_batch(batch_at(0), trainer.device_mesh, trainer_partition(trainer))
    compiled = trainer.compile(state, batch)
    old_leaf = state.params["params"]["Dense_0"]["kernel"]
    new, _ = compiled(state, batch)
    assert old_leaf.is_deleted()
    assert not batch["x"].is_deleted()
    assert int(new.step) == 1


def trainer_partition(trainer):
    from dew.training.placement.mesh import data_partition

    return data_partition(trainer.device_mesh)


def test_the_last_step_is_logged_off_the_cadence_and_a_short_run_logs_ten_times():
    """Issue 38: the last step is always logged, also when log_every does not divide it; a run
    shorter than log_every logs at least ten times over its steps."""
    recorder = Recorder()
    Trainer(Regression(), optax.sgd(0.01), key=jax.random.key(0), tracker=recorder).fit(
        dataset(), steps=25, log_every=4)
    assert [step for step, _ in recorder.series("train/loss")] == [4, 8, 12, 16, 20, 24, 25]
    recorder = Recorder()
    Trainer(Regression(), optax.sgd(0.01), key=jax.random.key(0), tracker=recorder).fit(
        dataset(), steps=23, log_every=100)
    assert [step for step, _ in recorder.series("train/loss")] == [*range(2, 23, 2), 23]


def test_dynamic_scale_rejects_non_finite_steps_and_counts_the_attempt():
    def poisoned(i):
        batch = batch_at(i)
        batch["poison"] = np.full((8,), 1.0 if i in (1, 2) else 0.0, np.float32)
        return batch

    trainer = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0), dynamic_scale=True)
    state, _, _ = trainer.place()
    partition = trainer_partition(trainer)
    compiled = trainer.compile(state, shard_batch(poisoned(0), trainer.device_mesh, partition))
    history = []
    for i in range(4):
        before = jax.device_get(state.params)
        state, metrics = compiled(state, shard_batch(poisoned(i), trainer.device_mesh, partition))
        history.append((jax.device_get(metrics), before, jax.device_get(state.params)))
    assert int(state.step) == 4 and int(state.updates) == 2 and int(state.microstep) == 2
    for i in (1, 2):
        metrics, before, after = history[i]
        assert not metrics["finite"]
        jax.tree.map(np.testing.assert_array_equal, before, after)
    assert float(history[1][0]["loss_scale"]) == 2.0**15 / 2
    assert float(state.scaler.scale) == 2.0**15 / 4
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


def test_a_float16_loss_scale_scales_the_mean_loss_so_a_batch_of_many_rows_trains():
    """The scale multiplied the loss summed over the batch, so float16 gradients carried it times the
    count: over 16384 rows they overflowed at every scale down to the floor of 1, and no step was ever
    taken. The mean is scaled now (the sum over a power of two at most the count), so a few halvings
    find a scale, and the update taken is the float32 mean gradient's."""
    from flax import linen as nn

    from dew.objectives.base import Aux, Mean

    class Summed(doubles.Linear):  # float16 predictions, their squared errors summed in float32
        def loss(self, variables, batch, step):
            errors = (self.model.apply(variables, batch["x"]) - batch["y"].astype(jnp.float16)) ** 2
            return Mean(jnp.sum(errors.astype(jnp.float32)), jnp.asarray(errors.size, jnp.float32)), Aux()

    objective, rate, rows = Summed(), 1e-3, 16384
    objective.model = nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float16)
    trainer = Trainer(objective, optax.sgd(rate), key=jax.random.key(0), dynamic_scale=True)
    state, _, _ = trainer.place()
    partition = trainer_partition(trainer)
    batch = batch_at(0, rows)
    compiled = trainer.compile(state, shard_batch(batch, trainer.device_mesh, partition))
    rejected = 0
    while True:
        before = jax.device_get(state.params)
        state, metrics = compiled(state, shard_batch(batch, trainer.device_mesh, partition))
        if bool(metrics["finite"]) or rejected == 8:
            break
        rejected += 1
    assert bool(metrics["finite"]) and rejected <= 4, (rejected, float(state.scaler.scale))

    def mean_loss(params):  # by hand, in float32, from the float16 weights the step started from
        kernel, bias = params["params"]["kernel"], params["params"]["bias"]
        return jnp.mean((batch["x"] @ kernel + bias[None, :] - batch["y"]) ** 2)

    wide = jax.tree.map(lambda x: np.asarray(x, np.float32), before)
    expected = jax.tree.map(lambda p, g: p - rate * g, wide, jax.grad(mean_loss)(wide))
    for got, want, start in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(expected),
                                jax.tree.leaves(wide), strict=True):
        np.testing.assert_allclose(np.float32(got) - start, want - start, rtol=0.05, atol=2e-3)


def test_repeated_non_finite_losses_stop_the_run_naming_the_step():
    def poisoned(i):
        batch = batch_at(i)
        batch["poison"] = np.full((8,), 1.0 if i >= 3 else 0.0, np.float32)
        return batch

    trainer = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(NonFiniteLossError, match=r"Step 8 .*5th step in a row.*start a new run with "
                                                 r"trainer.dynamic_scale=true"):
        trainer.fit(dataset(poisoned), steps=40, log_every=10)
    # with the scale on, turning it on is no advice: it was told to a run whose scale sat at its floor
    scaled = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0), dynamic_scale=True)
    with pytest.raises(NonFiniteLossError, match=r"the dynamic loss scale is on, and halved at each rejected") as raised:
        scaled.fit(dataset(poisoned), steps=80, log_every=10)
    assert "dynamic_scale=true" not in str(raised.value)


def test_weights_an_update_made_non_finite_stop_the_run_before_they_are_checkpointed(tmp_path):
    """An infinite learning rate: step 1's loss and gradients are finite, its update is not, and every
    later step is rejected. A run shorter than the guard's limit (five in a row) ended as if it had
    trained, and checkpointed the broken weights."""
    from dew import Checkpoints

    short = Trainer(Regression(), optax.sgd(float("inf")), key=jax.random.key(0))
    with pytest.raises(NonFiniteLossError, match=r"Step 3 was rejected \(2 in a row\) because the weights themselves"):
        short.fit(dataset(), steps=3, log_every=1)
    saving = Trainer(Regression(), optax.sgd(float("inf")), key=jax.random.key(0),
                     checkpoints=Checkpoints(tmp_path))
    with pytest.raises(NonFiniteLossError, match=r"Step 2 was rejected \(1 in a row\)"):
        saving.fit(dataset(), steps=6, log_every=1, checkpoint_every=2)
    assert Checkpoints(tmp_path).latest is None  # nothing of them was written

    # A rejected step on finite weights (a poisoned batch) is not that: the run ends as before.
    def poisoned(i):
        batch = batch_at(i)
        batch["poison"] = np.full((8,), 1.0 if i == 2 else 0.0, np.float32)
        return batch

    state = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0)).fit(dataset(poisoned), steps=3, log_every=1)
    assert int(state.updates) == 2


@pytest.mark.slow
def test_ema_follows_the_selected_leaves_only():
    spec = EMASpec(decay=0.5, select=under("params/Dense_0"))
    trainer = Trainer(Regression(ema=spec), optax.sgd(0.1), key=jax.random.key(1))
    initial = jax.device_get(trainer.initial_state().params)
    snapshots = []

    class Spy(Recorder):
        pass

    # Run step by step through the compiled transaction to see each update.
    state, _, _ = trainer.place()
    partition = trainer_partition(trainer)
    compiled = trainer.compile(state, shard_batch(batch_at(0), trainer.device_mesh, partition))
    for i in range(3):
        state, _ = compiled(state, shard_batch(batch_at(i), trainer.device_mesh, partition))
        snapshots.append(jax.device_get(state.params))
    expected = initial["params"]["Dense_0"]["kernel"]
    for snap in snapshots:
        expected = 0.5 * expected + 0.5 * snap["params"]["Dense_0"]["kernel"]
    averaged = jax.device_get(state.averaged)
    np.testing.assert_allclose(averaged["params"]["Dense_0"]["kernel"], expected, rtol=1e-6)
    # An unselected leaf is the live one.
    np.testing.assert_array_equal(averaged["params"]["Dense_1"]["kernel"],
                                  snapshots[-1]["params"]["Dense_1"]["kernel"])


def test_write_back_replaces_collections_but_never_params():
    merged = write_back({"params": {"w": 1}, "stats": {"m": 0}}, {"params": {"w": 5}, "stats": {"m": 2}})
    assert merged == {"params": {"w": 1}, "stats": {"m": 2}}


def test_a_batch_missing_a_key_is_refused_by_name():
    def no_y(i):
        return {"x": batch_at(i)["x"]}

    trainer = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(BatchMismatchError, match=r"no key 'y'"):
        trainer.fit(dataset(no_y), steps=2)


def test_a_batch_of_another_shape_is_refused_naming_both_shapes():
    def shrinking(i):
        return batch_at(i, 8 if i < 2 else 4)

    trainer = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(BatchMismatchError, match=r"'x' has shape \(4, 4\).*expects shape \(8, 4\)"):
        trainer.fit(dataset(shrinking), steps=5)


def test_mesh_sizes_that_do_not_divide_the_devices_are_refused():
    with pytest.raises(MeshSizeError, match=r"fsdp=3 .* do not divide the 1 devices"):
        build_mesh(MeshSpec(fsdp=3))


