"""Preference losses: DPO's hinge, robust, bco_pair (and cDPO's label smoothing), ORPO, CPO and KTO each
equal their paper's formula written by hand on fixed logits and padded masks, and so do their gradients;
KTO data without labels is refused before the first step, naming the field."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import registry
from dew.data import Dataset
from dew.objectives.dpo import DPOObjective
from dew.objectives.kto import (
    KTOObjective,
    LabelError,
    LoneRowError,
    mismatched,
    mismatched_in_graph,
)
from dew.objectives.reference_free import CPOObjective, ORPOObjective
from dew.training import Trainer

from .fixed_logits import FixedLogits, assert_tree_close, logits, logp_by_hand, step

VOCAB, LENGTH = 6, 9


def _pairs(pairs: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, VOCAB, size=(pairs, 3))
    chosen = np.concatenate([prompt, rng.integers(1, VOCAB, size=(pairs, LENGTH - 3))], axis=1)
    rejected = np.concatenate([prompt, rng.integers(1, VOCAB, size=(pairs, LENGTH - 3))], axis=1)
    chosen_mask = np.zeros((pairs, LENGTH), np.int32)
    rejected_mask = np.zeros((pairs, LENGTH), np.int32)
    for i in range(pairs):
        chosen_mask[i, 3:LENGTH - (i % 3)] = 1  # completions of different lengths, padded
        rejected_mask[i, 3:LENGTH - ((i + 1) % 4)] = 1
    return {"chosen": chosen.astype(np.int32), "rejected": rejected.astype(np.int32), "chosen_mask": chosen_mask,
            "rejected_mask": rejected_mask, "prompt_length": np.full((pairs,), 3, np.int32)}


def _summed(table, tokens, mask, offset=0):
    """Per row: the summed log-probability of its masked tokens and how many there are (table rows from offset)."""
    logp = logp_by_hand(table[offset:offset + tokens.shape[0]], jnp.asarray(tokens))
    m = jnp.asarray(mask, jnp.float32)[:, 1:]
    return jnp.sum(logp * m, -1), jnp.sum(m, -1)


def _log_sigmoid(x):
    return -jnp.log1p(jnp.exp(-x))


def _check(objective, variables, batch, by_hand):
    table = variables["params"]["logits"]
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}

    def through(t):
        return objective.loss({**variables, "params": {"logits": t}}, jbatch, step())[0].value

    got, got_grad = jax.value_and_grad(through)(table)
    expected, expected_grad = jax.value_and_grad(by_hand)(table)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert_tree_close(got_grad, expected_grad)
    assert float(jnp.abs(got_grad).max()) > 0


@pytest.mark.parametrize("pairs", [3, 5])
def test_dpo_loss_types_equal_their_formulas(pairs):
    model = FixedLogits(2 * pairs, LENGTH, VOCAB)
    batch = _pairs(pairs, seed=pairs)
    table, ref = logits(1, 2 * pairs, LENGTH, VOCAB), logits(2, 2 * pairs, LENGTH, VOCAB)
    beta, eps = 0.7, 0.2

    def parts(t):
        pc, _ = _summed(t, batch["chosen"], batch["chosen_mask"])
        pr, _ = _summed(t, batch["rejected"], batch["rejected_mask"], offset=pairs)
        rc, _ = _summed(ref, batch["chosen"], batch["chosen_mask"])
        rr, _ = _summed(ref, batch["rejected"], batch["rejected_mask"], offset=pairs)
        return pc - rc, pr - rr

    def hinge(t):  # SLiC: max(0, 1 - beta h)
        c, r = parts(t)
        return jnp.mean(jnp.maximum(0.0, 1.0 - beta * (c - r)))

    def robust(t):  # rDPO, Chowdhury et al. 2024, eq. (8)
        c, r = parts(t)
        h = beta * (c - r)
        return jnp.mean(((1 - eps) * -_log_sigmoid(h) - eps * -_log_sigmoid(-h)) / (1 - 2 * eps))

    def cdpo(t):  # conservative DPO: labels smoothed by eps
        c, r = parts(t)
        h = beta * (c - r)
        return jnp.mean(-(1 - eps) * _log_sigmoid(h) - eps * _log_sigmoid(-h))

    def bco(t):  # BCO: delta is the mean reward seen so far (here: this batch, from a fresh start)
        c, r = parts(t)
        delta = jax.lax.stop_gradient(jnp.mean(jnp.concatenate([beta * c, beta * r])))
        return jnp.mean(-_log_sigmoid(beta * c - delta) - _log_sigmoid(-(beta * r - delta)))

    for loss_type, smoothing, by_hand in (("hinge", 0.0, hinge), ("robust", eps, robust), ("sigmoid", eps, cdpo),
                                          ("bco_pair", 0.0, bco)):
        objective = DPOObjective(model, LENGTH, beta=beta, loss_type=loss_type, label_smoothing=smoothing)
        variables = objective.init(jax.random.key(0))
        variables = {**variables, "params": {"logits": table}, "reference": {"logits": ref}}
        _check(objective, variables, batch, by_hand)


def test_bco_pair_keeps_a_running_mean_of_the_rewards():
    pairs = 3
    model = FixedLogits(2 * pairs, LENGTH, VOCAB)
    objective = DPOObjective(model, LENGTH, beta=0.5, loss_type="bco_pair")
    variables = objective.init(jax.random.key(0))
    assert {"mean", "count"} == set(variables["bco"])
    variables = {**variables, "params": {"logits": logits(1, 2 * pairs, LENGTH, VOCAB)},
                 "reference": {"logits": logits(2, 2 * pairs, LENGTH, VOCAB)}}
    rewards = []
    for seed in (0, 1):
        batch = {k: jnp.asarray(v) for k, v in _pairs(pairs, seed).items()}
        _, aux = objective.loss(variables, batch, step())
        pc, _ = _summed(variables["params"]["logits"], batch["chosen"], batch["chosen_mask"])
        pr, _ = _summed(variables["params"]["logits"], batch["rejected"], batch["rejected_mask"], offset=pairs)
        rc, _ = _summed(variables["reference"]["logits"], batch["chosen"], batch["chosen_mask"])
        rr, _ = _summed(variables["reference"]["logits"], batch["rejected"], batch["rejected_mask"], offset=pairs)
        rewards.extend(np.asarray(jnp.concatenate([0.5 * (pc - rc), 0.5 * (pr - rr)])).tolist())
        np.testing.assert_allclose(aux.updates["bco"]["mean"], np.mean(rewards), rtol=1e-5)
        assert float(aux.updates["bco"]["count"]) == len(rewards)
        variables = {**variables, **aux.updates}


@pytest.mark.parametrize("pairs", [3, 5])
def test_orpo_and_cpo_equal_their_formulas(pairs):
    model = FixedLogits(2 * pairs, LENGTH, VOCAB)
    batch = _pairs(pairs, seed=10 + pairs)
    table = logits(4, 2 * pairs, LENGTH, VOCAB)

    def means(t):
        pc, nc = _summed(t, batch["chosen"], batch["chosen_mask"])
        pr, nr = _summed(t, batch["rejected"], batch["rejected_mask"], offset=pairs)
        return pc, pr, pc / nc, pr / nr

    def orpo(t):  # Hong et al. 2024: L_SFT + lambda * L_OR, odds = P / (1 - P), P = exp(mean log p)
        _, _, mc, mr = means(t)
        p_c, p_r = jnp.exp(mc), jnp.exp(mr)
        log_odds_ratio = jnp.log((p_c / (1 - p_c)) / (p_r / (1 - p_r)))
        return jnp.mean(-mc - 0.3 * _log_sigmoid(log_odds_ratio))

    def cpo(t):  # Xu et al. 2024: -log s(beta (log pi(y_w) - log pi(y_l))) + alpha NLL(y_w)
        pc, pr, mc, _ = means(t)
        return jnp.mean(-_log_sigmoid(0.2 * (pc - pr)) - 0.8 * mc)

    for objective, by_hand in ((ORPOObjective(model, LENGTH, beta=0.3), orpo),
                               (CPOObjective(model, LENGTH, beta=0.2, alpha=0.8), cpo)):
        variables = objective.init(jax.random.key(0))
        assert set(variables) == {"params"}  # no reference
        _check(objective, {"params": {"logits": table}}, batch, by_hand)
    metrics = ORPOObjective(model, LENGTH, beta=0.3).loss({"params": {"logits": table}},
                                                         {k: jnp.asarray(v) for k, v in batch.items()}, step())[1]
    _, _, mc, mr = means(table)
    expected = np.log(np.exp(mc) / (1 - np.exp(mc))) - np.log(np.exp(mr) / (1 - np.exp(mr)))
    np.testing.assert_allclose(metrics.metrics["log_odds_ratio"].value, expected.mean(), rtol=1e-4)


def _labelled(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(rows, LENGTH)).astype(np.int32)
    mask = np.zeros((rows, LENGTH), np.int32)
    lengths = np.asarray([2 + (i % 2) for i in range(rows)], np.int32)
    for i in range(rows):
        mask[i, lengths[i]:LENGTH - (i % 3)] = 1
        tokens[i, LENGTH - (i % 3):] = 0
    labels = np.asarray([1, 0, 1, 1, 0, 0, 1][:rows], np.int32)
    return {"completion": tokens, "completion_mask": mask, "prompt_length": lengths, "label": labels}


@pytest.mark.parametrize("rows", [4, 7])
def test_kto_equals_its_formula_with_the_mismatched_reference_point(rows):
    model = FixedLogits(2 * rows, LENGTH, VOCAB)
    objective = KTOObjective(model, LENGTH, beta=0.4, desirable_weight=1.0, undesirable_weight=1.5)
    batch = objective.rollout()(None, _labelled(rows, rows), jax.random.key(0))
    table, ref = logits(5, 2 * rows, LENGTH, VOCAB), logits(6, 2 * rows, LENGTH, VOCAB)
    # The mismatched pairs: each prompt followed by the previous row's completion.
    for i in range(rows):
        n, j = int(batch["prompt_length"][i]), (i - 1) % rows
        want = batch["completion"][j][batch["completion_mask"][j] > 0][:LENGTH - n]
        np.testing.assert_array_equal(batch["kl_completion"][i, :n], batch["completion"][i, :n])
        np.testing.assert_array_equal(batch["kl_completion"][i, n:n + want.size], want)
        assert batch["kl_completion_mask"][i].sum() == want.size

    def by_hand(t):  # Ethayarajh et al. 2024, eq. (8), z0 from mismatched pairs, clamped at 0
        r = _summed(t, batch["completion"], batch["completion_mask"])[0] - \
            _summed(ref, batch["completion"], batch["completion_mask"])[0]
        kl = _summed(t, batch["kl_completion"], batch["kl_completion_mask"], offset=rows)[0] - \
            _summed(ref, batch["kl_completion"], batch["kl_completion_mask"], offset=rows)[0]
        z0 = jax.lax.stop_gradient(jnp.maximum(jnp.mean(kl), 0.0))
        losses = []
        for i in range(rows):
            if batch["label"][i]:
                losses.append(1.0 - 1.0 * jax.nn.sigmoid(0.4 * (r[i] - z0)))
            else:
                losses.append(1.5 - 1.5 * jax.nn.sigmoid(0.4 * (z0 - r[i])))
        return sum(losses) / rows

    variables = {**objective.init(jax.random.key(0)), "params": {"logits": table}, "reference": {"logits": ref}}
    _check(objective, variables, batch, by_hand)


def test_kto_data_without_labels_is_refused_before_the_first_step_naming_the_field():
    rows = 4
    model = FixedLogits(2 * rows, LENGTH, VOCAB)
    objective = registry.objectives.build("kto", model=model, seq_len=LENGTH)
    unlabelled = {k: v for k, v in _labelled(rows, 0).items() if k != "label"}
    with pytest.raises(LabelError, match=r"KTOObjective\.label_key='label'.*holds \['completion'"):
        objective.rollout()(None, unlabelled, jax.random.key(0))
    wrong = {**_labelled(rows, 0), "label": np.asarray([1, 0, 2, 1])}
    with pytest.raises(LabelError, match="holds 2 at row 2"):
        objective.rollout()(None, wrong, jax.random.key(0))
    data = Dataset(train=lambda partition: itertools.repeat(unlabelled), batch=rows)
    trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0), rollout=objective.rollout())
    with pytest.raises(LabelError, match="label_key"):
        trainer.fit(data, steps=1, log_every=1)


def test_mismatched_pairs_are_cut_at_the_row_width():
    tokens = np.array([[1, 2, 3, 4, 0], [5, 6, 7, 8, 9]])
    mask = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    out, out_mask = mismatched(tokens, mask, np.array([1, 2]))
    assert out.tolist() == [[1, 7, 8, 9, 0], [5, 6, 2, 3, 4]]
    assert out_mask.tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    cut, cut_mask = mismatched(tokens, mask, np.array([4, 2]))
    assert cut[0].tolist() == [1, 2, 3, 4, 7] and cut_mask[0].tolist() == [0, 0, 0, 0, 1]


@pytest.mark.parametrize("rows", [4, 7])
def test_kto_validation_builds_the_mismatched_pairs_the_rollout_builds(rows):
    """Held-out batches skip the host-side rollout: evaluate builds the same pairs in the program."""
    labelled = _labelled(rows, rows)
    model = FixedLogits(2 * rows, LENGTH, VOCAB)
    objective = KTOObjective(model, LENGTH, beta=0.4, desirable_weight=1.0, undesirable_weight=1.5)
    rolled = objective.rollout()(None, labelled, jax.random.key(0))
    kl, kl_mask = jax.jit(mismatched_in_graph)(*(jnp.asarray(labelled[k]) for k in
                                                ("completion", "completion_mask", "prompt_length")))
    np.testing.assert_array_equal(kl, rolled["kl_completion"])
    np.testing.assert_array_equal(kl_mask, rolled["kl_completion_mask"])
    tokens = np.array([[1, 2, 3, 4, 0], [5, 6, 7, 8, 9]])  # a completion cut at the row's width
    mask = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    for lengths in ([1, 2], [4, 2]):
        cut, cut_mask = mismatched_in_graph(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(lengths))
        want, want_mask = mismatched(tokens, mask, np.asarray(lengths))
        assert cut.tolist() == want.tolist() and cut_mask.tolist() == want_mask.tolist()
    variables = {**objective.init(jax.random.key(0)), "params": {"logits": logits(5, 2 * rows, LENGTH, VOCAB)},
                 "reference": {"logits": logits(6, 2 * rows, LENGTH, VOCAB)}}
    held_out = objective.evaluate(variables, {k: jnp.asarray(v) for k, v in labelled.items()}, step())
    trained, aux = objective.loss(variables, {k: jnp.asarray(v) for k, v in rolled.items()}, step())
    np.testing.assert_allclose(held_out["loss"].value, trained.value, rtol=1e-6)
    np.testing.assert_allclose(held_out["kl"].value, aux.metrics["kl"].value, rtol=1e-6)


def test_a_kto_batch_of_one_row_is_refused_on_the_host_and_in_the_step():
    """Paired with itself, a lone row's KL estimate is its own log-ratio: the loss was 0.5 whatever
    a positive log-ratio was (TRL refuses such a batch too)."""
    tokens, mask = np.array([[1, 2, 7, 0]]), np.array([[0, 0, 1, 0]])
    for build in (mismatched, jax.jit(mismatched_in_graph)):
        with pytest.raises(LoneRowError, match="a batch of 1 row has no other") as refused:
            build(tokens, mask, np.array([2]))
        assert "\n" not in str(refused.value)


def test_preference_objectives_are_registered():
    names = registry.objectives.names()
    for name, cls in (("orpo", ORPOObjective), ("cpo", CPOObjective), ("kto", KTOObjective)):
        assert names[name] == "dew-objectives" and registry.objectives.load(name) is cls
    with pytest.raises(ValueError, match="label_smoothing applies to loss_type 'sigmoid' or 'robust'"):
        DPOObjective(FixedLogits(2, 4, VOCAB), 4, loss_type="hinge", label_smoothing=0.1)
