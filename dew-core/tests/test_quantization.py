"""apply_quantization: the trunk's matmuls in int8 through qwix, the float model's variables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import models
from dew.adapters.quantization import Quantization, QuantizationError, apply_quantization

qwix = pytest.importorskip("qwix")


@pytest.fixture(scope="module")
def model_and_inputs():
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2,
                         num_heads=2, mlp_features=64, max_seq_len=32)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
    return model, tokens, model.init(jax.random.key(0), tokens)


@pytest.mark.slow
def test_variables_are_the_float_models(model_and_inputs):
    model, tokens, variables = model_and_inputs
    quantized = apply_quantization(model, Quantization("int8"))
    shapes = jax.tree.map(jnp.shape, quantized.init(jax.random.key(0), tokens))
    assert shapes == jax.tree.map(jnp.shape, variables)


@pytest.mark.slow
def test_trunk_matmuls_match_qwix_with_the_same_rule(model_and_inputs):
    model, tokens, variables = model_and_inputs
    ours = apply_quantization(model, Quantization("int8")).apply(variables, tokens)
    rule = qwix.QtRule(module_path=r".*layers_\d+.*", weight_qtype="int8", act_qtype="int8")
    hand = qwix.quantize_model(model, qwix.QtProvider([rule])).apply(variables, tokens)
    exact = model.apply(variables, tokens)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(hand))
    error = float(jnp.abs(ours - exact).max() / jnp.abs(exact).max())
    assert 0 < error < 0.1  # quantized, so not equal, but close


@pytest.mark.slow
def test_nothing_selected_is_the_float_model(model_and_inputs):
    model, tokens, variables = model_and_inputs
    untouched = apply_quantization(model, Quantization("int8", modules="no_such_module"))
    np.testing.assert_array_equal(np.asarray(untouched.apply(variables, tokens)),
                                  np.asarray(model.apply(variables, tokens)))


@pytest.mark.slow
def test_quantized_model_trains(model_and_inputs):
    model, tokens, variables = model_and_inputs
    quantized = apply_quantization(model, Quantization("int8", backward="int8"))
    tx = optax.adam(1e-2)

    def loss(v):
        logits = quantized.apply(v, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(v, s):
        value, grads = jax.value_and_grad(loss)(v)
        updates, s = tx.update(grads, s, v)
        return optax.apply_updates(v, updates), s, value

    state = tx.init(variables)
    first = None
    for _ in range(5):
        variables, state, value = step(variables, state)
        first = float(value) if first is None else first
    assert float(value) < first


def test_bad_module_pattern_is_refused():
    with pytest.raises(QuantizationError, match="regular expression"):
        Quantization(modules="layers_(")
