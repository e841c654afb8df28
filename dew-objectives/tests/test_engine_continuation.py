"""Kept sequences continue after appended tokens exactly as a fresh request for the whole history would.

A multi-turn episode (an environment answering the model) continues each sequence through
``Engine.extend``: the cache written for the earlier turns stays, and only the new tokens are
written. The reference is another engine given the whole history as a new prompt: sample j of a
request draws with ``fold_in(key, j)`` and every token's draw depends only on that key and its
position, so the continuation and the fresh request must produce the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.backbones import CausalTransformer
from dew.sampling import (
    Engine,
    EngineConfig,
    PromptTooLongError,
    Request,
    Sampling,
    UnknownSequenceError,
)

MODEL = CausalTransformer(vocab_size=29, emb_features=16, num_layers=2, num_heads=2, mlp_features=32,
                          max_seq_len=32, position_embedding="rotary")
CONFIG = EngineConfig(max_batch=8, block_size=4, num_blocks=20, prefill_chunk=8, steps_per_call=4)
SAMPLED = Sampling(temperature=1.0)
PROMPT = (3, 7, 1, 4, 9)
ANSWERS = [(11, 12), (13, 14, 15, 16, 17)]  # what an environment appends after turns 0 and 1


@pytest.fixture(scope="module")
def variables():
    return MODEL.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def _engine(variables, config=CONFIG):
    engine = Engine(MODEL, config)
    engine.set_params(variables)
    return engine


def _episodes(engine, key, samples=3, new=3):
    """Every turn's completions: turn t + 1 continues turn t's after ANSWERS[t]."""
    engine.submit(Request(PROMPT, new, samples=samples, sampling=SAMPLED, keep_cache=True), key)
    turns = [engine.run()]
    for t, answer in enumerate(ANSWERS):
        for done in turns[-1]:
            engine.extend(done.id, answer, new, keep_cache=t < len(ANSWERS) - 1)
        turns.append(engine.run())
    return turns


def test_a_continuation_draws_what_a_fresh_request_for_its_history_draws(variables):
    key = jax.random.key(5)
    engine = _engine(variables)
    turns = _episodes(engine, key)
    assert engine.kept == () and engine.blocks.used_blocks == 0  # the last turn kept nothing
    for sample in range(3):
        history = list(PROMPT)
        for t, turn in enumerate(turns):
            done = turn[sample]
            assert (done.sample, done.prompt) == (sample, tuple(history))
            fresh = _engine(variables)
            fresh.submit(Request(tuple(history), 3, samples=sample + 1, sampling=SAMPLED), key)
            again = fresh.run()[sample]
            assert again.tokens == done.tokens, (sample, t)
            np.testing.assert_allclose(again.logprobs, done.logprobs, rtol=1e-5, atol=1e-5)
            history += [*done.tokens, *(ANSWERS[t] if t < len(ANSWERS) else ())]


def test_a_continuation_writes_only_what_the_cache_lacks(variables):
    engine = _engine(variables)
    _episodes(engine, jax.random.key(5), samples=1)
    # prompt: 4 positions written (its last token is the first decode's input); each continuation
    # writes the last token produced and all but the last of the answer: 1 + 1, then 1 + 4.
    assert engine.stats.prefilled_tokens == 4 + 2 + 5
    assert engine.stats.evictions == 0


def test_kept_blocks_go_first_when_the_pool_runs_short_and_the_continuation_is_written_again(variables):
    # 9 usable blocks of 4: three kept samples of 8 positions hold 6; a new request of 28 positions
    # needs 7, so kept blocks are given up (registered as prefixes), and the continuations still agree.
    small = EngineConfig(max_batch=8, block_size=4, num_blocks=10, prefill_chunk=8, steps_per_call=4)
    key = jax.random.key(5)
    engine = _engine(variables, small)
    engine.submit(Request(PROMPT, 3, samples=3, sampling=SAMPLED, keep_cache=True), key)
    first = engine.run()
    engine.submit(Request(tuple(range(1, 25)), 4), jax.random.key(9))
    engine.run()
    assert engine.stats.evictions >= 1 and engine.stats.preemptions == 0
    for done in first:
        engine.extend(done.id, ANSWERS[0], 3)
    again = engine.run()
    reference = _episodes(_engine(variables), key)[1]
    assert [c.tokens for c in again] == [c.tokens for c in reference]


def test_extend_and_release_refuse_what_is_not_kept_and_what_would_not_fit(variables):
    engine = _engine(variables)
    engine.submit(Request(PROMPT, 3, samples=2, sampling=SAMPLED, keep_cache=True), jax.random.key(1))
    first, second = engine.run()
    with pytest.raises(PromptTooLongError, match="max_len=32"):
        engine.extend(first.id, range(1, 25), 8)
    with pytest.raises(UnknownSequenceError, match=f"Sequence {first.id} is not"):
        engine.extend(first.id, (1,), 2)  # refused above: its blocks were let go
    engine.release(second.id)
    with pytest.raises(UnknownSequenceError, match="already extended or released"):
        engine.release(second.id)
    assert engine.blocks.used_blocks == 0
    engine.submit(Request(PROMPT, 3), jax.random.key(1))  # not kept: nothing to extend
    (plain,) = engine.run()
    with pytest.raises(UnknownSequenceError, match="keep_cache=True"):
        engine.extend(plain.id, (1,), 2)


def test_a_stop_string_completed_before_the_stop_token_of_the_same_decode_call_ends_the_turn(variables):
    # An environment's turn ends at its stop strings ("=" closes a calculator call) even when the
    # device ran on to the stop token (a newline) within the same call of steps_per_call tokens.
    letters = "abcdefghijklmnopqrstuvwxyzABC"

    def text(ids):
        return "".join(letters[i] for i in ids)

    greedy = Sampling(temperature=0)
    engine = _engine(variables)
    engine.submit(Request(PROMPT, 4, sampling=greedy), jax.random.key(0))
    (full,) = engine.run()
    later = [t for t in full.tokens[1:] if t != full.tokens[0]]
    assert later, full.tokens  # a stop token other than the first token, within the first call
    engine = Engine(MODEL, CONFIG, detokenize=text)
    engine.set_params(variables)
    engine.submit(Request(PROMPT, 4, sampling=greedy, stop_tokens=(later[0],),
                          stop_strings=(text(full.tokens[:1]),)), jax.random.key(0))
    (cut,) = engine.run()
    assert cut.tokens == full.tokens[:1] and cut.finish == "stop_string"
    assert len(cut.logprobs) == 1


def test_continuations_queued_behind_a_prompt_that_needs_their_blocks_give_them_back(variables):
    # 9 usable blocks of 4: three continuations hold 2 blocks each while they wait behind a prompt
    # of 28 positions that needs 7; with nothing running, they give their blocks back (and are
    # written again) instead of the engine stalling.
    small = EngineConfig(max_batch=8, block_size=4, num_blocks=10, prefill_chunk=8, steps_per_call=4)
    key = jax.random.key(5)
    engine = _engine(variables, small)
    engine.submit(Request(PROMPT, 3, samples=3, sampling=SAMPLED, keep_cache=True), key)
    first = engine.run()
    engine.submit(Request(tuple(range(1, 25)), 4), jax.random.key(9))
    for done in first:
        engine.extend(done.id, ANSWERS[0], 3)
    finished = engine.run()
    assert engine.blocks.used_blocks == 0
    reference = _episodes(_engine(variables), key)[1]
    assert [c.tokens for c in finished[1:]] == [c.tokens for c in reference]
