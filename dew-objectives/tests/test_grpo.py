"""GRPO: the loss and gradient equal the written formula; bad groups and rewards are refused; the
rollout samples with the live parameters through one compiled sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.models import build
from dew.objectives.base import Step
from dew.objectives.grpo import GroupSizeError, GRPOObjective
from dew.objectives.policy import token_logprobs
from dew.rewards import NonFiniteRewardError
from dew.sampling import Engine

VOCAB, LENGTH, G = 13, 10, 4


def _model():
    return build("causal_transformer", vocab_size=VOCAB, emb_features=16, num_layers=1, num_heads=2,
                 mlp_features=32, max_seq_len=16)


def _step():
    zero = jnp.asarray(0)
    return Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0))


def _by_hand_logp(model, params, tokens, temperature=1.0):
    logits = model.apply({"params": params}, tokens[:, :-1]) / temperature
    top = logits.max(-1, keepdims=True)
    log_z = jnp.log(jnp.sum(jnp.exp(logits - top), -1)) + top[..., 0]
    return jnp.sum(logits * jax.nn.one_hot(tokens[:, 1:], VOCAB), -1) - log_z


def _batch(model, params, rows=8, temperature=1.0):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(rows, LENGTH)).astype(np.int32)
    mask = np.zeros((rows, LENGTH), np.float32)
    for i in range(rows):
        mask[i, 4:LENGTH - (i % 3)] = 1.0  # completions of different lengths
    reward = np.asarray([1, 0, 0, 1, 0.5, 0.5, 1, 0][:rows], np.float32)
    # The sampling policy differs from the current one, so some ratios leave [0.8, 1.2].
    old = np.asarray(_by_hand_logp(model, params, jnp.asarray(tokens), temperature))
    old = old + rng.normal(scale=0.3, size=old.shape).astype(np.float32)
    return {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask), "reward": jnp.asarray(reward),
            "old_logp": jnp.asarray(old)}


@pytest.mark.parametrize("normalize, temperature", [("token", 1.0), ("sequence", 1.0), ("token", 0.6)])
def test_loss_and_gradient_equal_the_clipped_objective_with_k3(normalize, temperature):
    """At a sampling temperature T, the policy, the sampler's old_logp and the reference are all the
    model's logits over T (TRL's convention): the ratio compares the policy with what sampled."""
    model = _model()
    objective = GRPOObjective(model, group_size=G, clip=0.2, beta=0.1, normalize=normalize,
                              temperature=temperature)
    variables = objective.init(jax.random.key(0))
    variables["reference"] = model.init(jax.random.key(5), jnp.zeros((1, 4), jnp.int32))["params"]
    batch = _batch(model, variables["params"], temperature=temperature)
    r = np.asarray(batch["reward"]).reshape(-1, G)
    advantage = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)  # TRL's
    m = np.asarray(batch["mask"])[:, 1:]

    def by_hand(params):
        logp = _by_hand_logp(model, params, batch["tokens"], temperature)
        ratio = jnp.exp(logp - batch["old_logp"])
        a = advantage[:, None]
        surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a)
        ref = _by_hand_logp(model, variables["reference"], batch["tokens"], temperature)
        k3 = jnp.exp(ref - logp) - (ref - logp) - 1
        per_token = -(surrogate - 0.1 * k3)
        if normalize == "token":
            return jnp.sum(per_token * m) / m.sum()
        return jnp.mean(jnp.sum(per_token * m, 1) / m.sum(1))

    def through_objective(params):
        return objective.loss({**variables, "params": params}, batch, _step())[0].value

    expected, expected_grad = jax.jit(jax.value_and_grad(by_hand))(variables["params"])
    got, got_grad = jax.jit(jax.value_and_grad(through_objective))(variables["params"])
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(expected_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()) + 1e-7)
    metrics = objective.loss(variables, batch, _step())[1].metrics
    ratio = np.exp(np.asarray(_by_hand_logp(model, variables["params"], batch["tokens"], temperature))
                   - batch["old_logp"])
    clipped = (np.abs(ratio - 1) > 0.2) * m
    assert 0 < clipped.sum() < m.sum()  # the fixture exercises both sides of the clip
    np.testing.assert_allclose(metrics["clip_fraction"].value, clipped.sum() / m.sum(), rtol=1e-5)
    np.testing.assert_allclose(metrics["reward"].value, np.mean(np.asarray(batch["reward"])), rtol=1e-6)


def test_a_group_size_that_does_not_divide_the_batch_is_refused_naming_both():
    model = _model()
    objective = GRPOObjective(model, group_size=G)
    variables = objective.init(jax.random.key(0))
    batch = {k: v[:6] for k, v in _batch(model, variables["params"]).items()}
    with pytest.raises(GroupSizeError, match=r"group_size=4 does not divide the batch of 6 rows"):
        objective.loss(variables, batch, _step())


class _State:
    def __init__(self, params):
        self.params = params


def _prompts():
    prompt = np.zeros((2, 3), np.int32)
    prompt[0, :3] = [1, 2, 3]
    prompt[1, :2] = [4, 5]
    return {"prompt": prompt, "prompt_length": np.asarray([3, 2], np.int32),
            "answer": np.asarray([[7], [8]], np.int32)}


def test_a_reward_returning_nan_is_refused_naming_the_record():
    model = _model()

    def flaky(completions, context):
        return [float("nan") if i == 5 else 0.0 for i in range(len(completions))]

    objective = GRPOObjective(model, reward=flaky, group_size=G, max_new_tokens=3)
    rollout = objective.rollout()
    state = _State(objective.init(jax.random.key(0)))
    with pytest.raises(NonFiniteRewardError, match="returned nan for record 5"):
        rollout(state, _prompts(), jax.random.key(1))


def test_the_rollout_samples_with_live_parameters_through_one_compiled_sampler():
    model = _model()
    seen = []

    def first_token(completions, context):
        seen.append((list(completions), {k: np.asarray(v) for k, v in context.items()}))
        return [float(len(c)) for c in completions]

    objective = GRPOObjective(model, reward=first_token, group_size=G, max_new_tokens=4, beta=0.0)
    rollout = objective.rollout()
    variables = objective.init(jax.random.key(0))
    batch = _prompts()
    out = rollout(_State(variables), batch, jax.random.key(2))
    compiled = Engine.compilations()
    # Other parameters (values, not shapes): the same executable, and other samples.
    moved = jax.tree.map(lambda x: x * 1.5, variables)
    again = rollout(_State(moved), batch, jax.random.key(2))
    assert Engine.compilations() == compiled
    assert not np.array_equal(out["tokens"], again["tokens"]) or not np.allclose(out["old_logp"], again["old_logp"])
    tokens, mask = out["tokens"], out["mask"]
    assert tokens.shape == (2 * G, 3 + 4) and mask.shape == tokens.shape
    # Each row is its prompt, then the completion right after it; the mask covers the completion.
    for i in range(2 * G):
        n = int(batch["prompt_length"][i // G])
        np.testing.assert_array_equal(tokens[i, :n], batch["prompt"][i // G, :n])
        np.testing.assert_array_equal(mask[i], [0] * n + [1] * 4 + [0] * (3 - n))
    # The same key and parameters give what generate gives alone (prompt i's group draws with
    # fold_in(key, i), its sample j with fold_in of that and j: generate's row 0, sample 0).
    from dew.sampling import Sampling, generate

    alone = generate(model, {"params": variables["params"]}, [batch["prompt"][0, :3]], 4,
                     jax.random.key(2), Sampling(temperature=1.0))
    np.testing.assert_array_equal(tokens[0, 3:7], alone.new_tokens[0])
    # old_logp scores the sequences under the sampling parameters; answers reach the reward per completion.
    expected = token_logprobs(model, {"params": variables["params"]}, jnp.asarray(tokens))[0]
    np.testing.assert_allclose(out["old_logp"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(seen[0][1]["answer"][:, 0], [7] * G + [8] * G)
    assert out["reward"].tolist() == [float(len(c)) for c in seen[0][0]]
    assert rollout.reward_seconds > 0


class _Letters:
    """ids as letters; eos_id and stop_ids as a checkpoint's eos_token_id list gives them."""

    def __init__(self, eos_id, stop_ids=()):
        self.eos_id, self.stop_ids = eos_id, tuple(stop_ids)

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + int(i)) for i in ids)


def test_without_a_stop_token_a_completion_ends_at_any_end_id_the_tokenizer_names():
    model = _model()
    seen = []

    def record(completions, context):
        seen.append(list(completions))
        return [0.0] * len(completions)

    def rollout_with(tokenizer):
        objective = GRPOObjective(model, reward=record, group_size=G, max_new_tokens=4, beta=0.0,
                                  tokenizer=tokenizer)
        return objective, objective.rollout()

    objective, free = rollout_with(_Letters(eos_id=VOCAB + 1))  # an end id no sample can draw
    state = _State(objective.init(jax.random.key(0)))
    unstopped = free(state, _prompts(), jax.random.key(2))
    drawn = [unstopped["tokens"][i, n:n + 4] for i, n in enumerate(np.repeat([3, 2], G))]
    # Two ids the samples drew, one as the end-of-document id, the other as a further stop id.
    counts = np.bincount(np.concatenate(drawn), minlength=VOCAB)
    eos, other = (int(i) for i in np.argsort(counts)[-2:])
    _, stopped = rollout_with(_Letters(eos_id=eos, stop_ids=(other,)))
    assert stopped.stop_tokens == (eos, other)
    out = stopped(state, _prompts(), jax.random.key(2))
    for i, (row, n) in enumerate(zip(drawn, np.repeat([3, 2], G), strict=True)):
        ends = [j for j, t in enumerate(row) if t in (eos, other)]
        kept = ends[0] + 1 if ends else 4  # the stop itself is trained on, as transformers keeps it
        np.testing.assert_array_equal(out["tokens"][i, n:n + kept], row[:kept])
        np.testing.assert_array_equal(out["mask"][i], [0] * n + [1] * kept + [0] * (3 + 4 - n - kept))
        assert seen[-1][i] == "".join(chr(ord("a") + int(t)) for t in row[:kept - 1 if ends else 4])
    assert any(t in (eos, other) for row in drawn for t in row[:3])  # some completion did stop early
    # A recipe's stop_token still wins over the tokenizer's end ids.
    assert GRPOObjective(model, reward=record, tokenizer=_Letters(eos, (other,)),
                         stop_token=5).rollout().stop_tokens == (5,)


def test_old_logp_is_the_tempered_distribution_the_rollout_sampled_from():
    """Sampled at temperature 0.5, old_logp held log_softmax(logits), the T=1 policy: the clipped
    ratio then corrected towards a distribution nothing sampled from (up to 1.9 nats off here)."""
    model = _model()
    objective = GRPOObjective(model, reward=lambda c, ctx: [0.0] * len(c), group_size=G, max_new_tokens=3,
                              beta=0.0, temperature=0.5)
    variables = objective.init(jax.random.key(0))
    out = objective.rollout()(_State(variables), _prompts(), jax.random.key(3))
    tokens = jnp.asarray(out["tokens"])
    tempered = _by_hand_logp(model, variables["params"], tokens, 0.5)
    np.testing.assert_allclose(out["old_logp"], tempered, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(_by_hand_logp(model, variables["params"], tokens)) - tempered).max() > 1e-2
    # On the parameters that sampled, every ratio is 1: nothing is clipped.
    metrics = objective.loss(variables, {k: jnp.asarray(v) for k, v in out.items()}, _step())[1].metrics
    assert float(metrics["clip_fraction"].value) == 0.0
