"""The Bradley-Terry reward model: its loss and gradient equal the formula written by hand over the
decoder's last hidden state; its pipeline scores text as the loss does, whatever the padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import registry
from dew.models import build
from dew.objectives.reward_model import REWARD_HEAD, RewardModelObjective, SequenceTooLongError

from .fixed_logits import assert_tree_close, step

VOCAB, LENGTH = 257, 10


def _model():
    return build("causal_transformer", vocab_size=VOCAB, emb_features=16, num_layers=1, num_heads=2,
                 mlp_features=32, max_seq_len=16)


def _pairs(pairs: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(40, 60, size=(pairs, 3))
    chosen = np.concatenate([prompt, rng.integers(40, 60, size=(pairs, LENGTH - 3))], axis=1).astype(np.int32)
    rejected = np.concatenate([prompt, rng.integers(40, 60, size=(pairs, LENGTH - 3))], axis=1).astype(np.int32)
    chosen_mask, rejected_mask = np.zeros_like(chosen), np.zeros_like(rejected)
    for i in range(pairs):
        chosen_mask[i, 3:LENGTH - (i % 3)] = 1  # completions of different lengths, padded with zeros
        chosen[i, LENGTH - (i % 3):] = 0
        rejected_mask[i, 3:LENGTH - ((i + 1) % 4)] = 1
        rejected[i, LENGTH - ((i + 1) % 4):] = 0
    return {"chosen": chosen, "rejected": rejected, "chosen_mask": chosen_mask, "rejected_mask": rejected_mask,
            "prompt_length": np.full((pairs,), 3, np.int32)}


def _variables(objective):
    variables = objective.init(jax.random.key(0))
    head = variables["params"][REWARD_HEAD]["dense"]  # redrawn: the head starts at zero
    rng = np.random.default_rng(1)
    assert set(head) == {"kernel"}  # no bias: Bradley-Terry sees differences of scores only
    head = {"kernel": jnp.asarray(rng.normal(size=head["kernel"].shape), jnp.float32)}
    return {"params": {**variables["params"], REWARD_HEAD: {"dense": head}}}


def _score_by_hand(model, params, tokens, mask):
    """head(final_norm's output at the last masked token), the hidden state read with every intermediate kept."""
    body = {k: v for k, v in params.items() if k != REWARD_HEAD}
    _, state = model.apply({"params": body}, jnp.asarray(tokens), capture_intermediates=True)
    hidden = state["intermediates"]["final_norm"]["__call__"][0]
    head = params[REWARD_HEAD]["dense"]
    scores = []
    for i in range(tokens.shape[0]):
        last = int(np.flatnonzero(np.asarray(mask[i]))[-1])
        scores.append(jnp.dot(hidden[i, last], head["kernel"][:, 0]))
    return jnp.stack(scores)


def test_loss_and_gradient_equal_bradley_terry():
    center = 0.05  # with the centring term; at 0 the loss is Bradley-Terry's alone
    model = _model()
    objective = RewardModelObjective(model, LENGTH, center=center)
    variables = _variables(objective)
    pairs = _pairs()
    batch = {k: jnp.asarray(v) for k, v in pairs.items()}

    def by_hand(params):
        r_c = _score_by_hand(model, params, pairs["chosen"], pairs["chosen_mask"])
        r_r = _score_by_hand(model, params, pairs["rejected"], pairs["rejected_mask"])
        return jnp.mean(jnp.log1p(jnp.exp(-(r_c - r_r))) + center * (r_c + r_r) ** 2)

    def through(params):
        return objective.loss({"params": params}, batch, step())[0].value

    got, got_grad = jax.jit(jax.value_and_grad(through))(variables["params"])
    expected, expected_grad = jax.jit(jax.value_and_grad(by_hand))(variables["params"])
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert_tree_close(got_grad, expected_grad)
    metrics = objective.loss(variables, batch, step())[1].metrics
    r_c = _score_by_hand(model, variables["params"], pairs["chosen"], pairs["chosen_mask"])
    r_r = _score_by_hand(model, variables["params"], pairs["rejected"], pairs["rejected_mask"])
    np.testing.assert_allclose(metrics["accuracy"].value, np.mean(np.asarray(r_c > r_r)), rtol=1e-6)
    np.testing.assert_allclose(metrics["margin"].value, np.mean(np.asarray(r_c - r_r)), rtol=1e-4, atol=1e-6)
    # Validation and `dew eval` report every score docs/weights.md lists, each reduced from evaluate.
    outputs = objective.evaluate(variables, batch, step())
    reported = {metric.name: metric.result(metric.update(metric.empty(), outputs)) for metric in objective.metrics()}
    assert set(reported) == {"loss", "accuracy", "margin", "chosen_score", "rejected_score"}
    np.testing.assert_allclose(reported["chosen_score"], np.mean(np.asarray(r_c)), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(reported["rejected_score"], np.mean(np.asarray(r_r)), rtol=1e-4, atol=1e-6)


def test_the_pipeline_scores_text_at_its_last_token_whatever_the_padding():
    model = _model()
    objective = registry.objectives.build("reward_model", model=model, seq_len=LENGTH)
    variables = _variables(objective)
    scoring = objective.pipeline(variables)
    texts = ["3+4=7\n", "12+5=17\n", "1+1=3\n"]
    together = scoring(texts)
    alone = np.concatenate([scoring(t) for t in texts])
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-6)
    ids = np.zeros((1, 16), np.int32)
    ids[0, :8] = list(b"12+5=17\n")
    mask = np.zeros_like(ids)
    mask[0, :8] = 1
    np.testing.assert_allclose(together[1], _score_by_hand(model, variables["params"], ids, mask)[0], rtol=1e-5)
    with pytest.raises(SequenceTooLongError, match="is 20 tokens; the reward model scores texts of 1 to 16"):
        scoring("x" * 20)


def test_the_reward_head_starts_fresh_from_a_language_model_run():
    model = _model()
    objective = RewardModelObjective(model, LENGTH)
    lm = model.init(jax.random.key(4), jnp.zeros((1, 1), jnp.int32))
    variables = objective.init(jax.random.key(0), lm)
    same = jax.tree.map(jnp.array_equal, {k: v for k, v in variables["params"].items() if k != REWARD_HEAD},
                        dict(lm["params"]))
    assert all(jax.tree.leaves(same))
    assert not np.any(np.asarray(variables["params"][REWARD_HEAD]["dense"]["kernel"]))
    assert objective.starting_weights(lambda abstract: abstract).exclude == (REWARD_HEAD,)
