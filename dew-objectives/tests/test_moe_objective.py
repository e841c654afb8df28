"""LMObjective trains an MoE model on its balance loss and router z-loss, however the model is
built: plain, LoRA-adapted, or as a scanned stack (whose layers used to drop their experts).

The reference is computed here: the plain model's logits give the cross-entropy by hand,
and its sown statistics the two auxiliary losses; every variant computes the same
function (fresh adapters add zero; a stack holds the same weights), so each must report
those statistics and train on cross-entropy + 0.5 * balance + 0.1 * z.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from dew.adapters.lora import Lora, adapters_only, apply_lora
from dew.nn.backbones import CausalTransformer
from dew.nn.moe import moe_statistics
from dew.nn.pipeline import stack_layers
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective

SEQ = 6
OPTIONS = dict(vocab_size=16, emb_features=8, num_layers=2, num_heads=2, mlp_features=16, max_seq_len=SEQ,
               experts=4, experts_per_token=2, expert_capacity=1.0)


@pytest.mark.slow
def test_the_balance_and_z_losses_are_trained_on_plain_adapted_and_scanned():
    plain = CausalTransformer(**OPTIONS)
    text = jax.random.randint(jax.random.key(3), (3, SEQ + 1), 0, 16)
    shapes = nn.meta.unbox(jax.eval_shape(plain.init, jax.random.key(0), text[:, :-1]))
    rng = np.random.default_rng(0)  # drawn here: no init to compile
    variables = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5, jnp.float32), shapes)
    logits, sown = jax.jit(lambda v, t: plain.apply(v, t, mutable=["moe"]))(variables, text[:, :-1])
    expected = {name: float(value) for name, value in moe_statistics(sown).items()}
    log_probs = np.asarray(jax.nn.log_softmax(logits), np.float64)
    cross_entropy = -np.mean(np.take_along_axis(log_probs, np.asarray(text[:, 1:, None]), -1))
    assert expected["load_balancing_loss"] > 1.0 and expected["router_z_loss"] > 0
    assert expected["dropped_fraction"] > 0

    scanned = CausalTransformer(**OPTIONS, scan_layers=True)
    lora = Lora(rank=2, targets=("attention",))
    variants = {"plain": LMObjective(plain, SEQ, expert_loss_weight=0.5, router_z_loss_weight=0.1),
                "lora": adapters_only(LMObjective(apply_lora(plain, lora), SEQ, expert_loss_weight=0.5,
                                                  router_z_loss_weight=0.1)),
                "scanned": LMObjective(scanned, SEQ, expert_loss_weight=0.5, router_z_loss_weight=0.1)}
    zero = jnp.asarray(0)
    step = Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0))
    for name, objective in variants.items():
        # The same weights under every variant: fresh adapters, or the layers stacked.
        if "lora" in name:
            start = jax.jit(lambda key, objective=objective: objective.init(key, variables))(jax.random.key(1))
        elif name == "scanned":
            start = {"params": stack_layers(variables["params"], OPTIONS["num_layers"])}
        else:
            start = variables
        loss, aux = jax.jit(lambda v, b, objective=objective: objective.loss(v, b, step))(start, {"text": text})
        metrics = {key: float(value.value) for key, value in aux.metrics.items()}
        for statistic, value in expected.items():
            assert metrics[statistic] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, statistic)
        total = cross_entropy + 0.5 * expected["load_balancing_loss"] + 0.1 * expected["router_z_loss"]
        assert float(loss.value) == pytest.approx(total, rel=1e-5), name


def test_a_negative_z_loss_weight_is_refused():
    with pytest.raises(ValueError, match="router_z_loss_weight must be >= 0"):
        LMObjective(CausalTransformer(**OPTIONS), SEQ, router_z_loss_weight=-1.0)
