"""build_optimizer against optax chains written out by hand, on a small variables tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pydantic
import pytest

from dew.training.optim import (
    OptimizerConfig,
    OptimizerConfigError,
    build_optimizer,
    build_schedule,
)


def _tree(seed: int) -> dict:
    keys = jax.random.split(jax.random.key(seed), 5)
    return {
        "params": {
            "embed": {"embedding": jax.random.normal(keys[0], (11, 4))},
            "layer_0": {
                "norm": {"scale": 1.0 + 0.1 * jax.random.normal(keys[1], (4,))},
                "dense": {
                    "kernel": jax.random.normal(keys[2], (4, 4)),
                    "bias": jax.random.normal(keys[3], (4,)),
                },
            },
            "head": {"kernel": jax.random.normal(keys[4], (4, 11))},
        }
    }


# The default decay rule by hand: only the two kernels decay.
HAND_MASK = {
    "params": {
        "embed": {"embedding": False},
        "layer_0": {"norm": {"scale": False}, "dense": {"kernel": True, "bias": False}},
        "head": {"kernel": True},
    }
}


def _run(tx: optax.GradientTransformation, steps: int = 6) -> dict:
    params = _tree(0)
    state = tx.init(params)
    for i in range(steps):
        grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)) * 3.0, params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _assert_same(ours: optax.GradientTransformation, hand: optax.GradientTransformation) -> None:
    a, b = _run(ours), _run(hand)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_adamw_cosine_masks_norms_biases_and_embeddings():
    config = OptimizerConfig(solver="adamw", learning_rate=1e-2, schedule="cosine",
                             warmup_steps=2, decay_steps=6, end_factor=0.1,
                             weight_decay=0.5, b2=0.95)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6, end_value=1e-3)
    hand = optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.5, mask=HAND_MASK)
    _assert_same(build_optimizer(config), hand)


@pytest.mark.slow
def test_mask_matters():
    """Decaying everything gives other parameters, so the masked comparison is not vacuous."""
    config = OptimizerConfig(learning_rate=1e-2, weight_decay=0.5)
    unmasked = optax.adamw(1e-2, weight_decay=0.5)
    a, b = _run(build_optimizer(config)), _run(unmasked)
    assert not np.allclose(a["params"]["layer_0"]["norm"]["scale"],
                           b["params"]["layer_0"]["norm"]["scale"])
    np.testing.assert_allclose(a["params"]["head"]["kernel"], b["params"]["head"]["kernel"],
                               rtol=1e-6)


@pytest.mark.slow
def test_lion_linear_with_clipping():
    config = OptimizerConfig(solver="lion", learning_rate=1e-3, schedule="linear",
                             warmup_steps=2, decay_steps=5, weight_decay=0.1, clip_norm=0.5)
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, 1e-3, 2), optax.linear_schedule(1e-3, 0.0, 3)], [2])
    hand = optax.chain(optax.clip_by_global_norm(0.5),
                       optax.lion(schedule, weight_decay=0.1, mask=HAND_MASK))
    _assert_same(build_optimizer(config), hand)


def test_sgd_nesterov_with_coupled_decay():
    config = OptimizerConfig(solver="sgd", learning_rate=0.05, momentum=0.9, nesterov=True,
                             weight_decay=0.01)
    hand = optax.chain(optax.add_decayed_weights(0.01, HAND_MASK),
                       optax.sgd(0.05, momentum=0.9, nesterov=True))
    _assert_same(build_optimizer(config), hand)


def test_adafactor_constant_with_warmup():
    config = OptimizerConfig(solver="adafactor", learning_rate=1e-2, warmup_steps=3,
                             weight_decay=0.1)
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, 1e-2, 3), optax.constant_schedule(1e-2)], [3])
    hand = optax.adafactor(schedule, weight_decay_rate=0.1, weight_decay_mask=HAND_MASK)
    _assert_same(build_optimizer(config), hand)


def test_group_learning_rate_multiplier_and_decay_override():
    config = OptimizerConfig(
        solver="adamw", learning_rate=1e-2, weight_decay=0.2,
        groups=[{"match": "params/head/*", "lr_scale": 0.1},
                {"match": ["*/embed/*"], "decay": True}],
    )
    mask = jax.tree.map(lambda x: x, HAND_MASK)
    mask["params"]["embed"]["embedding"] = True
    head_only = {"params": {"embed": {"embedding": 1.0},
                            "layer_0": {"norm": {"scale": 1.0},
                                        "dense": {"kernel": 1.0, "bias": 1.0}},
                            "head": {"kernel": 0.1}}}
    scale = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda x, f: x * f, u, head_only), s))
    hand = optax.chain(optax.adamw(1e-2, weight_decay=0.2, mask=mask), scale)
    _assert_same(build_optimizer(config), hand)


def test_works_on_a_bare_parameter_tree():
    """The same default patterns select the same leaves without the 'params' level."""
    config = OptimizerConfig(learning_rate=1e-2, weight_decay=0.5)
    tx = build_optimizer(config)
    params = _tree(0)["params"]
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert float(jnp.abs(updates["layer_0"]["norm"]["scale"]).max()) == 0.0
    assert float(jnp.abs(updates["head"]["kernel"]).max()) > 0.0


def test_schedule_values():
    config = OptimizerConfig(learning_rate=1.0, schedule="cosine", warmup_steps=10,
                             decay_steps=110, end_factor=0.0)
    lr = build_schedule(config)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.5, abs=1e-6)
    assert float(lr(110)) == pytest.approx(0.0, abs=1e-7)


def test_bad_configs_say_what_to_change():
    with pytest.raises(OptimizerConfigError, match="decay_steps"):
        build_optimizer(OptimizerConfig(schedule="cosine"))
    with pytest.raises(pydantic.ValidationError, match="momentum"):
        OptimizerConfig(solver="sgd", nesterov=True)
    with pytest.raises(pydantic.ValidationError, match="solver"):
        OptimizerConfig(solver="adam")
    with pytest.raises(pydantic.ValidationError, match="must exceed warmup_steps"):
        OptimizerConfig(schedule="linear", warmup_steps=10, decay_steps=5)


def test_docstring_examples_run():
    import doctest

    import dew.training.optim

    result = doctest.testmod(dew.training.optim)
    assert result.attempted and not result.failed
