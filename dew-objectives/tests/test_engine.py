"""The generation engine against the static sampler it replaced, a full forward pass, and itself.

The static sampler (right-padded prompts, one contiguous cache row each, a
decode loop until every row is done) is kept here, and only here, as the
reference the engine must match token for token at temperature 0.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.backbones import CausalTransformer
from dew.sampling import (
    Engine,
    EngineConfig,
    EngineConfigError,
    InvalidSamplingError,
    NotPagedModelError,
    PromptTooLongError,
    Request,
    Sampling,
    choose,
    filter_logits,
    generate,
)
from dew.testing.processes import run_python, shared_compilation_cache

VOCAB = 29
SHAPE = dict(vocab_size=VOCAB, emb_features=16, num_layers=2, num_heads=2, mlp_features=32,
             max_seq_len=32)
LEARNED = CausalTransformer(**SHAPE)
ROTARY = CausalTransformer(**SHAPE, position_embedding="rotary", mlp_activation="swiglu",
                           tie_embeddings=True, num_kv_heads=1)
SCANNED = CausalTransformer(**SHAPE, scan_layers=True)
# One layout for every test, so they share compiled programs: blocks of 4 positions, 19
# usable blocks (a sequence of 32 positions takes 8), prompts written 8 positions at a time.
CONFIG = EngineConfig(max_batch=8, block_size=4, num_blocks=20, prefill_chunk=8, steps_per_call=4)
GREEDY = Sampling(temperature=0)
PROMPTS = [[3, 7, 1, 4, 9, 2, 5], [11], [8, 8, 2, 19], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 1]]


# -- the static sampler, as dew shipped it before the engine --------------------------------
@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def _static_sampler(model, variables, padded, lengths, *, max_new_tokens):
    batch, width = padded.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    logits, mutated = model.apply(variables, padded, positions, decode=True, mutable=["cache"])
    last = logits[jnp.arange(batch), lengths - 1]
    first = jnp.argmax(last, -1).astype(jnp.int32)
    out = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)

    def step(i, carry):
        cache, token, out = carry
        logits, mutated = model.apply({**variables, "cache": cache}, token[:, None],
                                      (lengths + i - 1)[:, None], decode=True, mutable=["cache"])
        token = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        return mutated["cache"], token, out.at[:, i].set(token)

    return jax.lax.fori_loop(1, max_new_tokens, step, (mutated["cache"], first, out))[2]


def static_greedy(model, variables, prompts, max_new_tokens):
    """Greedy continuations [len(prompts)][max_new_tokens] from the static sampler."""
    padded = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, prompt in enumerate(prompts):
        padded[i, : len(prompt)] = prompt
    out = _static_sampler(model, variables, jnp.asarray(padded),
                          jnp.asarray([len(p) for p in prompts], jnp.int32),
                          max_new_tokens=max_new_tokens)
    return np.asarray(out).tolist()


@pytest.fixture(scope="module")
def variables():
    return {m: nn.meta.unbox(jax.jit(m.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
            for m in (LEARNED, ROTARY, SCANNED)}


def run(model, variables, requests, key=jax.random.key(7), config=CONFIG, **engine):
    """Every completion of requests (a list of (Request, key index)), in submission order."""
    eng = Engine(model, config, **engine)
    eng.set_params(variables)
    for i, request in enumerate(requests):
        eng.submit(request, jax.random.fold_in(key, i))
    return eng.run(), eng


# -- temperature 0: the static sampler's tokens ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("model", [LEARNED, ROTARY, SCANNED], ids=["learned", "rotary_gqa", "scanned"])
def test_greedy_equals_the_static_sampler_token_for_token(model, variables):
    expected = static_greedy(model, variables[model], PROMPTS, 12)
    got = generate(model, variables[model], PROMPTS, 12, jax.random.key(1), GREEDY, config=CONFIG)
    assert got.new_tokens == expected
    assert got.tokens == [p + e for p, e in zip(PROMPTS, expected, strict=True)]
    assert got.stopped == (False,) * len(PROMPTS)
    if model is LEARNED:  # an end-of-document id: each row ends at its first one, inclusive
        eos = expected[0][2]
        cut = generate(model, variables[model], PROMPTS, 12, jax.random.key(1), GREEDY, eos_id=eos,
                       config=CONFIG)
        for row, full in zip(cut.new_tokens, expected, strict=True):
            assert row == (full[: full.index(eos) + 1] if eos in full else full)
        assert cut.stopped == tuple(eos in full for full in expected)


# -- shared prompts, copy-on-write --------------------------------------------------------------
@pytest.mark.slow
def test_a_group_writes_its_prompt_once_and_each_sample_copies_the_block_it_shares(variables):
    params = variables[LEARNED]
    prompt = (3, 7, 1, 4, 9, 2, 5)  # 6 positions written: block 0 full, block 1 half
    (alone,) = static_greedy(LEARNED, params, [list(prompt)], 10)
    done, engine = run(LEARNED, params, [Request(prompt, 10, samples=4, sampling=GREEDY)])
    assert [list(c.tokens) for c in done] == [alone] * 4
    stats = engine.stats
    assert stats.prefilled_tokens == 6  # once, not once per sample
    # The first decode writes position 6 into the shared half block: three samples copy
    # it, the last one left holding it writes in place.
    assert stats.copies == 3
    # The same prompt submitted one sample at a time is written once too.
    one_by_one, engine = run(LEARNED, params, [Request(prompt, 10, sampling=GREEDY)] * 4)
    assert [list(c.tokens) for c in one_by_one] == [alone] * 4
    assert engine.stats.prefilled_tokens == 6
    # Sampled: sharing changes nothing (each sample reads its prompt through the shared
    # blocks and writes only its own), and the samples differ from one another.
    hot = Request(prompt, 10, samples=4, sampling=Sampling(temperature=1.5))
    shared, with_sharing = run(LEARNED, params, [hot])
    separate, without = run(LEARNED, params, [hot],
                            config=dataclasses.replace(CONFIG, share_prefixes=False))
    assert [c.tokens for c in shared] == [c.tokens for c in separate]
    assert len({c.tokens for c in shared}) > 1
    assert without.stats.prefilled_tokens == 4 * 6
    assert with_sharing.stats.peak_blocks < without.stats.peak_blocks


@pytest.mark.slow
def test_registered_prefixes_are_reused_across_requests_and_forgotten_with_new_weights(variables):
    params = variables[LEARNED]
    long = tuple(range(1, 14))  # 12 positions written: three full blocks
    engine = Engine(LEARNED, CONFIG)
    engine.set_params(params)
    engine.submit(Request(long, 2, sampling=GREEDY), jax.random.key(0))
    first = engine.run()
    engine.submit(Request(long[:9] + (20, 21), 2, sampling=GREEDY), jax.random.key(0))
    second = engine.run()
    assert engine.stats.reused_tokens == 8  # blocks 0 and 1 match; block 2 holds other tokens
    expected = static_greedy(LEARNED, params, [list(long), list(long[:9]) + [20, 21]], 2)
    assert [list(first[0].tokens), list(second[0].tokens)] == expected
    engine.set_params(params)
    engine.submit(Request(long, 2, sampling=GREEDY), jax.random.key(0))
    engine.run()
    assert engine.stats.reused_tokens == 8


def test_new_weights_open_no_group_written_with_the_old_ones(variables):
    """A request for a prompt whose group still had samples waiting joined that group after
    set_params, and decoded from the prompt the old weights wrote: neither weights' output."""
    params = variables[LEARNED]
    moved = jax.tree.map(lambda x: x * 1.5, params)
    prompt = tuple(range(1, 14))
    engine = Engine(LEARNED, EngineConfig(max_batch=2, block_size=4, num_blocks=20, prefill_chunk=16,
                                          steps_per_call=1, min_bucket=1, batch_buckets=1))
    engine.set_params(params)
    engine.submit(Request(prompt, 3, samples=4, sampling=GREEDY), jax.random.key(0))
    engine.step()  # the prompt is written; two of its samples run, two wait for a row
    engine.set_params(moved)
    late = engine.submit(Request(prompt, 3, samples=2, sampling=GREEDY), jax.random.key(1))
    mine = [list(c.tokens) for c in engine.run() if c.request == late]
    assert mine == [static_greedy(LEARNED, moved, [list(prompt)], 3)[0]] * 2


# -- continuous batching, pre-emption, reproducibility -----------------------------------------
@pytest.mark.slow
def test_finished_sequences_hand_their_rows_to_queued_ones_without_recompiling(variables):
    params = variables[LEARNED]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, size=int(n)).tolist() for n in rng.integers(1, 9, size=12)]
    budgets = [int(n) for n in rng.integers(1, 13, size=12)]
    requests = [Request(tuple(p), n, sampling=GREEDY) for p, n in zip(prompts, budgets, strict=True)]
    done, engine = run(LEARNED, params, requests)
    expected = static_greedy(LEARNED, params, prompts, 12)
    assert [list(c.tokens) for c in done] == [e[:n] for e, n in zip(expected, budgets, strict=True)]
    assert all(c.finish == "length" for c in done)
    # 12 sequences through 8 rows: the engine never ran more than 8 at once, and a second
    # run with other prompts and budgets compiles nothing new.
    compiled = Engine.compilations()
    again = [Request(tuple(p[::-1]), max(n - 1, 1), sampling=GREEDY)
             for p, n in zip(prompts, budgets, strict=True)]
    run(LEARNED, params, again)
    assert Engine.compilations() == compiled


@pytest.mark.slow
def test_running_out_of_blocks_preempts_the_longest_and_resumes_it_unchanged(variables):
    params = variables[LEARNED]
    prompts = [(1, 2, 3, 4, 5), (9, 8, 7, 6, 5, 4, 3, 2, 1), (4, 4, 4), (2, 7, 1, 8, 2, 8, 1)]
    budgets = [32 - len(p) for p in prompts]  # 8 blocks each at the end: 32 > 19 blocks
    greedy = [Request(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets, strict=True)]
    done, engine = run(LEARNED, params, greedy)
    assert engine.stats.preemptions > 0
    assert done[1].preemptions > 0  # the longest prompt is the longest sequence throughout
    expected = static_greedy(LEARNED, params, [list(p) for p in prompts], max(budgets))
    assert [list(c.tokens) for c in done] == [e[:n] for e, n in zip(expected, budgets, strict=True)]
    # Sampled: the same tokens as each sequence run alone (no pre-emption, another schedule).
    hot = [Request(p, n, sampling=Sampling(temperature=1.0, top_k=8, min_p=0.05))
           for p, n in zip(prompts, budgets, strict=True)]
    together, crowded = run(LEARNED, params, hot)
    assert crowded.stats.preemptions > 0
    alone = Engine(LEARNED, CONFIG)
    alone.set_params(params)
    for i, request in enumerate(hot):
        alone.submit(request, jax.random.fold_in(jax.random.key(7), i))
        (one,) = alone.run()
        assert one.tokens == together[i].tokens and one.preemptions == 0
        np.testing.assert_allclose(one.logprobs, together[i].logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sampled_outputs_are_reproducible_from_the_seed_and_snapshots_continue_them(variables):
    params = variables[ROTARY]
    sampling = Sampling(temperature=0.9, top_p=0.9)
    requests = [Request(tuple(p), 10, samples=2, sampling=sampling) for p in PROMPTS]
    first, _ = run(ROTARY, params, requests, key=jax.random.key(3))
    again, _ = run(ROTARY, params, requests, key=jax.random.key(3))
    other, _ = run(ROTARY, params, requests, key=jax.random.key(4))
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert [c.tokens for c in first] != [c.tokens for c in other]
    # Stop after two rounds, carry the snapshot to a fresh engine, finish there.
    engine = Engine(ROTARY, CONFIG)
    engine.set_params(params)
    for i, request in enumerate(requests):
        engine.submit(request, jax.random.fold_in(jax.random.key(3), i))
    finished = engine.step() + engine.step()
    snapshot = engine.snapshot()
    assert snapshot.sequences and any(s.generated for s in snapshot.sequences)
    resumed = Engine(ROTARY, CONFIG)
    resumed.set_params(params)
    resumed.restore(snapshot)
    combined = sorted(finished + resumed.run(), key=lambda c: c.id)
    assert [c.tokens for c in combined] == [c.tokens for c in first]


# -- what comes back: log-probabilities, stops ----------------------------------------------------
@pytest.mark.slow
def test_logprobs_are_the_models_own_and_stops_end_where_they_say(variables):
    params = variables[LEARNED]
    prompt = (3, 7, 1, 4, 9)
    sampling = Sampling(temperature=0.7, top_k=5)
    (done,), _ = run(LEARNED, params, [Request(prompt, 12, sampling=sampling)])
    tokens = jnp.asarray([prompt + done.tokens])
    scores = jax.nn.log_softmax(LEARNED.apply(params, tokens)[0, :-1], -1)  # a full forward pass
    expected = [float(scores[len(prompt) - 1 + i, t]) for i, t in enumerate(done.tokens)]
    np.testing.assert_allclose(done.logprobs, expected, rtol=1e-4, atol=1e-5)
    # Stop strings: letters stand for ids; the text ends at the token that completes one.
    (full,) = static_greedy(LEARNED, params, [list(prompt)], 12)
    letters = "abcdefghijklmnopqrstuvwxyzABC"

    def text(ids):
        return "".join(letters[i] for i in ids)

    stop = text(full[4:6])
    end = next(n for n in range(1, 13) if stop in text(full[:n]))
    (cut,), _ = run(LEARNED, params, [Request(prompt, 12, sampling=GREEDY, stop_strings=(stop,))],
                    detokenize=text)
    assert list(cut.tokens) == full[:end] and cut.finish == "stop_string"
    (ended,), _ = run(LEARNED, params, [Request(prompt, 12, sampling=GREEDY,
                                                stop_tokens=(full[3], 28))])
    assert list(ended.tokens) == full[: full.index(full[3]) + 1] and ended.finish == "stop_token"


def test_a_tokenizer_smaller_than_the_vocabulary_is_drawn_from_alone_with_the_models_logprobs(variables):
    # A vocabulary padded past the tokenizer's: ids at or above vocab cannot be spelled, so no draw
    # (greedy or sampled, at any temperature: at 3e38 one over it is flushed to 0) makes one; the
    # log-probabilities stay the model's own over every row.
    params, limit = variables[LEARNED], 12
    requests = [Request(tuple(p), 16, sampling=s) for p in PROMPTS
                for s in (GREEDY, Sampling(temperature=1.5), Sampling(temperature=3e38))]
    unlimited, _ = run(LEARNED, params, requests)
    assert max(t for c in unlimited for t in c.tokens) >= limit  # the random model reaches past it
    limited, _ = run(LEARNED, params, requests, vocab=limit)
    assert all(t < limit for c in limited for t in c.tokens)
    (done,) = limited[1:2]
    prompt = requests[1].prompt
    scores = jax.nn.log_softmax(LEARNED.apply(params, jnp.asarray([prompt + done.tokens]))[0, :-1], -1)
    expected = [float(scores[len(prompt) - 1 + i, t]) for i, t in enumerate(done.tokens)]
    np.testing.assert_allclose(done.logprobs, expected, rtol=1e-4, atol=1e-5)
    greedy = [c for c, r in zip(limited, requests, strict=True) if r.sampling.greedy]
    for completion, prompt in zip(greedy, PROMPTS, strict=True):  # greedy takes the likeliest spelled id
        tokens = jnp.asarray([list(prompt) + list(completion.tokens)])
        logits = LEARNED.apply(params, tokens)[0, len(prompt) - 1:-1, :limit]
        assert list(completion.tokens) == np.asarray(jnp.argmax(logits, -1)).tolist()


def test_filters_keep_what_each_row_asks_for():
    probabilities = jnp.asarray([0.1, 0.2, 0.3, 0.4])
    logits = jnp.log(jnp.tile(probabilities, (4000, 1)))
    draws = np.asarray(jax.jit(choose, static_argnums=2)(logits, jax.random.key(0),
                                                         Sampling(min_p=0.6)))  # p >= 0.24
    assert set(draws.tolist()) == {2, 3}
    np.testing.assert_allclose(np.mean(draws == 3), 0.4 / 0.7, atol=0.03)
    # One batch, a different setting per row, equals each setting applied alone.
    rows = [Sampling(), Sampling(top_k=2), Sampling(temperature=0.5, top_p=0.65),
            Sampling(temperature=2.0, min_p=0.6)]  # sqrt(p) / sqrt(0.4) >= 0.6
    batch = jnp.log(jnp.tile(probabilities, (4, 1)))
    columns = [jnp.asarray(c) for c in zip(*(s.as_row() for s in rows), strict=True)]
    filtered = jax.jit(filter_logits)
    mixed = filtered(batch, *columns)
    for i, sampling in enumerate(rows):
        alone = filtered(batch[i:i + 1], *(c[i:i + 1] for c in columns))
        np.testing.assert_array_equal(mixed[i], alone[0])
        kept = np.asarray(mixed[i]) > jnp.finfo(jnp.float32).min
        by_hand = {0: [1, 1, 1, 1], 1: [0, 0, 1, 1], 2: [0, 0, 1, 1], 3: [0, 1, 1, 1]}[i]
        assert kept.tolist() == [bool(b) for b in by_hand], sampling
    with pytest.raises(InvalidSamplingError, match="min_p"):
        Sampling(min_p=1.5)
    # top-p counts tokens by rank: of four tied tokens it keeps the two whose mass reaches 0.3 (it kept
    # all four, whose logits equal the cut's), and the same two transformers' TopPLogitsWarper keeps:
    # the higher ids (dew kept the lower ones, a different distribution over the same count).
    torch = pytest.importorskip("torch")
    warpers = pytest.importorskip("transformers.generation.logits_process")
    for row, top_p in (([1.0, 1.0, 1.0, 1.0, 0.0], 0.3), ([1.0] * 8, 0.5), (np.log([0.5, 0.25, 0.25]).tolist(), 0.75)):
        tied = filtered(jnp.asarray([row]), *(jnp.asarray([v]) for v in Sampling(top_p=top_p).as_row()))
        theirs = warpers.TopPLogitsWarper(top_p)(None, torch.tensor([row]))[0]
        assert (np.asarray(tied[0]) > jnp.finfo(jnp.float32).min).tolist() == \
            torch.isfinite(theirs).tolist(), (row, top_p)
    assert (np.asarray(filtered(jnp.asarray([[1.0, 1.0, 1.0, 1.0, 0.0]]), *(jnp.asarray([v]) for v in
            Sampling(top_p=0.3).as_row()))[0]) > jnp.finfo(jnp.float32).min).tolist() == [False, False, True, True, False]
    # a temperature the device would flush to 0 (neither greedy nor a draw at it) is refused
    with pytest.raises(InvalidSamplingError, match=r"temperature must be 0 \(greedy\) or a finite number >= 1\.18e-38"):
        Sampling(temperature=1e-39)
    assert Sampling(temperature=1.2e-38).temperature > 0


# -- bad input -------------------------------------------------------------------------------------
class NoCache(nn.Module):
    vocab_size: int = 5
    max_seq_len: int = 8

    @nn.compact
    def __call__(self, tokens, positions=None, *, decode=False):
        return nn.Embed(self.vocab_size, self.vocab_size)(tokens)


def test_bad_requests_and_layouts_are_refused_naming_what_is_wrong(variables):
    engine = Engine(LEARNED, CONFIG)
    with pytest.raises(PromptTooLongError, match=r"prompt of 30 tokens plus max_new_tokens=5 is 35 "
                                                 r"tokens, more than the cache holds \(max_len=32\)"):
        engine.submit(Request(tuple(range(30)), 5), jax.random.key(0))
    with pytest.raises(PromptTooLongError, match=r"prompt of 40 tokens is longer than the cache "
                                                 r"\(max_len=32 positions\)"):
        engine.submit(Request(tuple(range(40)), 0), jax.random.key(0))
    with pytest.raises(EngineConfigError, match=r"num_blocks=5 cannot hold one sequence of "
                                                r"max_len=32 .* use num_blocks >= 9"):
        Engine(LEARNED, EngineConfig(block_size=4, num_blocks=5))
    with pytest.raises(EngineConfigError, match="detokenize="):
        engine.submit(Request((1, 2), 3, stop_strings=("x",)), jax.random.key(0))
    with pytest.raises(EngineConfigError, match="max_batch must be a positive integer"):
        EngineConfig(max_batch=0)
    # Found by an audit of the engine as RL uses it: each was junk or a traceback.
    from dew.sampling import InvalidPromptError, InvalidVariablesError

    engine.set_params(variables[LEARNED])
    vocab = LEARNED.vocab_size
    with pytest.raises(InvalidPromptError, match=rf"outside the model's vocabulary of {vocab} ids .*: \[{vocab + 30}\]"):
        engine.submit(Request((1, vocab + 30), 3), jax.random.key(0))  # it sampled NaN log-probs
    with pytest.raises(InvalidPromptError, match=r"JAX key \(jax.random.key\(seed\)\), not a int"):
        engine.submit(Request((1, 2), 3), 7)  # type: ignore[arg-type]
    with pytest.raises(InvalidPromptError, match="token ids, not text"):
        Request("abc", 4)  # type: ignore[arg-type]
    wider = nn.meta.unbox(CausalTransformer(**{**SHAPE, "emb_features": 2 * SHAPE["emb_features"]}).init(
        jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    with pytest.raises(InvalidVariablesError, match=r"do not fit its model: params\['embed'\]\['embedding'\] has shape"):
        engine.set_params(wider)  # it failed at run() with flax's ScopeParamShapeError
    plain = NoCache()
    with pytest.raises(NotPagedModelError, match="CausalSelfAttention"):
        Engine(plain, EngineConfig(block_size=4)).set_params(
            plain.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))


# -- many devices ------------------------------------------------------------------------------------
SHARDED = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import linen as nn
from dew.nn.backbones import CausalTransformer
from dew.sampling import Engine, EngineConfig, Request, Sampling
from dew.training import Layout, MeshSpec, build_mesh

model = CausalTransformer(vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          mlp_features=64, max_seq_len=32, position_embedding="rotary")
boxed = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
plain = nn.meta.unbox(boxed)
mesh = build_mesh(MeshSpec(fsdp=4, tensor=2))
placed = jax.device_put(plain, Layout(min_shard=0).shardings(mesh, boxed))
config = EngineConfig(max_batch=8, block_size=4, prefill_chunk=8, steps_per_call=4)
requests = [Request((1, 2, 3, 4, 5, 6, 7), 12, samples=4, sampling=Sampling(temperature=0)),
            Request((9, 8), 20, samples=2, sampling=Sampling(temperature=1.0, top_k=10))]

def run(variables):
    engine = Engine(model, config)
    engine.set_params(variables)
    for i, request in enumerate(requests):
        engine.submit(request, jax.random.fold_in(jax.random.key(1), i))
    return engine, [list(c.tokens) for c in engine.run()]

one_engine, one = run(jax.device_put(plain, jax.devices()[0]))
many_engine, many = run(placed)
pool = many_engine.cache["layers_0"]["attention"]["paged_key"]
print("RESULT " + json.dumps({"one": one, "many": many, "spec": str(pool.sharding.spec),
                              "devices": len(pool.sharding.device_set)}))
"""


@pytest.mark.slow
def test_the_engine_shards_with_the_models_layout_and_samples_the_same(tmp_path):
    result = run_python(SHARDED, devices=8, timeout=600, compilation_cache=shared_compilation_cache(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[7:])
    assert out["many"] == out["one"]
    assert out["devices"] == 8 and "tensor" in out["spec"]  # key/value heads split as the attention's
