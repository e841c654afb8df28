"""PPO: GAE against the definition, the loss and gradient against the written formula, and one
sample served for K epochs of minibatches by a rollout whose state resumes it exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.models import build
from dew.objectives.advantages import gae
from dew.objectives.base import Step
from dew.objectives.policy import token_logprobs
from dew.objectives.ppo import PPOObjective

VOCAB, LENGTH = 13, 9


def _model():
    return build("causal_transformer", vocab_size=VOCAB, emb_features=16, num_layers=1, num_heads=2,
                 mlp_features=32, max_seq_len=16)


def _step():
    zero = jnp.asarray(0)
    return Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0))


def test_gae_equals_the_discounted_sum_of_td_errors():
    rng = np.random.default_rng(0)
    rows, steps, gamma, lam = 3, 7, 0.9, 0.8
    rewards = rng.normal(size=(rows, steps)).astype(np.float32)
    values = rng.normal(size=(rows, steps)).astype(np.float32)
    mask = np.zeros((rows, steps), np.float32)
    mask[0, 2:7] = 1  # completion to the end
    mask[1, 3:5] = 1  # then padding
    mask[2, 0:6] = 1
    advantages, returns = gae(rewards * mask, values, mask, gamma=gamma, lam=lam)
    for i in range(rows):
        on = np.flatnonzero(mask[i])
        r, v = rewards[i, on], values[i, on]
        v_next = np.append(v[1:], 0.0)  # the value after the last token is 0
        delta = r + gamma * v_next - v
        for k, t in enumerate(on):
            expected = sum((gamma * lam) ** n * delta[k + n] for n in range(len(on) - k))
            assert advantages[i, t] == pytest.approx(expected, rel=1e-5, abs=1e-5)
            assert returns[i, t] == pytest.approx(expected + v[k], rel=1e-5, abs=1e-5)
        assert not advantages[i, mask[i] == 0].any() and not returns[i, mask[i] == 0].any()


def test_loss_and_gradient_equal_the_clipped_policy_and_value_losses():
    model = _model()
    objective = PPOObjective(model, clip=0.2, value_clip=0.1, value_coef=0.7, entropy_coef=0.01)
    variables = objective.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    rows = 4
    tokens = jnp.asarray(rng.integers(1, VOCAB, size=(rows, LENGTH)), jnp.int32)
    mask = np.zeros((rows, LENGTH), np.float32)
    for i in range(rows):
        mask[i, 3:LENGTH - i] = 1
    m = mask[:, 1:]
    # A value head that is not zero, so the value terms have gradients everywhere.
    head = jax.tree.map(lambda x: x + 0.3, variables["params"]["value_head"])
    params = {**variables["params"], "value_head": head}

    def hand_parts(params):
        policy = {k: v for k, v in params.items() if k != "value_head"}
        logits, state = model.apply({"params": policy}, tokens[:, :-1], capture_intermediates=True)
        hidden = state["intermediates"]["final_norm"]["__call__"][0]
        dense = params["value_head"]["dense"]
        values = hidden @ dense["kernel"][:, 0] + dense["bias"][0]
        top = logits.max(-1, keepdims=True)
        log_z = jnp.log(jnp.sum(jnp.exp(logits - top), -1)) + top[..., 0]
        logp_all = logits - log_z[..., None]
        logp = jnp.sum(logp_all * jax.nn.one_hot(tokens[:, 1:], VOCAB), -1)
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
        return logp, values, entropy

    logp0, values0, _ = hand_parts(params)
    batch = {
        "tokens": tokens, "mask": jnp.asarray(mask), "reward": jnp.ones((rows,)),
        "old_logp": logp0 + jnp.asarray(rng.normal(scale=0.3, size=logp0.shape), jnp.float32),
        "old_values": values0 + jnp.asarray(rng.normal(scale=0.2, size=values0.shape), jnp.float32),
        "advantage": jnp.asarray(rng.normal(size=logp0.shape), jnp.float32) * m,
        "returns": jnp.asarray(rng.normal(size=logp0.shape), jnp.float32) * m,
        "kl": jnp.zeros((rows,)),
    }

    def by_hand(params):
        logp, values, entropy = hand_parts(params)
        ratio = jnp.exp(logp - batch["old_logp"])
        a = batch["advantage"]
        policy = -jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a)
        v_old, ret = batch["old_values"], batch["returns"]
        clipped_v = v_old + jnp.clip(values - v_old, -0.1, 0.1)
        value = 0.5 * jnp.maximum((values - ret) ** 2, (clipped_v - ret) ** 2)
        return jnp.sum((policy + 0.7 * value - 0.01 * entropy) * m) / m.sum()

    def through_objective(params):
        return objective.loss({**variables, "params": params}, batch, _step())[0].value

    expected, expected_grad = jax.jit(jax.value_and_grad(by_hand))(params)
    got, got_grad = jax.jit(jax.value_and_grad(through_objective))(params)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(expected_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()) + 1e-7)


class _State:
    def __init__(self, params):
        self.params = params


def _prompts(count: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"prompt": rng.integers(1, VOCAB, size=(count, 3)).astype(np.int32),
            "prompt_length": np.full((count,), 3, np.int32),
            "answer": rng.integers(1, VOCAB, size=(count, 1)).astype(np.int32)}


def test_one_sample_serves_k_epochs_of_minibatches_and_resumes_from_its_state():
    model = _model()
    calls = []

    def reward(completions, context):
        calls.append(len(completions))
        return [float(len(c)) / 4 for c in completions]

    objective = PPOObjective(model, reward=reward, epochs=3, minibatches=2, max_new_tokens=4, kl_coef=0.1,
                             kl_target=0.01, kl_horizon=100.0)
    variables = objective.init(jax.random.key(0))
    variables["reference"] = jax.tree.map(lambda x: x * 0.9, variables["reference"])  # a KL to adapt to
    rollout = objective.rollout()
    served = [rollout(_State(variables), _prompts(8, step), jax.random.key(step)) for step in range(3)]
    assert calls == [8]  # one sample so far, for three steps
    # Each epoch covers every row of the sample exactly once, in two minibatches of four.
    first = np.concatenate([served[0]["tokens"], served[1]["tokens"]])
    np.testing.assert_array_equal(np.sort(first.view(f"V{first.shape[1] * 4}").ravel()),
                                  np.sort(rollout.sample["tokens"].view(f"V{first.shape[1] * 4}").ravel()))
    assert all(v["tokens"].shape == (4, 3 + 4) for v in served)
    # The KL coefficient moved after the sample, by the controller's rule.
    # The sample's per-token mean log-ratio to the reference is what the coefficient adapts to,
    # and what every step of the sample logs as kl (a mean of row means was logged, then each
    # minibatch's own mean, which the docs did not describe).
    mask = rollout.sample["mask"][:, 1:]
    by_hand = (rollout.sample["old_logp"] - np.asarray(token_logprobs(
        model, {"params": variables["reference"]}, jnp.asarray(rollout.sample["tokens"]))[0])) * mask
    kl = float(by_hand.sum() / mask.sum())
    np.testing.assert_allclose(rollout.sample["kl"], kl * mask.sum(1), rtol=1e-5, atol=1e-6)
    expected = 0.1 * (1 + np.clip(kl / 0.01 - 1, -0.2, 0.2) * 8 / 100.0)
    assert rollout.kl_coef == pytest.approx(expected, rel=1e-5)
    assert rollout.kl_coef != 0.1
    # The sample's rewards were shaped with 0.1, and that is the coefficient its steps log.
    np.testing.assert_array_equal(rollout.sample["kl_coef"], np.full(8, 0.1, np.float32))
    logged = objective.loss(variables, {k: jnp.asarray(v) for k, v in served[2].items()}, _step())[1].metrics
    picked = [int(np.flatnonzero((rollout.sample["tokens"] == t).all(1))[0]) for t in served[2]["tokens"]]
    assert abs(by_hand[picked].sum() / mask[picked].sum() - kl) > 1e-4  # this minibatch's own differs
    np.testing.assert_allclose(logged["kl"].value, kl, rtol=1e-5)
    # A fresh rollout given the saved state serves exactly what this one serves next.
    saved = rollout.get_state()
    resumed = objective.rollout()
    resumed.set_state(saved)
    for step in range(3, 8):
        a = rollout(_State(variables), _prompts(8, step), jax.random.key(step))
        b = resumed(_State(variables), _prompts(8, step), jax.random.key(step))
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert calls == [8, 8, 8]  # the second sample began at step 6, in both


@pytest.mark.parametrize("temperature", [0.0, float("nan")])
def test_a_temperature_that_samples_nothing_is_refused(temperature):
    """At 0 the rollout decoded greedily and divided the logits by 0: every step's loss was NaN and rejected,
    and the run still wrote its checkpoint and called itself done."""
    with pytest.raises(ValueError, match=r"PPOObjective\.temperature must be above 0, got (0\.0|nan).*NaN"):
        PPOObjective(_model(), temperature=temperature)
