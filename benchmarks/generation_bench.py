"""The generation engine against the static sampler it replaced, and against transformers.

1. Throughput on a GRPO-like rollout: prompts in groups of 8 samples whose
   completion lengths are heavy-tailed (most answers short, a few long). Each
   completion's length is drawn up front and given as its sample's token budget,
   which costs what stopping at an end token there would: the engine frees a
   sequence's row when it ends; the static sampler and transformers' ``generate``
   stop a batch only when its every row has ended, so they run to the longest
   completion of the batch (given as their max_new_tokens: the best case for them).
   Tokens per second count the completions' tokens only. transformers runs the
   same weights exported in Hugging Face's Llama format, on the CPU, greedy.
2. Memory: a group of 8 samples continuing one 512-token prompt. The engine's
   peak cache blocks held, in bytes, against 8 separate caches (the engine with
   prefix sharing off, and the static sampler's [8, max_len] cache); then the
   group is run again in a pool cut to a quarter of 8 separate caches, where it
   must finish with no pre-emption.

Timings repeat --repeats times after a warm-up (compiles excluded) and print
min and median, and the ratios of both. On a loaded machine read the ratios.

    .venv/bin/python benchmarks/generation_bench.py [--groups 8] [--width 128] [--no-hf]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.cli.runs import positive
from dew.nn.backbones import CausalTransformer
from dew.sampling import Engine, EngineConfig, Request, Sampling

GROUP = 8


# -- the static sampler dew shipped before the engine (the baseline) ----------------------------
@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def static_sampler(model, variables, padded, lengths, *, max_new_tokens):
    batch, width = padded.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    logits, mutated = model.apply(variables, padded, positions, decode=True, mutable=["cache"])
    first = jnp.argmax(logits[jnp.arange(batch), lengths - 1], -1).astype(jnp.int32)
    out = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)

    def step(i, carry):
        cache, token, out = carry
        logits, mutated = model.apply({**variables, "cache": cache}, token[:, None],
                                      (lengths + i - 1)[:, None], decode=True, mutable=["cache"])
        token = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        return mutated["cache"], token, out.at[:, i].set(token)

    return jax.lax.fori_loop(1, max_new_tokens, step, (mutated["cache"], first, out))[2]


def heavy_tailed(rng: np.random.Generator, count: int, longest: int) -> np.ndarray:
    """Completion lengths: 85% between 4 and 24 tokens (at most longest), 15% between half of longest
    and longest."""
    short = rng.integers(min(4, longest), min(24, longest) + 1, size=count)
    long = rng.integers(longest // 2, longest + 1, size=count)
    return np.where(rng.random(count) < 0.15, long, short)


def timed(contenders: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each contender per repeat, the contenders interleaved (after one warm-up
    call each, which compiles), so a change in the machine's load hits all of them alike."""
    for fn in contenders.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            began = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - began)
    return seconds


def line(name: str, tokens: int, seconds: list[float]) -> str:
    low, mid = min(seconds), statistics.median(seconds)
    return (f"{name:<26} {tokens / low:9.0f} tokens/s (best)  {tokens / mid:9.0f} tokens/s (median)  "
            f"{low:7.2f} s / {mid:7.2f} s")


def throughput(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    model = CausalTransformer(vocab_size=256, emb_features=args.width, num_layers=args.layers,
                              num_heads=4, mlp_features=4 * args.width,
                              max_seq_len=args.prompt + args.longest,
                              position_embedding="rotary", mlp_activation="swiglu")
    variables = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    prompts = [rng.integers(1, 256, size=int(n)).tolist()
               for n in rng.integers(args.prompt // 2, args.prompt + 1, size=args.groups)]
    lengths = heavy_tailed(rng, args.groups * GROUP, args.longest).reshape(args.groups, GROUP)
    useful = int(lengths.sum())
    rows = args.groups * GROUP
    print(f"model: {args.layers} layers of width {args.width}, {args.groups} prompts of "
          f"{args.prompt // 2}-{args.prompt} tokens x {GROUP} samples; completion lengths "
          f"mean {lengths.mean():.1f}, median {np.median(lengths):.0f}, max {lengths.max()} "
          f"({useful} tokens)")

    padded = np.zeros((rows, args.prompt), np.int32)
    for i, prompt in enumerate(prompts):
        padded[i * GROUP:(i + 1) * GROUP, : len(prompt)] = prompt
    prompt_lengths = np.repeat([len(p) for p in prompts], GROUP).astype(np.int32)

    def static() -> None:  # one batch of every sample, run to the longest completion
        out = static_sampler(model, variables, jnp.asarray(padded), jnp.asarray(prompt_lengths),
                             max_new_tokens=int(lengths.max()))
        out.block_until_ready()

    config = EngineConfig(max_batch=args.max_batch or rows, block_size=16,
                          prefill_chunk=args.prompt, steps_per_call=args.steps)

    def engine() -> None:
        eng = Engine(model, config)
        eng.set_params(variables)
        for i, prompt in enumerate(prompts):
            for j in range(GROUP):
                eng.submit(Request(tuple(prompt), int(lengths[i, j]), sampling=Sampling(0.0)),
                           jax.random.key(i))
        done = eng.run()
        assert sum(len(c.tokens) for c in done) == useful

    contenders = {"static sampler": static, "engine": engine}
    if args.hf:
        contenders["transformers generate"] = hf_generate(model, variables, padded, prompt_lengths,
                                                          int(lengths.max()))
    results = timed(contenders, args.repeats)
    for name, seconds in results.items():
        print(line(name, useful, seconds))
    base = results["engine"]
    for name in results:
        if name != "engine":
            print(f"ratio engine / {name}: {min(results[name]) / min(base):.2f}x (best), "
                  f"{statistics.median(results[name]) / statistics.median(base):.2f}x (median)")


def hf_generate(model, variables, padded, prompt_lengths, max_new_tokens):
    """transformers' generate on the same weights (exported as Llama), left-padded, greedy."""
    import torch
    import transformers

    from dew.pretrained import Pretrained

    with tempfile.TemporaryDirectory() as directory:
        Pretrained(model, variables).save(directory)
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    hf.eval()
    rows, width = padded.shape
    ids = np.zeros((rows, width), np.int64)
    attention = np.zeros((rows, width), np.int64)
    for r in range(rows):
        n = int(prompt_lengths[r])
        ids[r, width - n:] = padded[r, :n]
        attention[r, width - n:] = 1
    ids, attention = torch.from_numpy(ids), torch.from_numpy(attention)

    def run() -> None:
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)

    return run


def memory(args: argparse.Namespace) -> None:
    prompt_length, new = 512, args.memory_new
    model = CausalTransformer(vocab_size=256, emb_features=args.width, num_layers=args.layers,
                              num_heads=4, mlp_features=4 * args.width,
                              max_seq_len=prompt_length + new,
                              position_embedding="rotary", mlp_activation="swiglu")
    variables = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    prompt = tuple(np.random.default_rng(1).integers(1, 256, size=prompt_length).tolist())
    request = Request(prompt, new, samples=GROUP, sampling=Sampling(temperature=1.0))
    base = dict(max_batch=GROUP, block_size=16, prefill_chunk=256, steps_per_call=8)

    def run(**overrides):
        engine = Engine(model, EngineConfig(**{**base, **overrides}))
        engine.set_params(variables)
        engine.submit(request, jax.random.key(0))
        done = engine.run()
        return engine, done

    shared, done = run()
    separate, _ = run(share_prefixes=False)
    pool = jax.tree.leaves(shared.cache)
    block_bytes = sum(x.nbytes for x in pool) / shared.blocks.num_blocks
    position_bytes = block_bytes / 16
    static_bytes = GROUP * model.max_seq_len * position_bytes  # [8, max_len] per layer, keys and values
    held = shared.stats.peak_blocks * block_bytes
    print(f"\nprefix sharing: a group of {GROUP} samples of {new} tokens after one "
          f"{prompt_length}-token prompt; {block_bytes / 1024:.0f} KiB per block of 16 positions")
    print(f"engine, shared prompt:        {shared.stats.peak_blocks:4d} blocks  "
          f"{held / 2**20:7.2f} MiB  ({shared.stats.copies} blocks copied on write)")
    print(f"engine, 8 separate prompts:   {separate.stats.peak_blocks:4d} blocks  "
          f"{separate.stats.peak_blocks * block_bytes / 2**20:7.2f} MiB")
    print(f"static sampler [8, max_len]:         {static_bytes / 2**20:7.2f} MiB")
    print(f"ratio shared / 8 separate caches: {held / (separate.stats.peak_blocks * block_bytes):.3f}x"
          f" (paged), {held / static_bytes:.3f}x (static)")
    quarter = (GROUP * shared.width) // 4
    small, again = run(num_blocks=quarter + 1)
    assert [c.tokens for c in again] == [c.tokens for c in done]
    print(f"the same group in a pool of {quarter} blocks (a quarter of 8 separate caches): "
          f"{small.stats.preemptions} pre-emptions, same samples")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=positive, default=8, help="prompts per rollout (x8 samples)")
    parser.add_argument("--prompt", type=positive, default=64, help="longest prompt")
    parser.add_argument("--longest", type=positive, default=256, help="longest completion")
    parser.add_argument("--width", type=positive, default=128)
    parser.add_argument("--layers", type=positive, default=4)
    parser.add_argument("--steps", type=positive, default=8, help="engine decode steps per call")
    parser.add_argument("--max-batch", type=int, default=0, help="engine rows (0: all samples)")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--memory-new", type=positive, default=32, help="new tokens per sample (memory)")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    args = parser.parse_args()
    throughput(args)
    memory(args)


if __name__ == "__main__":
    main()
