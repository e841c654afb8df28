"""CausalTransformer's speed options: attention through jax.nn.dot_product_attention and
rematerialized layers compute what the default (einsum attention, nothing recomputed) does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.backbones import REMAT_POLICIES, CausalTransformer

TINY = dict(vocab_size=23, emb_features=16, num_layers=2, num_heads=4, mlp_features=32,
            max_seq_len=24, position_embedding="rotary", mlp_activation="swiglu")


def _setup():
    model = CausalTransformer(**TINY)
    tokens = jax.random.randint(jax.random.key(1), (3, 17), 0, TINY["vocab_size"])
    variables = model.init(jax.random.key(0), tokens)
    return model, tokens, variables


def _loss_and_grads(model, variables, tokens):
    def loss(params):
        logits = model.apply({"params": params}, tokens[:, :-1])
        labels = jax.nn.one_hot(tokens[:, 1:], TINY["vocab_size"])
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))

    return jax.jit(jax.value_and_grad(loss))(variables["params"])


@pytest.mark.slow
def test_xla_attention_gives_the_einsum_logits_and_parameters():
    model, tokens, variables = _setup()
    fused = CausalTransformer(**TINY, attention="xla")
    # same parameter tree: the option changes how attention is computed, not what is learned
    assert jax.tree.structure(fused.init(jax.random.key(0), tokens)) == jax.tree.structure(
        variables)
    np.testing.assert_allclose(fused.apply(variables, tokens), model.apply(variables, tokens),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_rematerialized_layers_give_the_same_loss_and_gradients(policy):
    model, tokens, variables = _setup()
    loss, grads = _loss_and_grads(model, variables, tokens)
    remat_loss, remat_grads = _loss_and_grads(
        CausalTransformer(**TINY, remat=policy), variables, tokens)
    np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_decode_with_the_options_matches_the_full_forward():
    model = CausalTransformer(**TINY, attention="xla", remat="full")
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, TINY["vocab_size"])
    variables = model.init(jax.random.key(0), tokens)
    full = model.apply(variables, tokens)
    logits, cache = model.apply(variables, tokens[:, :4], decode=True, mutable=["cache"])
    pieces = [logits]  # a prefill of 4 tokens, then one token at a time
    for t in range(4, tokens.shape[1]):
        logits, cache = model.apply({**variables, **cache}, tokens[:, t:t + 1], decode=True,
                                    mutable=["cache"])
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=2e-5, atol=2e-5)


def test_unknown_options_say_which_ones_exist():
    tokens = jax.numpy.zeros((1, 4), jax.numpy.int32)
    with pytest.raises(ValueError, match="dots_saveable"):
        CausalTransformer(**TINY, remat="most").init(jax.random.key(0), tokens)
    with pytest.raises(ValueError, match="cudnn"):
        CausalTransformer(**TINY, attention="flash").init(jax.random.key(0), tokens)


def test_cudnn_attention_in_float32_is_refused_naming_the_dtype():
    """cuDNN's fused kernel computes in bfloat16 or float16: a float32 model failed at its first trace on a
    GPU, deep in jax, without naming model.dtype."""
    tokens = jax.numpy.zeros((1, 4), jax.numpy.int32)
    with pytest.raises(ValueError, match="computes in bfloat16 or float16 only, and dtype is float32: set dtype=bfloat16"):
        CausalTransformer(**TINY, attention="cudnn").init(jax.random.key(0), tokens)
    half = CausalTransformer(**TINY, attention="cudnn", dtype=jax.numpy.bfloat16)
    from dew.nn.layers import FusedAttentionError

    with pytest.raises(FusedAttentionError, match="on an NVIDIA GPU only, and this process computes on cpu"):
        jax.eval_shape(half.init, jax.random.key(0), tokens)  # past the dtype's check, to the backend's
