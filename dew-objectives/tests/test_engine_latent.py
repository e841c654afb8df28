"""The generation engine on DeepSeek-V3's multi-head latent attention, against a full forward pass.

The engine's paged pools hold each token's compressed latent and rotated shared key
(dew.nn.latent_attention); these tests check that continuous batching, a shared prompt,
copy-on-write and pre-emption through those pools give the tokens and log-probabilities
a full forward pass of the same model gives (fp32, the family's tiny preset).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.sampling import Engine, Request, Sampling
from test_engine import (  # every test folder is on sys.path (conftest.py)
    CONFIG,
    GREEDY,
    PROMPTS,
    run,
)

MAX_LEN = 32
MODEL = models.build("deepseek_v3", preset="tiny", max_seq_len=MAX_LEN)


@pytest.fixture(scope="module")
def variables():
    return nn.meta.unbox(jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))


@jax.jit
def _forward(variables, tokens):
    return jax.nn.log_softmax(MODEL.apply(variables, tokens).astype(jnp.float32), axis=-1)


def forward_greedy(variables, prompts, budgets):
    """Each prompt continued by argmax of a full forward pass (no cache), one token at a time.

    The rows are padded to MAX_LEN: a causal model's scores at a position do not see the
    padding after it, so one compiled forward pass serves every length.
    """
    tokens = np.zeros((len(prompts), MAX_LEN), np.int32)
    lengths = np.asarray([len(p) for p in prompts])
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = prompt
    for _ in range(max(budgets)):
        scores = np.asarray(_forward(variables, jnp.asarray(tokens)))
        for i, n in enumerate(lengths):
            if n < len(prompts[i]) + budgets[i]:
                tokens[i, n] = int(np.argmax(scores[i, n - 1]))
                lengths[i] += 1
    return [tokens[i, len(p): len(p) + b].tolist() for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))]


def forward_logprobs(variables, prompt, completion):
    """The full forward pass's log-probability of each completion token after prompt."""
    tokens = np.zeros((1, MAX_LEN), np.int32)
    whole = list(prompt) + list(completion)
    tokens[0, : len(whole)] = whole
    scores = np.asarray(_forward(variables, jnp.asarray(tokens)))[0]
    return [float(scores[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


@pytest.mark.slow
def test_latent_attention_decodes_through_the_engine_as_a_full_forward_pass(variables):
    shared = (3, 7, 1, 4, 9, 2, 5)  # one prompt for a group of five: written once, shared
    prompts = [tuple(p) for p in PROMPTS] + [shared]
    budgets = [MAX_LEN - len(p) for p in PROMPTS] + [12]  # the long ones outgrow the pool together
    requests = [Request(p, n, sampling=GREEDY) for p, n in zip(prompts[:-1], budgets[:-1], strict=True)]
    requests.append(Request(shared, 12, samples=5, sampling=GREEDY))  # 9 sequences, 8 rows: rows are handed on
    done, engine = run(MODEL, variables, requests)

    # The pools hold the latent and the rotated key, one shared "head" each (not every head's keys).
    pools = engine.cache["layers_0"]["attention"]
    latent = MODEL.latent
    assert sorted(pools) == ["paged_key_rope", "paged_latent"]
    assert pools["paged_latent"].shape == (CONFIG.num_blocks, CONFIG.block_size, 1, latent.kv_lora_rank)
    assert pools["paged_key_rope"].shape == (CONFIG.num_blocks, CONFIG.block_size, 1,
                                             latent.qk_rope_head_features)

    stats = engine.stats
    assert stats.preemptions > 0  # 4 sequences of 8 blocks each (32 positions) do not fit in 19 blocks
    assert any(c.preemptions > 0 for c in done)
    assert stats.copies > 0  # the group's samples copied the half block of the prompt they share

    expected = forward_greedy(variables, [list(p) for p in prompts], budgets)
    got = [list(c.tokens) for c in done]
    assert got == expected[:-1] + [expected[-1]] * 5
    for completion in done:
        np.testing.assert_allclose(completion.logprobs,
                                   forward_logprobs(variables, completion.prompt, completion.tokens),
                                   rtol=0, atol=1e-5)


@pytest.mark.slow
def test_sampled_latent_decoding_returns_the_models_own_logprobs_whatever_the_schedule(variables):
    hot = Sampling(temperature=1.0)
    prompts = [(5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), (11,), (8, 8, 2, 19)]
    requests = [Request(p, MAX_LEN - len(p), samples=2, sampling=hot) for p in prompts]
    done, engine = run(MODEL, variables, requests)
    assert engine.stats.preemptions > 0
    assert len({c.tokens for c in done}) == len(done)  # the samples differ
    for completion in done:
        np.testing.assert_allclose(completion.logprobs,
                                   forward_logprobs(variables, completion.prompt, completion.tokens),
                                   rtol=0, atol=1e-5)
    # The tokens depend on the keys only: each request alone (no pre-emption) samples the same.
    alone = Engine(MODEL, CONFIG)
    alone.set_params(variables)
    for i, request in enumerate(requests):
        alone.submit(request, jax.random.fold_in(jax.random.key(7), i))
        by_itself = alone.run()
        assert all(c.preemptions == 0 for c in by_itself)
        assert [c.tokens for c in by_itself] == [c.tokens for c in done if c.request == i]
