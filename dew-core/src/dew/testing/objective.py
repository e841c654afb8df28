"""ObjectiveKit: the checks every Objective passes, as a base class for a test suite.

Subclass it in a test module, name the subclass ``Test...`` so pytest
collects it, and supply the objective and one training batch::

    class TestMyObjective(ObjectiveKit):
        def objective(self):
            return MyObjective(...)

        def batch(self):
            return {"x": ..., "y": ...}

The inherited tests check what the trainer relies on: ``init`` gives Flax
variables with a ``params`` collection; ``loss`` gives a scalar ``Mean`` and
an ``Aux``, compiles, and differentiates; the Mean's total and count add
up over microbatches, so two accumulated halves train exactly like one
batch (checked against plain ``jax.grad`` on the whole batch); the EMA's
filter picks leaves that exist; the leaves the objective declares frozen
get no optimizer state and do not move; the trainer's gradient over
``devices`` fake CPU devices (a child process, data parallel) equals the
one this process computes on one device; and a run stopped at a checkpoint
and resumed ends bitwise where an uninterrupted run does. The class must be
defined at the top level of its module for the many-device check, which
loads it again in the child.

A loss that draws noise from ``step.key`` cannot equal itself on another
split of the batch; set ``stochastic = True`` and the microbatch test
checks the counts exactly and the accumulated step against the same
microbatches differentiated by hand with the keys the trainer gives them.
"""

from __future__ import annotations

import math
import tempfile
import unittest
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from dew.data.base import Dataset
from dew.objectives.base import Aux, Mean, Objective, Step, Variables
from dew.training.ema import ema_leaves
from dew.training.state import TrainState
from dew.training.step import build_train_step
from dew.training.trainer import Trainer
from dew.training.trees import overlay, paths, select, trains

__all__ = ["ObjectiveKit", "gradient_recorder", "split_rows"]


def gradient_recorder(learning_rate: float) -> optax.GradientTransformation:
    """Plain SGD whose state is the last gradient it applied, so a test reads it exactly."""

    def init(params: optax.Params) -> optax.OptState:
        return jax.tree.map(jnp.zeros_like, params)

    def update(grads: optax.Updates, state: optax.OptState,
               params: optax.Params | None = None) -> tuple[optax.Updates, optax.OptState]:
        return jax.tree.map(lambda g: -learning_rate * g, grads), grads

    return optax.GradientTransformation(init, update)


def split_rows(batch: Mapping[str, Any], parts: int) -> list[dict[str, Any]]:
    """Cut every array of batch into parts equal runs of rows, in order."""
    rows = {np.shape(v)[0] for v in batch.values() if np.ndim(v)}
    if len(rows) != 1:
        raise ValueError(f"The batch's arrays disagree on their rows ({sorted(rows)}); override split().")
    (count,) = rows
    if count % parts:
        raise ValueError(f"A batch of {count} rows does not split into {parts} microbatches; "
                         f"give batch() a multiple of {parts} rows.")
    size = count // parts
    return [{k: v[i * size:(i + 1) * size] if np.ndim(v) else v for k, v in batch.items()}
            for i in range(parts)]


def _step(index: int, key: jax.Array) -> Step:
    at = jnp.asarray(index, jnp.int32)
    return Step(step=at, microstep=at, updates=jnp.asarray(0, jnp.int32), key=key)


def _close(actual: Any, expected: Any, rtol: float, atol: float, what: str) -> None:
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0],
                            jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol,
                                   atol=atol, err_msg=f"{what} at {jax.tree_util.keystr(path)}")


class ObjectiveKit:
    """Conformance tests for an Objective (see the module docstring).

    Override ``objective`` and ``batch``; ``split`` when rows do not split
    evenly into independent groups (pairs, groups of completions); and the
    tolerances for a low-precision model.
    """

    seed: int = 0
    microbatches: int = 2
    devices: int = 8
    resume_steps: tuple[int, int] = (2, 3)  # stop at the first, finish at the second
    stochastic: bool = False
    learning_rate: float = 0.1
    rtol: float = 2e-4
    atol: float = 1e-6

    # -- what a subclass supplies ------------------------------------------------------
    def objective(self) -> Objective:
        """The objective under test, freshly built."""
        raise NotImplementedError(f"{type(self).__name__} must define objective().")

    def batch(self) -> Mapping[str, Any]:
        """One global training batch whose rows split into ``microbatches`` parts."""
        raise NotImplementedError(f"{type(self).__name__} must define batch().")

    def split(self, batch: Mapping[str, Any], parts: int) -> list[dict[str, Any]]:
        """batch as parts microbatches, as a data pipeline would cut it (default: row runs)."""
        return split_rows(batch, parts)

    # -- helpers -------------------------------------------------------------------------
    def _key(self) -> jax.Array:
        return jax.random.key(self.seed)

    def _variables(self, objective: Objective) -> dict[str, Any]:
        return dict(nn.meta.unbox(objective.init(self._key())))

    def _start(self, objective: Objective, optimizer: optax.GradientTransformation,
               accumulation: int = 1) -> TrainState:
        """The state a run's trainer starts from."""
        trainer = Trainer(objective, optimizer, key=self._key(), accumulation=accumulation)
        return trainer.initial_state()

    def _trainable(self, objective: Objective, variables: Variables) -> dict[str, Any]:
        return select(variables, trains(objective.frozen))

    # -- init ------------------------------------------------------------------------------
    def test_init_returns_flax_variables(self) -> None:
        objective = self.objective()
        init = lambda k: nn.meta.unbox(objective.init(k))  # noqa: E731
        variables = init(self._key())
        assert isinstance(variables, Mapping) and "params" in variables, (
            f"{type(objective).__name__}.init must return Flax variables with a 'params' collection, "
            f"got {type(variables).__name__} with keys {sorted(variables) if isinstance(variables, Mapping) else '-'}.")
        leaves = jax.tree.leaves(variables)
        assert leaves, f"{type(objective).__name__}.init returned no arrays."
        for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
            assert isinstance(leaf, jax.Array | np.ndarray | np.generic), (
                f"init's leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an array.")
        again = init(self._key())
        _close(again, variables, 0, 0, "init with the same key gives another value")

    def test_init_from_given_variables_keeps_the_tree(self) -> None:
        objective = self.objective()
        fresh = jax.eval_shape(lambda k: nn.meta.unbox(objective.init(k)), self._key())
        given = jax.eval_shape(lambda k, v: nn.meta.unbox(objective.init(k, v)), self._key(), fresh)
        shapes = lambda tree: {p: (tuple(x.shape), str(x.dtype))  # noqa: E731
                               for p, x in zip(paths(tree), jax.tree.leaves(tree), strict=True)}
        assert shapes(given) == shapes(fresh), (
            f"{type(objective).__name__}.init(key, variables) must return the tree and shapes of a "
            "fresh init built from the given weights.")

    # -- loss ------------------------------------------------------------------------------
    def test_loss_returns_a_scalar_mean_and_aux(self) -> None:
        objective = self.objective()
        loss, aux = objective.loss(self._variables(objective), self.batch(), _step(0, self._key()))
        name = type(objective).__name__
        assert isinstance(loss, Mean), f"{name}.loss must return a Mean first, got {type(loss).__name__}."
        assert isinstance(aux, Aux), f"{name}.loss must return an Aux second, got {type(aux).__name__}."
        assert np.shape(loss.total) == () and np.shape(loss.count) == (), (
            f"{name}.loss's Mean must hold scalars, got total {np.shape(loss.total)} and count "
            f"{np.shape(loss.count)}.")
        assert np.isfinite(float(loss.total)), f"{name}.loss's total is {float(loss.total)}."
        assert float(loss.count) > 0, f"{name}.loss's count is {float(loss.count)}; it must count what it averages."
        for metric, value in aux.metrics.items():
            scalar = value.value if isinstance(value, Mean) else jnp.mean(jnp.asarray(value, jnp.float32))
            assert np.isfinite(float(scalar)), f"{name}'s metric {metric!r} is {float(scalar)}."

    def test_loss_compiles_and_matches_eager(self) -> None:
        objective = self.objective()
        variables, batch, step = self._variables(objective), self.batch(), _step(0, self._key())
        eager = objective.loss(variables, batch, step)[0]
        jitted = jax.jit(lambda v, b, s: objective.loss(v, b, s)[0])(variables, batch, step)
        _close((jitted.total, jitted.count), (eager.total, eager.count), self.rtol, self.atol,
               "the compiled loss differs from the eager one")

    def test_loss_differentiates_every_trainable_leaf(self) -> None:
        objective = self.objective()
        variables, batch, step = self._variables(objective), self.batch(), _step(0, self._key())
        trainable = self._trainable(objective, variables)
        assert trainable, f"{type(objective).__name__} has no trainable parameter (all frozen?)."

        def total(p: Variables) -> jax.Array:
            return objective.loss(overlay(variables, p), batch, step)[0].total

        grads = jax.grad(total)(trainable)
        norms = {p: float(jnp.linalg.norm(jnp.ravel(g))) for p, g in zip(paths(grads), jax.tree.leaves(grads), strict=True)}
        bad = [p for p, n in norms.items() if not np.isfinite(n)]
        assert not bad, f"Non-finite gradients at {bad[:5]}."
        assert any(n > 0 for n in norms.values()), "Every gradient is zero: the loss ignores the parameters."

    # -- microbatching -------------------------------------------------------------------------
    def test_mean_totals_add_up_over_microbatches(self) -> None:
        objective = self.objective()
        variables, batch = self._variables(objective), self.batch()
        parts = self.split(batch, self.microbatches)
        step = _step(0, self._key())
        trainable = self._trainable(objective, variables)

        def total(p: Variables, b: Any) -> tuple[jax.Array, Mean]:
            loss = objective.loss(overlay(variables, p), b, step)[0]
            return loss.total, loss

        def value(p: Variables, b: Any) -> tuple[jax.Array, Mean]:
            loss = objective.loss(overlay(variables, p), b, step)[0]
            return loss.value, loss

        expected, whole = jax.grad(value, has_aux=True)(trainable, batch)
        each = jax.grad(total, has_aux=True)
        pieces = [each(trainable, part) for part in parts]
        counts = sum(float(m.count) for _, m in pieces)
        assert np.isclose(float(whole.count), counts, rtol=1e-6), (
            f"The Mean's count is {float(whole.count)} on the whole batch but sums to {counts} over "
            f"{self.microbatches} microbatches: return the number of things averaged (Mean.of), not 1 "
            "or a mean, or accumulation weights microbatches wrongly.")
        if self.stochastic:
            return
        totals = sum(float(m.total) for _, m in pieces)
        np.testing.assert_allclose(totals, float(whole.total), rtol=self.rtol, atol=self.atol, err_msg=(
            "The Mean's totals over the microbatches do not add up to the whole batch's total."))
        # Accumulation differentiates each total and divides once by the summed counts:
        # that must be plain jax.grad of the whole batch's mean.
        accumulated = jax.tree.map(lambda *g: sum(g) / counts, *[g for g, _ in pieces])
        _close(accumulated, expected, self.rtol, self.atol,
               "the accumulated gradient differs from the whole batch's")

    def test_accumulated_step_equals_one_large_step(self) -> None:
        objective = self.objective()
        batch = self.batch()
        parts = self.split(batch, self.microbatches)
        optimizer = gradient_recorder(self.learning_rate)
        start = self._start(objective, optimizer, self.microbatches)
        step = jax.jit(build_train_step(objective, optimizer, accumulation=self.microbatches,
                                        ema=objective.ema))
        state = start
        for part in parts:
            state, metrics = step(state, part)
            assert bool(metrics["finite"]), "A microbatch's loss or gradient is not finite."
        assert int(state.updates) == 1, f"{self.microbatches} microbatches made {int(state.updates)} updates."
        applied = state.opt_state  # the mean gradient the optimizer received

        # By hand: each microbatch's total differentiated with the key the trainer gives its
        # step, summed, divided once by the summed counts.
        variables = start.params

        def total(p: Variables, part: Any, info: Step) -> tuple[jax.Array, Mean]:
            loss = objective.loss(overlay(variables, p), part, info)[0]
            return loss.total, loss

        each = jax.grad(total, has_aux=True)
        grads, counts = [], 0.0
        for index, part in enumerate(parts):
            info = _step(index, start.key_for(index)).replace(ema=start.averaged)
            g, loss = each(self._trainable(objective, variables), part, info)
            grads.append(g)
            counts += float(loss.count)
        by_hand = jax.tree.map(lambda *g: sum(g) / counts, *grads)
        _close(applied, by_hand, self.rtol, self.atol,
               "the accumulated gradient differs from the microbatches' gradients summed by hand")
        if self.stochastic:
            return
        whole = self._start(objective, optimizer, 1)
        one = jax.jit(build_train_step(objective, optimizer, accumulation=1, ema=objective.ema))
        after, _ = one(whole, batch)
        _close(applied, after.opt_state, self.rtol, self.atol,
               f"accumulation={self.microbatches} trains differently from one batch of the same rows")

    # -- EMA and frozen leaves -------------------------------------------------------------------
    def test_ema_selects_leaves_that_exist(self) -> None:
        objective = self.objective()
        if objective.ema is None:
            raise unittest.SkipTest(f"{type(objective).__name__} declares no EMA.")
        variables = self._variables(objective)
        chosen = paths(ema_leaves(objective.ema, objective.frozen, variables))
        assert chosen, (
            f"{type(objective).__name__}.ema selects no leaf of the variables (their paths begin "
            f"{sorted({'/'.join(p.split('/')[:2]) for p in paths(variables)})[:6]}); fix its select filter.")
        for updates in (0, 1000):
            rate = float(objective.ema.rate(jnp.asarray(updates)))
            assert 0.0 <= rate <= 1.0, f"The EMA's decay at update {updates} is {rate}, outside [0, 1]."
        state = self._start(objective, optax.sgd(self.learning_rate))
        assert state.ema is not None and paths(state.ema) == chosen, (
            "The trainer's EMA copy does not hold the leaves the EMASpec selects.")

    def test_frozen_leaves_get_no_optimizer_state_and_do_not_move(self) -> None:
        objective = self.objective()
        if objective.frozen is None:
            raise unittest.SkipTest(f"{type(objective).__name__} declares no frozen leaves.")
        variables = self._variables(objective)
        frozen = paths(select(variables, objective.frozen))
        assert frozen, (
            f"{type(objective).__name__}.frozen selects no leaf of the variables (their paths begin "
            f"{sorted({'/'.join(p.split('/')[:2]) for p in paths(variables)})[:6]}); fix the filter.")
        optimizer = optax.adam(self.learning_rate)
        start = self._start(objective, optimizer)
        held = _opt_state_paths(start)
        kept = [p for p in frozen if any(h.endswith(p) for h in held)]
        assert not kept, f"The optimizer keeps state for frozen leaves {kept[:5]}."
        step = jax.jit(build_train_step(objective, optimizer, accumulation=1, ema=objective.ema))
        after, metrics = step(start, self.batch())
        assert bool(metrics["finite"]), "The step's loss or gradient is not finite."
        before = select(start.params, objective.frozen)
        now = select(after.params, objective.frozen)
        assert paths(now) == paths(before), "A step dropped or added frozen leaves."
        for path, a, b in zip(paths(now), jax.tree.leaves(now), jax.tree.leaves(before), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"The frozen leaf {path} moved in a step."
        trained = [p for p, a, b in zip(paths(self._trainable(objective, after.params)),
                                        jax.tree.leaves(self._trainable(objective, after.params)),
                                        jax.tree.leaves(self._trainable(objective, start.params)),
                                        strict=True) if not np.array_equal(np.asarray(a), np.asarray(b))]
        assert trained, "No trainable leaf moved in a step."


    # -- many devices and resuming ------------------------------------------------------------
    def _tiled(self, rows: int) -> dict[str, Any]:
        """The kit's batch repeated whole until its rows are a multiple of rows."""
        batch = {k: np.asarray(v) for k, v in self.batch().items()}
        count = {np.shape(v)[0] for v in batch.values() if np.ndim(v)}.pop()
        times = math.lcm(count, rows) // count
        return {k: np.concatenate([v] * times) if np.ndim(v) else v for k, v in batch.items()}

    def test_gradients_on_many_devices_equal_one_device(self) -> None:
        from dew.testing.devices import call_on_fake_devices

        objective = self.objective()
        batch = self._tiled(self.devices)
        optimizer = gradient_recorder(self.learning_rate)
        step = jax.jit(build_train_step(objective, optimizer, accumulation=1, ema=objective.ema))
        one, _ = step(self._start(objective, optimizer), batch)
        with tempfile.TemporaryDirectory(prefix="dew-kit-") as exchange:
            np.savez(Path(exchange) / "batch.npz", **batch)
            call_on_fake_devices(type(self), "gradients_here", devices=self.devices, args=(exchange,))
            many = dict(np.load(Path(exchange) / "gradients.npz"))
        expected = {p: np.asarray(g) for p, g in zip(paths(one.opt_state), jax.tree.leaves(one.opt_state),
                                                       strict=True)}
        assert sorted(many) == sorted(expected), "The trainer on many devices trains other leaves than on one."
        for path, value in expected.items():
            np.testing.assert_allclose(
                many[path], value, rtol=self.rtol, atol=self.atol,
                err_msg=f"The gradient on {self.devices} devices differs from one device's at {path}: the loss "
                        "depends on how the batch is split over devices (does it read a device count, or a "
                        "batch size other than the batch's own?)")

    def gradients_here(self, exchange: str) -> None:
        """The trainer's step on this process's devices (data parallel) over the exchanged batch; its
        gradient is written back beside it (the child process of the test above)."""
        from dew.training.placement.mesh import data_partition, shard_batch

        assert len(jax.devices()) == self.devices, f"Expected {self.devices} devices, found {len(jax.devices())}."
        batch = dict(np.load(Path(exchange) / "batch.npz"))
        trainer = Trainer(self.objective(), gradient_recorder(self.learning_rate), key=self._key())
        state, _, _ = trainer.place()
        assert isinstance(state, TrainState)  # place() outside fit builds a fresh state here and now
        mesh = trainer.device_mesh
        sharded = shard_batch(batch, mesh, data_partition(mesh))
        after, metrics = trainer.compile(state, sharded)(state, sharded)
        assert bool(metrics["finite"]), "The step's loss or gradient is not finite on many devices."
        # Any values: numpy's savez stub reads **arrays as its allow_pickle flag
        gradients: dict[str, Any] = {p: np.asarray(g) for p, g in zip(
            paths(after.opt_state), jax.tree.leaves(after.opt_state), strict=True)}
        np.savez(Path(exchange) / "gradients.npz", **gradients)

    def _dataset(self) -> Dataset:
        batch = self.batch()
        rows = {np.shape(v)[0] for v in batch.values() if np.ndim(v)}.pop()
        return Dataset(train=lambda partition: _Repeated(batch), batch=rows)

    def test_resumes_bitwise(self) -> None:
        import shutil

        from dew.checkpoints.manager import Checkpoints

        stop, end = self.resume_steps
        optimizer = optax.adam(self.learning_rate)
        with tempfile.TemporaryDirectory(prefix="dew-kit-") as directory:
            whole_run, resumed_run = Path(directory) / "whole", Path(directory) / "resumed"
            checkpoints = Checkpoints(whole_run, keep=None)
            whole = Trainer(self.objective(), optimizer, key=self._key(), checkpoints=checkpoints).fit(
                self._dataset(), steps=end, checkpoint_every=stop, log_every=end)
            checkpoints.close()
            # The run as a preemption at step `stop` left it: that step's checkpoint alone.
            shutil.copytree(whole_run / str(stop), resumed_run / str(stop))
            checkpoints = Checkpoints(resumed_run)
            resumed = Trainer(self.objective(), optimizer, key=self._key(), checkpoints=checkpoints).fit(
                self._dataset(), steps=end, log_every=end)
            checkpoints.close()
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(resumed)[0], jax.tree.leaves(whole),
                                strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True), (
                f"Stopped at step {stop} and resumed, the run ends at step {end} with another "
                f"{jax.tree_util.keystr(path)} than an uninterrupted run: the objective keeps state outside "
                "its variables, or draws randomness other than from step.key.")


class _Repeated(Iterator[dict[str, Any]]):
    """The same batch every step, with a position a checkpoint saves (a resumable iterator)."""

    def __init__(self, batch: Mapping[str, Any]) -> None:
        self.batch, self.index = dict(batch), 0

    def __next__(self) -> dict[str, Any]:
        self.index += 1
        return self.batch

    def get_state(self) -> bytes:
        return str(self.index).encode()

    def set_state(self, state: bytes) -> None:
        self.index = int(state.decode())


def _opt_state_paths(state: TrainState) -> list[str]:
    """Every optimizer-state leaf's dictionary path, joined with '/'."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        out.append("/".join(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey)))
    return out

