"""dew.sampling: cached generation against a naive full-recompute loop, and the filters."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.backbones import CausalTransformer
from dew.sampling import (
    Engine,
    InvalidPromptError,
    InvalidSamplingError,
    PromptTooLongError,
    Sampling,
    choose,
    generate,
)

VOCAB = 29
MODEL = CausalTransformer(vocab_size=VOCAB, emb_features=16, num_layers=2, num_heads=2,
                          mlp_features=32, max_seq_len=20)
ROTARY = CausalTransformer(vocab_size=VOCAB, emb_features=16, num_layers=2, num_heads=2,
                           mlp_features=32, max_seq_len=20, position_embedding="rotary",
                           mlp_activation="swiglu", tie_embeddings=True)
GREEDY = Sampling(temperature=0)
PROMPTS = [[3, 7, 1, 4, 9, 2, 5], [11], [8, 8, 2, 19]]


@pytest.fixture(scope="module")
def boxed():
    return {m: jax.jit(m.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
            for m in (MODEL, ROTARY)}


@pytest.fixture(scope="module")
def variables(boxed):
    return {m: nn.meta.unbox(v) for m, v in boxed.items()}


def naive_greedy(model, variables, prompt, steps):
    """Recompute the whole forward pass for every new token; no cache involved."""
    forward = jax.jit(model.apply)
    tokens = list(prompt)
    for _ in range(steps):
        padded = np.zeros((1, model.max_seq_len), np.int32)  # one shape, one compile
        padded[0, : len(tokens)] = tokens
        logits = forward(variables, jnp.asarray(padded))
        tokens.append(int(np.argmax(logits[0, len(tokens) - 1])))
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("model", [MODEL, ROTARY], ids=["learned", "rotary"])
def test_greedy_equals_a_naive_loop_and_batching_changes_nothing(model, variables):
    steps = 8
    batched = generate(model, variables[model], PROMPTS, steps, jax.random.key(1), GREEDY)
    for row, prompt in zip(batched.tokens, PROMPTS, strict=True):
        assert row == naive_greedy(model, variables[model], prompt, steps)
        alone = generate(model, variables[model], [prompt], steps, jax.random.key(1), GREEDY)
        assert alone.tokens[0] == row
    assert batched.prompt_lengths == (7, 1, 4)
    assert [len(t) for t in batched.new_tokens] == [steps] * 3
    assert all(0 <= t < VOCAB for row in batched.tokens for t in row)


def test_a_model_of_a_million_positions_lays_out_a_cache_for_the_reply_not_its_context(variables, monkeypatch):
    """A checkpoint's context (Llama 3.1's 131072, Mistral Nemo's 1024000) is no cache to lay out per
    row for four new tokens: the engine holds the longest prompt plus the reply, rounded up to a power of
    two, and generates what the naive loop over the model of 20 positions does (rotary: same weights)."""
    import dataclasses
    import importlib

    generating = importlib.import_module("dew.sampling.generate")  # the module: the package names the function so

    built = []

    class Recorded(Engine):
        def __init__(self, model, config, **kwargs):
            super().__init__(model, config, **kwargs)
            built.append(self)

    monkeypatch.setattr(generating, "Engine", Recorded)
    long = dataclasses.replace(ROTARY, max_seq_len=1_024_000)
    done = generate(long, variables[ROTARY], PROMPTS, 4, jax.random.key(1), GREEDY)
    assert built[0].max_len == 16 and built[0].blocks.num_blocks == 4 * 1 + 1  # 7 + 4 positions: a block a row
    for row, prompt in zip(done.tokens, PROMPTS, strict=True):
        assert row == naive_greedy(ROTARY, variables[ROTARY], prompt, 4)


@pytest.mark.slow
def test_top_k_one_and_tiny_top_p_are_greedy(variables):
    params = variables[MODEL]
    greedy = generate(MODEL, params, PROMPTS, 6, jax.random.key(1), GREEDY).tokens
    for sampling in (Sampling(top_k=1), Sampling(temperature=2.0, top_p=1e-6)):
        assert generate(MODEL, params, PROMPTS, 6, jax.random.key(5), sampling).tokens == greedy


@pytest.mark.slow
def test_accepts_boxed_variables_and_arrays(boxed, variables):
    prompts = np.asarray([[1, 2, 3], [4, 5, 6]], np.int32)
    from_boxed = generate(MODEL, boxed[MODEL], prompts, 4, jax.random.key(2))
    from_plain = generate(MODEL, variables[MODEL], prompts.tolist(), 4, jax.random.key(2))
    assert from_boxed.tokens == from_plain.tokens
    assert [row[:3] for row in from_boxed.tokens] == prompts.tolist()


@pytest.mark.slow
def test_compiles_once_per_shape(variables):
    params = variables[MODEL]
    sampling = Sampling(temperature=0.5, top_k=5)
    generate(MODEL, params, [[1, 2], [3, 4]], 5, jax.random.key(0), sampling)
    before = Engine.compilations()
    for seed in range(3):
        generate(MODEL, params, [[seed, 2], [3, seed + 1]], 5, jax.random.key(seed), sampling)
    assert Engine.compilations() == before


def test_sampling_draws_from_the_filtered_softmax():
    logits = jnp.log(jnp.asarray([[0.1, 0.2, 0.3, 0.4]] * 4000))
    keys = jax.random.key(0)
    draws = np.asarray(choose(logits, keys, Sampling()))
    frequencies = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(frequencies, [0.1, 0.2, 0.3, 0.4], atol=0.03)
    top2 = np.asarray(choose(logits, keys, Sampling(top_k=2)))
    assert set(top2.tolist()) == {2, 3}
    np.testing.assert_allclose(np.mean(top2 == 3), 0.4 / 0.7, atol=0.03)
    nucleus = np.asarray(choose(logits, keys, Sampling(top_p=0.65)))  # 0.4 + 0.3 reach it
    assert set(nucleus.tolist()) == {2, 3}
    cold = np.asarray(choose(logits, keys, Sampling(temperature=0.05)))
    assert np.mean(cold == 3) > 0.99


def test_a_temperature_near_the_smallest_normal_float_takes_the_likeliest_token():
    # Dividing logits near 12 by 2e-38 overflowed them to +inf, and the draw took the lowest such
    # id (or, through a filter's softmax, NaN and id 0): the limit of a vanishing temperature is
    # the argmax, as it is at 1e-6.
    logits = jnp.tile(jnp.asarray([[4.5, 0.0, 9.0, 12.3, 8.0, -3.0]]), (64, 1))
    keys = jax.random.key(3)
    for temperature in (1.1754944e-38, 2e-38, 1e-30, 1e-6):
        for filters in ({}, dict(top_p=0.9), dict(top_k=50, top_p=0.5, min_p=0.05)):
            drawn = np.asarray(choose(logits, keys, Sampling(temperature=temperature, **filters)))
            assert drawn.tolist() == [3] * 64, (temperature, filters)


def test_settings_that_are_not_numbers_in_range_are_refused_by_name():
    for field, bad in (("top_k", float("nan")), ("top_k", float("inf")), ("top_k", "5"), ("top_k", True),
                       ("temperature", None), ("temperature", "0.7"), ("top_p", "0.9"), ("min_p", [0.1])):
        with pytest.raises(InvalidSamplingError, match=rf"Sampling\.{field} must be"):
            Sampling(**{field: bad})
    # a top-k past the vocabulary keeps all of it, at any size (the engine holds it as int32)
    assert Sampling(top_k=2**40).as_row()[1] == Sampling(top_k=2**31 - 1).as_row()[1] == 2**31 - 1
    assert Sampling(top_k=np.int64(7), top_p=np.float32(0.5)).as_row()[1:3] == (7, 0.5)


@pytest.mark.slow
def test_bad_settings_and_prompts_fail_clearly(variables):
    for bad in (dict(temperature=-1.0), dict(temperature=float("inf")), dict(temperature=float("nan")),
                dict(top_k=0), dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(InvalidSamplingError):
            Sampling(**bad)
    params = variables[MODEL]
    with pytest.raises(PromptTooLongError, match=r"7 tokens plus max_new_tokens=14 .* 21"):
        generate(MODEL, params, PROMPTS, 14, jax.random.key(0))
    with pytest.raises(InvalidPromptError, match=r"wrap a single prompt as \[prompt\]"):
        generate(MODEL, params, [1, 2, 3], 2, jax.random.key(0))
    with pytest.raises(InvalidPromptError, match="empty"):
        generate(MODEL, params, [[1], []], 2, jax.random.key(0))
    with pytest.raises(InvalidPromptError, match=rf"Prompts \[1\] hold token ids outside the model's vocabulary of {VOCAB}"):
        generate(MODEL, params, [[1], [VOCAB]], 2, jax.random.key(0))  # an id past the embedding table read another row
    with pytest.raises(InvalidPromptError, match=r"Prompts \[0\] hold token ids outside"):
        generate(MODEL, params, [[-1, 2]], 2, jax.random.key(0))
    assert generate(MODEL, params, [[5, 6]], 0, jax.random.key(0)).tokens == [[5, 6]]
