"""Masked and block diffusion: the MDLM ELBO by hand, BD3-LM's two limits, the cached sampler."""

from __future__ import annotations

import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.diffusion.masking import unmask_step
from dew.nn.token_denoiser import TokenDenoiser
from dew.objectives.base import Step
from dew.objectives.block_diffusion import BlockDiffusionObjective
from dew.objectives.masked_diffusion import InvalidTokensError, MaskedDiffusionObjective
from dew.sampling.masked import block_generate, masked_generate

VOCAB, LENGTH = 3, 3
MODEL = TokenDenoiser(vocab_size=VOCAB, emb_features=16, num_layers=2, num_heads=2,
                      mlp_features=32, max_seq_len=8)
SEQUENCE = np.asarray([0, 2, 1], np.int32)


def step(seed):
    return Step(step=jnp.int32(0), microstep=jnp.int32(0), updates=jnp.int32(0),
                key=jax.random.key(seed))


@pytest.fixture(scope="module")
def variables():
    # Random but not uniform predictions: scale the head so the ELBO terms differ.
    variables = nn.meta.unbox(MODEL.init(jax.random.key(0), jnp.zeros((1, LENGTH), jnp.int32)))
    params = dict(variables["params"], head=variables["params"]["head"] * 4.0)
    return {"params": params}


def log_probs(variables, tokens):
    logits = np.asarray(MODEL.apply(variables, jnp.asarray(tokens)[None]), np.float64)[0]
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def hand_elbo(variables):
    """sum over masked sets M of  integral_0^1 t^|M| (1-t)^(L-|M|) (1/t) dt  *  sum_{l in M} CE_l(M)."""
    total = 0.0
    for k in range(1, LENGTH + 1):
        beta = math.factorial(k - 1) * math.factorial(LENGTH - k) / math.factorial(LENGTH)
        for masked in itertools.combinations(range(LENGTH), k):
            noisy = SEQUENCE.copy()
            noisy[list(masked)] = VOCAB
            lp = log_probs(variables, noisy)
            total += beta * sum(-lp[position, SEQUENCE[position]] for position in masked)
    return total / LENGTH  # per token


def monte_carlo(objective, variables, rows=8192, draws=8):
    batch = {"text": np.tile(SEQUENCE, (rows, 1))}
    loss = jax.jit(objective.loss)
    return float(np.mean([float(loss(variables, batch, step(seed))[0].value) for seed in range(draws)]))


@pytest.mark.slow
def test_masked_diffusion_loss_is_the_hand_computed_elbo(variables):
    objective = MaskedDiffusionObjective(MODEL, seq_len=LENGTH, t_min=1e-4)
    expected = hand_elbo(variables)
    assert expected > 0.5  # not a trivially small number
    np.testing.assert_allclose(monte_carlo(objective, variables), expected, rtol=0.02)


def test_one_block_covering_the_window_is_masked_diffusion(variables):
    masked = MaskedDiffusionObjective(MODEL, seq_len=LENGTH)
    block = BlockDiffusionObjective(MODEL, seq_len=LENGTH, block_size=LENGTH)
    batch = {"text": np.tile(SEQUENCE, (64, 1))}
    for seed in range(3):
        a, _ = jax.jit(masked.loss)(variables, batch, step(seed))
        b, _ = jax.jit(block.loss)(variables, batch, step(seed))
        np.testing.assert_allclose(float(b.value), float(a.value), rtol=1e-5)


@pytest.mark.slow
def test_block_size_one_is_the_autoregressive_loss(variables):
    objective = BlockDiffusionObjective(MODEL, seq_len=LENGTH, block_size=1, t_min=1e-4)
    # By hand: each position predicted from the clean ids before it and a mask in its place,
    # under a plain causal mask.
    ar = []
    for position in range(LENGTH):
        tokens = np.append(SEQUENCE[:position], VOCAB)
        causal = jnp.tril(jnp.ones((len(tokens), len(tokens)), bool))[None, None]
        logits = np.asarray(MODEL.apply(variables, jnp.asarray(tokens)[None], None, causal),
                            np.float64)[0, -1]
        ar.append(-(logits[SEQUENCE[position]] - np.log(np.exp(logits).sum())))
    # The logits of the all-masked window are exactly those causal predictions...
    all_masked = jnp.full((1, LENGTH), VOCAB)
    logits = np.asarray(objective.logits(variables, all_masked, jnp.asarray(SEQUENCE)[None]))[0]
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(-lp[np.arange(LENGTH), SEQUENCE], ar, rtol=1e-4, atol=1e-6)
    # ...and the (1/t)-weighted loss averages to their mean.
    np.testing.assert_allclose(monte_carlo(objective, variables), np.mean(ar), rtol=0.02)


@pytest.mark.slow
def test_block_sampler_with_a_kv_cache_matches_recomputing_the_prefix(variables):
    rows, length, size, steps = 2, 6, 2, 3
    key = jax.random.key(7)
    cached = block_generate(MODEL, variables, rows, length, size, key, steps=steps)

    # Without a cache: every step reads the whole clean prefix again, block-causally.
    tokens = jnp.zeros((rows, 0), jnp.int32)
    times = jnp.linspace(1.0, 0.0, steps + 1)
    for start in range(0, length, size):
        block = jnp.full((rows, size), VOCAB, jnp.int32)
        ids = jnp.arange(start + size) // size
        mask = (ids[:, None] >= ids[None, :]) | (ids[:, None] == start // size)
        mask = mask & ~((ids[:, None] < start // size) & (ids[None, :] == start // size))
        for i in range(steps):
            logits = MODEL.apply(variables, jnp.concatenate([tokens, block], 1), None, mask[None, None])
            block = unmask_step(jax.random.fold_in(jax.random.fold_in(key, start), i), block,
                                logits[:, start:], times[i], times[i + 1], VOCAB)
        tokens = jnp.concatenate([tokens, block], 1)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(tokens))
    assert int(jnp.max(cached)) < VOCAB  # nothing left masked
    # Given its first two blocks as a prompt, it writes the third as it did.
    prompted = block_generate(MODEL, variables, rows, length, size, key, steps=steps, prefix=tokens[:, :4])
    np.testing.assert_array_equal(np.asarray(prompted), np.asarray(tokens))


def test_a_prompt_of_several_blocks_is_cached_as_training_sees_clean_blocks(variables):
    """The prompt went through the model in one call without a mask, so its first block attended to its
    second: from the second layer on, the cache, and the next block's logits, were not training's."""
    from dew.sampling.masked import prompt_cache

    rows, size = 2, 2
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (rows, 2 * size)), jnp.int32)
    objective = BlockDiffusionObjective(MODEL, 3 * size, block_size=size)
    clean = jnp.concatenate([prompt, jnp.zeros((rows, size), jnp.int32)], 1)
    noisy = clean.at[:, 2 * size:].set(VOCAB)  # the next block wholly masked, the prompt clean before it
    trained = np.asarray(objective.logits(variables, noisy, clean))[:, 2 * size:]
    positions = jnp.broadcast_to(2 * size + jnp.arange(size), (rows, size))
    sampled = np.asarray(MODEL.apply(variables, noisy[:, 2 * size:], positions, None,
                                     prompt_cache(MODEL, variables, prompt, size)))
    np.testing.assert_allclose(sampled, trained, atol=1e-5)


def test_masked_generate_reveals_everything_and_keeps_a_prefix(variables):
    out = masked_generate(MODEL, variables, 3, LENGTH, jax.random.key(1), steps=4,
                          prefix=jnp.asarray([[2], [2], [2]]))
    assert out.shape == (3, LENGTH) and int(out.max()) < VOCAB
    assert out[:, 0].tolist() == [2, 2, 2]


def test_bad_windows_are_refused(variables):
    objective = MaskedDiffusionObjective(MODEL, seq_len=LENGTH)
    with pytest.raises(InvalidTokensError, match=r"shape \(2, 7\).*\[batch, 3\]"):
        objective.loss(variables, {"text": np.zeros((2, 7), np.int32)}, step(0))
    with pytest.raises(ValueError, match="multiple of block_size=2"):
        BlockDiffusionObjective(MODEL, seq_len=LENGTH, block_size=2)


def test_an_unmasking_draw_at_a_vanishing_temperature_takes_the_likeliest_id():
    # logits near 12 divided by 2e-38 overflowed to +inf and the draw took the lowest id among
    # them; the limit of a vanishing temperature is the argmax, as the greedy step takes.
    logits = jnp.tile(jnp.asarray([[[4.5, 0.0, 12.3, 9.0]]]), (16, 3, 1))
    masked = jnp.full((16, 3), VOCAB + 1, jnp.int32)
    greedy = unmask_step(jax.random.key(0), masked, logits, jnp.float32(1.0), jnp.float32(0.0), VOCAB + 1, 0.0)
    for temperature in (1.1754944e-38, 2e-38, 1e-6):
        cold = unmask_step(jax.random.key(0), masked, logits, jnp.float32(1.0), jnp.float32(0.0), VOCAB + 1,
                           temperature)
        assert np.asarray(cold).tolist() == np.asarray(greedy).tolist() == [[2] * 3] * 16
    for objective in (MaskedDiffusionObjective, BlockDiffusionObjective):  # below float32's normal range
        with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or at least 1.18e-38, got 1e-40"):
            objective(MODEL, seq_len=4, temperature=1e-40)
        with pytest.raises(ValueError, match="temperature must be 0"):
            objective(MODEL, seq_len=4, temperature=-1.0)
