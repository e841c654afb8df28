"""The engine's two compiled programs: a prefill chunk, and a few decode steps.

Both read the model's variables and the paged cache as arguments (the cache
donated, so it is updated in place) and everything else as small int arrays the
host builds each call, so their shapes, and thus their compilations, depend only
on the engine's configuration: ``prefill`` takes [rows, chunk] tokens, ``decode``
[batch] last tokens and runs up to ``steps`` tokens on the device before it returns.
Each new token is drawn with a key folded from its sequence's key and its
position, so what a sequence samples does not depend on which row it had, on
what else was in the batch, or on how often it was pre-empted.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from dew.nn.paged_attention import POOL_NAMES, PagedView, copy_blocks, paged
from dew.sampling.options import filter_logits

if TYPE_CHECKING:
    from dew.objectives.base import Variables
    from dew.typing import PyTree

__all__ = ["apply", "decode", "pool_only", "prefill"]


def pool_only(cache: PyTree) -> dict[str, PyTree]:
    """The pools of a 'cache' collection, without the other variables a decode call keeps."""
    flat = traverse_util.flatten_dict(nn.meta.unbox(cache))
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if k[-1] in POOL_NAMES})


def _placed(cache: PyTree, sharding: PyTree) -> PyTree:
    """cache constrained to the pool sharding (a NamedSharding per leaf rank), if any."""
    if sharding is None:
        return cache
    by_rank = dict(sharding)
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, by_rank[x.ndim]), cache)


def apply(model: nn.Module, variables: Variables, cache: PyTree, tokens: jax.Array, positions: jax.Array,
           view: PagedView) -> tuple[jax.Array, PyTree]:
    """The model's logits for tokens at positions, and its pools after writing them through view."""
    with paged(view):
        logits, mutated = model.apply({**variables, "cache": cache}, tokens, positions, decode=True,
                                      mutable=["cache"])
    return logits, pool_only(mutated["cache"])


@functools.partial(jax.jit, static_argnames=("model", "sharding"), donate_argnames=("cache",))
def prefill(model: nn.Module, variables: Variables, cache: PyTree, tokens: jax.Array, positions: jax.Array,
            tables: jax.Array, writes: jax.Array, *, sharding: PyTree = None) -> PyTree:
    """Write the keys and values of tokens [R, C] at positions [R, C] into the rows' blocks."""
    num_blocks, block_size = jax.tree.leaves(cache)[0].shape[-4:-2]
    view = PagedView(tables, writes, num_blocks, block_size)
    _, cache = apply(model, variables, cache, tokens, positions, view)
    return _placed(cache, sharding)


def _draw(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
          top_p: jax.Array, min_p: jax.Array, filtered: bool | None, vocab: int | None) -> jax.Array:
    """Each row's token: greedy where its temperature is 0, else drawn (filtered=None: all greedy).

    With vocab, only ids below it are drawn (a tokenizer spells fewer ids than the model scores).
    """
    if vocab is not None and vocab < logits.shape[-1]:
        spelled = jnp.arange(logits.shape[-1]) < vocab
        logits = jnp.where(spelled, logits, -jnp.inf)  # excluded from a draw at any temperature
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if filtered is None:
        return greedy
    scaled = filter_logits(logits, temperature, top_k, top_p, min_p, filtered=filtered)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, scaled)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)


@functools.partial(jax.jit, static_argnames=("model", "steps", "filtered", "vocab", "key_impl", "sharding"),
                   donate_argnames=("cache",))
def decode(model: nn.Module, variables: Variables, cache: PyTree, tokens: jax.Array, positions: jax.Array,
           tables: jax.Array, limits: jax.Array, keys: jax.Array, settings: jax.Array,
           top_k: jax.Array, stops: jax.Array, copy_from: jax.Array, copy_to: jax.Array, *,
           steps: int, filtered: bool | None, key_impl: str, sharding: PyTree = None,
           vocab: int | None = None) -> tuple[PyTree, jax.Array, jax.Array]:
    """Decode up to steps tokens for each row [B]; returns the cache, tokens and log-probs [B, steps].

    Row b feeds tokens[b] at positions[b] and produces at most limits[b] tokens,
    stopping after one of stops[b] (padded with -1). settings [B, 3] hold each
    row's temperature, top_p and min_p, top_k [B] its top-k (0: off); keys [B, ...]
    are the sequences' key data. filtered says whether a row uses a filter (None:
    every row is greedy, and nothing is drawn). Blocks copy_from[i] are first copied to
    copy_to[i] (copy-on-write; out-of-range targets are skipped). Tokens not
    produced are -1. With vocab, only ids below it are drawn. The log-probability is the
    model's own (temperature 1, unfiltered, over its whole vocabulary) of the token drawn.
    """
    num_blocks, block_size = jax.tree.leaves(cache)[0].shape[-4:-2]
    cache = copy_blocks(cache, copy_from, copy_to)
    base = jax.random.wrap_key_data(keys, impl=key_impl)
    temperature, top_p, min_p = settings[:, 0], settings[:, 1], settings[:, 2]
    batch = tokens.shape[0]

    def alive(carry: tuple) -> jax.Array:
        i, _, _, _, _, _, stopped = carry
        return (i < steps) & jnp.any(~stopped & (i < limits))

    def step(carry: tuple) -> tuple:
        i, cache, token, position, out, logp, stopped = carry
        active = ~stopped & (i < limits)
        view = PagedView(tables, active[:, None], num_blocks, block_size)
        logits, cache = apply(model, variables, cache, token[:, None], position[:, None], view)
        logits = logits[:, 0].astype(jnp.float32)
        keys = jax.vmap(jax.random.fold_in)(base, position + 1)
        new = _draw(logits, keys, temperature, top_k, top_p, min_p, filtered, vocab)
        scores = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(scores, new[:, None], axis=-1)[:, 0]
        out = out.at[:, i].set(jnp.where(active, new, -1))
        logp = logp.at[:, i].set(jnp.where(active, chosen, 0.0))
        stopped = stopped | (active & jnp.any(new[:, None] == stops, axis=-1))
        return (i + 1, _placed(cache, sharding), jnp.where(active, new, token),
                jnp.where(active, position + 1, position), out, logp, stopped)

    carry = (jnp.asarray(0, jnp.int32), cache, tokens, positions,
             jnp.full((batch, steps), -1, jnp.int32), jnp.zeros((batch, steps), jnp.float32),
             jnp.zeros((batch,), bool))
    _, cache, _, _, out, logp, _ = jax.lax.while_loop(alive, step, carry)
    return cache, out, logp
