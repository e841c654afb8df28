"""FlowGRPO: the SDE sampler's per-step log-densities, the loss and gradient against the written
formula, and a run that raises a brightness reward (a tiny velocity model; dew.diffusion had not
landed, so no pretrained digit model is used)."""

from __future__ import annotations

import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import registry
from dew.data import Dataset
from dew.errors import BatchKeyError
from dew.objectives.base import Step
from dew.objectives.flow_grpo import FlowGRPOObjective
from dew.testing.doubles import RecordingTracker
from dew.training import Trainer

SHAPE, STEPS, G = (2, 2, 1), 4, 4


class Velocity(nn.Module):
    @nn.compact
    def __call__(self, x, t):
        flat = x.reshape(x.shape[0], -1)
        h = jnp.tanh(nn.Dense(32)(jnp.concatenate([flat, t[:, None]], axis=-1)))
        return nn.Dense(flat.shape[1])(h).reshape(x.shape)


def _step():
    zero = jnp.asarray(0)
    return Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0))


class _State:
    def __init__(self, params):
        self.params = params


def _by_hand_step(model, params, x, t, noise=0.7):
    """The SDE step's mean and std, written out for one time t (a float)."""
    dt = 1.0 / STEPS
    v = model.apply({"params": params}, x, jnp.full((x.shape[0],), t))
    sigma = noise * math.sqrt(t / max(1 - t, dt))
    mean = x - dt * (v + sigma**2 / (2 * t) * (x + (1 - t) * v))
    return mean, sigma * math.sqrt(dt)


def _density(x, mean, std):
    d = np.asarray(x).reshape(x.shape[0], -1)
    m = np.asarray(mean).reshape(x.shape[0], -1)
    return np.sum(-0.5 * ((d - m) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi), axis=1)


def test_the_sampler_records_each_steps_gaussian_log_density():
    model = Velocity()
    objective = FlowGRPOObjective(model, image_shape=SHAPE, steps=STEPS, group_size=G)
    variables = objective.init(jax.random.key(0))
    out = objective.rollout()(_State(variables), {"x": np.zeros((2, 1))}, jax.random.key(1))
    trajectory, old_logp = np.asarray(out["trajectory"]), np.asarray(out["old_logp"])
    assert trajectory.shape == (2 * G, STEPS + 1, *SHAPE) and old_logp.shape == (2 * G, STEPS)
    for k in range(STEPS):
        t = 1.0 - k / STEPS
        mean, std = _by_hand_step(model, variables["params"], jnp.asarray(trajectory[:, k]), t)
        np.testing.assert_allclose(old_logp[:, k], _density(trajectory[:, k + 1], mean, std), rtol=1e-4, atol=1e-4)
    # The reward (brightness, found by name) scores the last state of each trajectory.
    np.testing.assert_allclose(out["reward"], trajectory[:, -1].reshape(2 * G, -1).mean(1), rtol=1e-5)



class _LabelledVelocity(nn.Module):
    @nn.compact
    def __call__(self, x, t, label):
        return Velocity()(x, t + label.astype(t.dtype))


def test_data_without_the_condition_key_is_refused_naming_it():
    # Text where labelled images belong (a recipe's data under flow_grpo): a bare KeyError's traceback before.
    objective = FlowGRPOObjective(_LabelledVelocity(), image_shape=SHAPE, steps=STEPS, group_size=G,
                                  condition_key="label")
    variables = objective.init(jax.random.key(0))
    with pytest.raises(BatchKeyError, match=r"reads conditions under 'label'.*holds \['text'\]"):
        objective.rollout()(_State(variables), {"text": np.zeros((2, 4))}, jax.random.key(1))

def test_loss_and_gradient_equal_the_clipped_objective_with_the_gaussian_kl():
    model = Velocity()
    objective = FlowGRPOObjective(model, image_shape=SHAPE, steps=STEPS, group_size=G, beta=0.1, clip=0.2)
    variables = objective.init(jax.random.key(0))
    variables["reference"] = Velocity().init(jax.random.key(9), jnp.zeros((1, *SHAPE)), jnp.zeros((1,)))["params"]
    out = objective.rollout()(_State(variables), {"x": np.zeros((2, 1))}, jax.random.key(1))
    rng = np.random.default_rng(0)
    batch = {**out, "old_logp": out["old_logp"] + rng.normal(scale=0.2, size=out["old_logp"].shape),
             "reward": np.asarray([1, 0, 0, 2, 1, 1, 3, 0], np.float32)}
    r = batch["reward"].reshape(-1, G)
    advantage = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).reshape(-1)
    trajectory = jnp.asarray(batch["trajectory"])

    def by_hand(params):
        total = 0.0
        for k in range(STEPS):
            t = 1.0 - k / STEPS
            mean, std = _by_hand_step(model, params, trajectory[:, k], t)
            ref, _ = _by_hand_step(model, variables["reference"], trajectory[:, k], t)
            d = (trajectory[:, k + 1] - mean).reshape(8, -1)
            logp = jnp.sum(-0.5 * (d / std) ** 2 - jnp.log(std) - 0.5 * jnp.log(2 * jnp.pi), axis=1)
            ratio = jnp.exp(logp - batch["old_logp"][:, k])
            surrogate = jnp.minimum(ratio * advantage, jnp.clip(ratio, 0.8, 1.2) * advantage)
            kl = jnp.sum(((mean - ref) ** 2).reshape(8, -1), axis=1) / (2 * std**2)
            total = total + jnp.sum(-(surrogate - 0.1 * kl))
        return total / (8 * STEPS)

    def through_objective(params):
        return objective.loss({**variables, "params": params}, batch, _step())[0].value

    expected, expected_grad = jax.jit(jax.value_and_grad(by_hand))(variables["params"])
    got, got_grad = jax.jit(jax.value_and_grad(through_objective))(variables["params"])
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(expected_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * float(np.abs(b).max()) + 1e-7)


def test_a_run_raises_the_brightness_of_the_samples():
    objective = registry.objectives.build("flow_grpo", model=Velocity(), image_shape=SHAPE, steps=STEPS,
                                          group_size=8, beta=0.0)
    data = Dataset(train=lambda partition: itertools.repeat({"x": np.zeros((4, 1), np.float32)}), batch=4)
    recorder = RecordingTracker()
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), rollout=objective.rollout(),
                      tracker=recorder)
    trainer.fit(data, steps=40, log_every=1)
    seen = recorder.values("train/reward")
    start, end = np.mean(seen[:5]), np.mean(seen[-5:])
    assert end > start + 0.5, (start, end)
