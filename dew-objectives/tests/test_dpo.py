"""DPO: the loss and gradient equal hand-written formulas; a run raises the preferred completion's margin."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import registry
from dew.data import Dataset
from dew.errors import BatchKeyError
from dew.models import build
from dew.objectives.base import Step
from dew.objectives.dpo import DPOObjective, MismatchedPairError, check_pairs
from dew.training import Trainer

VOCAB, LENGTH = 11, 8


def _model():
    return build("causal_transformer", vocab_size=VOCAB, emb_features=16, num_layers=1, num_heads=2,
                 mlp_features=32, max_seq_len=16)


def _pairs(rows: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, VOCAB, size=(rows, 3))
    chosen = np.concatenate([prompt, rng.integers(1, VOCAB, size=(rows, LENGTH - 3))], axis=1)
    rejected = np.concatenate([prompt, rng.integers(1, VOCAB, size=(rows, LENGTH - 3))], axis=1)
    mask = np.zeros((rows, LENGTH), np.int32)
    mask[:, 3:] = 1
    rejected_mask = mask.copy()
    rejected_mask[0, -2:] = 0  # a shorter rejected completion, padded
    return {"chosen": chosen.astype(np.int32), "rejected": rejected.astype(np.int32),
            "chosen_mask": mask, "rejected_mask": rejected_mask,
            "prompt_length": np.full((rows,), 3, np.int32)}


def _step():
    zero = jnp.asarray(0)
    return Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0))


def _by_hand_logp(model, params, tokens, mask):
    """Sum over completion tokens of log softmax(logits)[next token], written out with one-hots."""
    logits = model.apply({"params": params}, tokens[:, :-1])
    log_z = jnp.log(jnp.sum(jnp.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    picked = jnp.sum(logits * jax.nn.one_hot(tokens[:, 1:], VOCAB), -1)
    return jnp.sum((picked - log_z) * mask[:, 1:], -1), jnp.sum(mask[:, 1:], -1)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_loss_and_gradient_equal_the_formula(loss_type):
    model = _model()
    objective = DPOObjective(model, LENGTH, beta=0.5, loss_type=loss_type,
                             **({"gamma": 0.3} if loss_type == "simpo" else {}))
    variables = objective.init(jax.random.key(0))
    # The reference is a different model than the policy, as after some training.
    if objective.holds_reference:
        variables["reference"] = model.init(jax.random.key(7), jnp.zeros((1, LENGTH), jnp.int32))["params"]
    batch = {k: jnp.asarray(v) for k, v in _pairs().items()}

    def by_hand(params):
        pc, nc = _by_hand_logp(model, params, batch["chosen"], batch["chosen_mask"])
        pr, nr = _by_hand_logp(model, params, batch["rejected"], batch["rejected_mask"])
        if loss_type == "simpo":
            z = 0.5 * (pc / nc - pr / nr) - 0.3
            return jnp.mean(jnp.log1p(jnp.exp(-z)))
        rc, _ = _by_hand_logp(model, variables["reference"], batch["chosen"], batch["chosen_mask"])
        rr, _ = _by_hand_logp(model, variables["reference"], batch["rejected"], batch["rejected_mask"])
        h = (pc - rc) - (pr - rr)
        if loss_type == "ipo":
            return jnp.mean((h - 1 / (2 * 0.5)) ** 2)
        return jnp.mean(jnp.log1p(jnp.exp(-0.5 * h)))

    def through_objective(params):
        return objective.loss({**variables, "params": params}, batch, _step())[0].value

    expected, expected_grad = jax.jit(jax.value_and_grad(by_hand))(variables["params"])
    got, got_grad = jax.jit(jax.value_and_grad(through_objective))(variables["params"])
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(expected_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()) + 1e-7)
    assert ("reference" in variables) == (loss_type != "simpo")
    if loss_type == "simpo":  # its rewards' margin, without the loss's target gamma (TRL's SimPO metrics)
        pc, nc = _by_hand_logp(model, variables["params"], batch["chosen"], batch["chosen_mask"])
        pr, nr = _by_hand_logp(model, variables["params"], batch["rejected"], batch["rejected_mask"])
        margins = np.asarray(0.5 * (pc / nc - pr / nr))
        metrics = objective.loss(variables, batch, _step())[1].metrics
        np.testing.assert_allclose(metrics["reward_margin"].value, margins.mean(), rtol=1e-5)
        np.testing.assert_allclose(metrics["preference_accuracy"].value, (margins > 0).mean(), rtol=1e-6)


def test_options_the_loss_type_does_not_read_are_refused():
    """gamma trained bitwise as without it under every loss but SimPO's, and a precomputed reference
    was accepted by SimPO, which reads none."""
    model = _model()
    with pytest.raises(ValueError, match=r"gamma is SimPO's target margin, read by loss_type 'simpo' alone, not 'sigmoid'"):
        DPOObjective(model, LENGTH, gamma=3.0)
    with pytest.raises(ValueError, match=r"reference='precomputed' reads reference log-probabilities, which SimPO"):
        DPOObjective(model, LENGTH, loss_type="simpo", reference="precomputed")


def test_a_nan_or_infinite_beta_is_refused():
    """beta <= 0 let NaN through, and nothing refused infinity: either trained every step to a
    rejected NaN loss."""
    from dew.objectives.kto import KTOObjective
    from dew.objectives.reference_free import ORPOObjective

    for value in (math.nan, math.inf, 0.0):
        for objective in (DPOObjective, KTOObjective, ORPOObjective):
            with pytest.raises(ValueError, match=r"beta must be a positive finite number"):
                objective(_model(), LENGTH, beta=value)


def test_precomputed_reference_logprobs_give_the_frozen_reference_loss():
    model = _model()
    frozen = DPOObjective(model, LENGTH)
    variables = frozen.init(jax.random.key(0))
    variables["reference"] = model.init(jax.random.key(3), jnp.zeros((1, LENGTH), jnp.int32))["params"]
    batch = {k: jnp.asarray(v) for k, v in _pairs().items()}
    ref = {"params": variables["reference"]}
    batch["chosen_reference_logp"] = _by_hand_logp(model, ref["params"], batch["chosen"], batch["chosen_mask"])[0]
    batch["rejected_reference_logp"] = _by_hand_logp(model, ref["params"], batch["rejected"],
                                                     batch["rejected_mask"])[0]
    precomputed = DPOObjective(model, LENGTH, reference="precomputed")
    policy_only = precomputed.init(jax.random.key(0))
    assert "reference" not in policy_only and precomputed.frozen is None
    a = frozen.loss(variables, batch, _step())[0].value
    b = precomputed.loss(policy_only, batch, _step())[0].value
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_pairs_with_different_prompts_are_refused_naming_the_pair():
    batch = _pairs()
    batch["rejected"][2, 1] = (batch["rejected"][2, 1] % (VOCAB - 1)) + 1
    with pytest.raises(MismatchedPairError, match="Pair 2 of the batch has different prompts"):
        check_pairs(batch)
    # In a run, the objective's host-side check refuses it before the step.
    objective = DPOObjective(_model(), LENGTH)
    data = Dataset(train=lambda partition: itertools.repeat(batch), batch=4)
    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=objective.rollout())
    with pytest.raises(MismatchedPairError, match="Pair 2"):
        trainer.fit(data, steps=1, log_every=1)



def test_data_without_pairs_is_refused_naming_the_keys_it_lacks():
    # Prompts where pairs belong (a recipe's data.form=prompts under dpo): a KeyError's traceback before.
    prompts = {"prompt": np.ones((4, 3), np.int32), "prompt_length": np.full(4, 3), "answer": np.ones((4, 2))}
    with pytest.raises(BatchKeyError, match=r"without 'chosen', 'rejected'.*form 'pairs'") as refused:
        check_pairs(prompts)
    assert "['answer', 'prompt', 'prompt_length']" in str(refused.value)
    objective = DPOObjective(_model(), LENGTH)
    data = Dataset(train=lambda partition: itertools.repeat(prompts), batch=4)
    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=objective.rollout())
    with pytest.raises(BatchKeyError, match="Preference pairs are read under 'chosen'"):
        trainer.fit(data, steps=1, log_every=1)


@pytest.mark.slow
def test_a_run_raises_the_preferred_margin_and_keeps_one_frozen_reference():
    objective = registry.objectives.build("dpo", model=_model(), seq_len=LENGTH, beta=0.5)
    batch = _pairs(8, seed=1)
    data = Dataset(train=lambda partition: itertools.repeat(batch), batch=8)
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), rollout=objective.rollout())
    start, _, _ = trainer.place()
    state = trainer.fit(data, steps=30, log_every=30)
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    before = objective.loss(start.params, jbatch, _step())[1].metrics["reward_margin"].value
    after = objective.loss(state.params, jbatch, _step())[1].metrics["reward_margin"].value
    assert float(before) == pytest.approx(0.0, abs=1e-6)  # the reference starts as the policy
    assert float(after) > 1.0, float(after)
    # The reference never moved, and the optimizer holds no state for it.
    same = jax.tree.map(jnp.array_equal, state.params["reference"], start.params["params"])
    assert all(jax.tree.leaves(same))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]]
    assert not any("reference" in p for p in paths)
