"""MoEBlock against a per-token loop written out by hand, its capacity rule, its balance loss,
and LMObjective's use of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from dew.nn.backbones import CausalTransformer
from dew.nn.moe import ExpertConfigError, MoEBlock, expert_capacity, moe_statistics
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective


def by_hand(params: dict, x: np.ndarray, k: int, capacity: int) -> tuple[np.ndarray, float]:
    """Route token by token: first choices in token order, then second choices, each expert
    taking at most capacity tokens of a row; returns the output and the dropped fraction."""
    router, wi, wo = (np.asarray(params[n], np.float64) for n in ("router", "wi", "wo"))
    batch, length, _ = x.shape
    out = np.zeros_like(x, dtype=np.float64)
    dropped = 0
    for b in range(batch):
        logits = x[b] @ router
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        order = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        gates = np.take_along_axis(probs, order, -1)
        gates = gates / gates.sum(-1, keepdims=True) if k > 1 else gates
        used = np.zeros(router.shape[1], int)
        for rank in range(k):
            for t in range(length):
                expert = order[t, rank]
                if used[expert] >= capacity:
                    dropped += 1
                    continue
                used[expert] += 1
                hidden = np.asarray(jax.nn.gelu(jnp.asarray(x[b, t] @ wi[expert])), np.float64)
                out[b, t] += gates[t, rank] * (hidden @ wo[expert])
    return out, dropped / (batch * length * k)


@pytest.mark.parametrize("k, factor", [(2, 8.0), (2, 0.5), (1, 0.5)])
def test_the_block_computes_what_routing_by_hand_does(k, factor):
    block = MoEBlock(experts=4, hidden_features=8, experts_per_token=k, capacity_factor=factor)
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 6, 5)))
    variables = nn.meta.unbox(block.init(jax.random.key(0), x))
    # A router that means it: the init's small weights would make every choice a near tie.
    variables["params"]["router"] = jax.random.normal(jax.random.key(2), (5, 4)) * 3
    y, sown = block.apply(variables, x, mutable=["moe"])
    capacity = expert_capacity(6, 4, k, factor)
    expected, dropped = by_hand(variables["params"], x, k, capacity)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-5)
    stats = moe_statistics(sown)
    assert float(stats["dropped_fraction"]) == pytest.approx(dropped)
    assert (dropped > 0) == (factor < 1)  # the small capacity really drops assignments


def test_uniform_routing_has_balance_loss_one_and_a_skewed_router_more():
    block = MoEBlock(experts=4, hidden_features=8, experts_per_token=2)
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 8, 5)))
    variables = nn.meta.unbox(block.init(jax.random.key(0), x))
    variables["params"]["router"] = jnp.zeros((5, 4))
    _, sown = block.apply(variables, x, mutable=["moe"])
    assert float(moe_statistics(sown)["load_balancing_loss"]) == pytest.approx(1.0)
    variables["params"]["router"] = jnp.zeros((5, 4)).at[:, 0].set(5.0)
    _, sown = block.apply(variables, jnp.abs(x), mutable=["moe"])
    assert float(moe_statistics(sown)["load_balancing_loss"]) > 1.5


@pytest.mark.slow
def test_lm_objective_trains_on_the_balance_loss_with_its_weight():
    model = CausalTransformer(vocab_size=16, emb_features=8, num_layers=2, num_heads=2, mlp_features=16,
                              max_seq_len=6, experts=4, experts_per_token=2, expert_capacity=1.0)
    text = jax.random.randint(jax.random.key(3), (3, 7), 0, 16)
    variables = LMObjective(model, seq_len=6).init(jax.random.key(0))
    zero = jnp.asarray(0)
    step = Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0))
    plain, aux = LMObjective(model, seq_len=6, expert_loss_weight=0.0,
                             router_z_loss_weight=0.0).loss(variables, {"text": text}, step)
    weighted, _ = LMObjective(model, seq_len=6, expert_loss_weight=0.5,
                              router_z_loss_weight=0.0).loss(variables, {"text": text}, step)
    balance = aux.metrics["load_balancing_loss"].value
    assert float(balance) >= 1.0 and 0 <= float(aux.metrics["dropped_fraction"].value) < 1
    assert float(weighted.value) == pytest.approx(float(plain.value) + 0.5 * float(balance), rel=1e-6)
    # The router z-loss adds its own weight times its statistic (ST-MoE's mean squared logsumexp).
    both, _ = LMObjective(model, seq_len=6, expert_loss_weight=0.5,
                          router_z_loss_weight=0.1).loss(variables, {"text": text}, step)
    z = aux.metrics["router_z_loss"].value
    assert float(z) > 0
    assert float(both.value) == pytest.approx(float(weighted.value) + 0.1 * float(z), rel=1e-6)
    # Evaluation scores the cross-entropy alone.
    scored = LMObjective(model, seq_len=6, expert_loss_weight=0.5).evaluate(variables, {"text": text}, step)
    assert float(scored["loss"].value) == pytest.approx(float(plain.value), rel=1e-6)
    # The init keeps no routing statistics among the variables a trainer would checkpoint.
    assert set(variables) == {"params"}


def test_padding_of_packed_rows_moves_no_routing_statistic():
    """Segment id 0 marks padding: what its positions hold changes neither the balance loss
    nor the z-loss, while the same ids as a document do."""
    model = CausalTransformer(vocab_size=16, emb_features=8, num_layers=2, num_heads=2, mlp_features=16,
                              max_seq_len=8, experts=4, experts_per_token=2, expert_capacity=4.0)
    objective = LMObjective(model, seq_len=8)
    variables = objective.init(jax.random.key(0))
    zero = jnp.asarray(0)
    step = Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0))
    text = np.asarray(jax.random.randint(jax.random.key(3), (2, 9), 0, 16))
    segments = np.array([[1] * 5 + [0] * 4, [1] * 3 + [2] * 4 + [0] * 2], np.int32)
    other = text.copy()
    other[segments == 0] = (other[segments == 0] + 7) % 16

    def routing(text, segments):
        _, aux = objective.loss(variables, {"text": jnp.asarray(text), "segment_ids": jnp.asarray(segments)}, step)
        return {name: float(aux.metrics[name].value) for name in ("load_balancing_loss", "router_z_loss")}

    first = routing(text, segments)
    assert routing(other, segments) == pytest.approx(first, rel=1e-6)
    as_documents = np.where(segments == 0, 3, segments)
    assert routing(other, as_documents) != pytest.approx(routing(text, as_documents), rel=1e-6)


def test_impossible_expert_settings_are_refused_by_name():
    x = jnp.ones((1, 4, 5))
    with pytest.raises(ExpertConfigError, match="experts_per_token=3"):
        MoEBlock(experts=2, hidden_features=8, experts_per_token=3).init(jax.random.key(0), x)
    with pytest.raises(ExpertConfigError, match="capacity_factor must be positive"):
        MoEBlock(experts=2, hidden_features=8, capacity_factor=0).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="experts_per_token between 1 and experts"):
        CausalTransformer(vocab_size=8, emb_features=4, num_layers=1, num_heads=1, mlp_features=8,
                          max_seq_len=4, experts=2, experts_per_token=3).init(
            jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
