"""A paged key/value cache: attention layers read and write fixed-size blocks of one shared pool.

Instead of a ``[batch, max_len]`` cache per row, each attention layer holds one pool
of blocks, ``paged_key`` and ``paged_value`` of shape ``[num_blocks, block_size,
kv_heads, head_width]`` in the 'cache' collection, and each sequence a *block table*:
the pool blocks that hold its positions ``0..block_size-1``, ``block_size..2*block_size-1``
and so on. Sequences with a common prefix point at the same blocks, so a prompt
is stored once however many samples continue it, and a finished sequence's blocks
go straight to the next one. A generation engine (``dew.sampling.Engine``) owns the
tables and decides which blocks are free; this module only moves keys and values.

A model applied with ``decode=True`` inside ``paged(PagedView(...))`` takes this path:
every attention layer first writes the new keys and values of the rows' tokens
into their blocks, then gathers each row's blocks back into one sequence, so that
the gathered slot ``s`` holds position ``s``, and every query attends to the slots at
or before its own position. That is the layout the contiguous cache has, so the
masks and scores computed after the cache step are the same in both paths.

A layer chooses what it stores per token (``store``): grouped-query attention its
keys and values (``update``); multi-head latent attention (dew.nn.latent_attention)
its compressed latent and its shared rotary key (``LATENT_POOL_NAMES``), each pool
with one "head", as a single key/value head would be. Every pool has the same
``[num_blocks, block_size, heads, width]`` layout, so the block tables, copy-on-write
and the engine's scheduling do not depend on which attention a model has.

>>> import jax, jax.numpy as jnp
>>> from dew.nn.backbones import CausalTransformer
>>> model = CausalTransformer(vocab_size=11, emb_features=8, num_layers=1, num_heads=2,
...                           mlp_features=16, max_seq_len=8)
>>> variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
>>> tokens = jnp.asarray([[3, 1, 4, 1, 5]])
>>> whole = model.apply(variables, tokens)
>>> view = PagedView(block_tables=jnp.asarray([[2, 1]]), writes=jnp.ones((1, 5), bool),
...                  num_blocks=3, block_size=4)
>>> with paged(view):
...     logits, cache = model.apply(variables, tokens, jnp.arange(5)[None], decode=True,
...                                 mutable=["cache"])
>>> cache["cache"]["layers_0"]["attention"]["paged_key"].shape  # [blocks, block_size, kv, width]
(3, 4, 2, 4)
>>> bool(jnp.allclose(logits, whole, atol=1e-5))
True
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import sharding as axes

if TYPE_CHECKING:
    from jax.tree_util import KeyPath

    from dew.typing import PyTree

__all__ = [
    "LATENT_POOL_NAMES",
    "POOL_AXES",
    "POOL_NAMES",
    "PagedView",
    "copy_blocks",
    "current_view",
    "paged",
    "store",
    "update",
]

LATENT_POOL_NAMES = ("paged_latent", "paged_key_rope")
"""The pools of a latent attention layer: its normalized kv latent and its rotated shared key."""

POOL_NAMES = ("paged_key", "paged_value", *LATENT_POOL_NAMES)
"""The names of a layer's pool variables in the 'cache' collection."""

POOL_AXES: tuple[str | None, ...] = (None, None, axes.ACTIVATION_HEADS, None)
"""The logical axes of one pool [blocks, block_size, kv_heads, head_width]: its heads split
as the attention's key/value heads are, so a layer writes its keys where they were computed."""


@dataclass(frozen=True)
class PagedView:
    """Where the rows of one decode call keep their keys and values.

    block_tables int32 [B, W]: the pool block holding positions ``j*block_size ...`` of
    row b is ``block_tables[b, j]``; W blocks cover ``W * block_size`` positions.
    writes bool [B, T]: which of the call's tokens to store (padding rows and the
    padded tail of a prefill chunk are computed but never stored).
    num_blocks and block_size are the pool's static size.
    """

    block_tables: jax.Array
    writes: jax.Array
    num_blocks: int
    block_size: int


_CURRENT: contextvars.ContextVar[PagedView | None] = contextvars.ContextVar("dew_paged_view",
                                                                            default=None)


@contextlib.contextmanager
def paged(view: PagedView) -> Iterator[PagedView]:
    """Decode through view's blocks in every attention layer traced inside this block."""
    token = _CURRENT.set(view)
    try:
        yield view
    finally:
        _CURRENT.reset(token)


def current_view() -> PagedView | None:
    """The paged view attention traced now decodes through (None: the contiguous cache)."""
    return _CURRENT.get()


def store(module: nn.Module, entries: Mapping[str, jax.Array],
          positions: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    """Store each of entries ({pool name: [B, T, heads, width]}) at positions [B, T]; read the rows back.

    Returns, in entries' order, every position each row's table covers
    ([B, W * block_size, heads, width], slot s holding position s), and the
    position each slot holds ([1, S]), as the contiguous cache does, so the
    attention layer builds one mask (causal, and windowed where it slides).
    """
    view = current_view()
    if view is None:
        raise RuntimeError("paged_attention.store runs inside paged(PagedView(...)) only.")
    unknown = set(entries) - set(POOL_NAMES)
    if unknown:
        raise ValueError(f"Unknown pool names {sorted(unknown)}; a pool is one of {POOL_NAMES} "
                         "(copy-on-write copies those only).")
    tables = view.block_tables.astype(jnp.int32)
    capacity = view.num_blocks * view.block_size
    column = jnp.clip(positions // view.block_size, 0, tables.shape[1] - 1)
    block = jnp.take_along_axis(tables, column, axis=1)
    slot = block * view.block_size + positions % view.block_size
    slot = jnp.where(view.writes, slot, capacity).reshape(-1)  # out of range: dropped
    read = []
    for name, new in entries.items():
        batch, length, heads, width = new.shape
        shape = (view.num_blocks, view.block_size, heads, width)
        pool = module.variable("cache", name, jnp.zeros, shape, new.dtype)
        flat = pool.value.reshape(capacity, heads, width)
        flat = flat.at[slot].set(new.reshape(batch * length, heads, width).astype(flat.dtype),
                                 mode="drop")
        pool.value = flat.reshape(shape)
        rows = jnp.take(pool.value, tables, axis=0)  # [B, W, block_size, heads, width]
        read.append(rows.reshape(batch, -1, heads, width))
    slots = jnp.arange(tables.shape[1] * view.block_size, dtype=jnp.int32)[None, :]
    return read, slots


def update(module: nn.Module, k: jax.Array, v: jax.Array,
           positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Store k, v [B, T, kv_heads, width] at positions [B, T] in module's pool; read the rows back.

    Returns the keys and values of every position each row's table covers
    ([B, W * block_size, kv_heads, width], slot s holding position s) and the
    position each slot holds ([1, S]) (see ``store``).
    """
    (keys, values), slots = store(module, {"paged_key": k, "paged_value": v}, positions)
    return keys, values, slots


def copy_blocks(cache: PyTree, source: jax.Array, target: jax.Array) -> PyTree:
    """cache with block target[i] of every pool a copy of block source[i] (copy-on-write).

    Pairs whose target is out of range (the pool's size) are skipped, so a fixed
    number of pairs can be passed padded. A stacked pool (scanned layers,
    [layers, blocks, ...]) is copied in every layer.
    """
    def one(path: KeyPath, leaf: jax.Array) -> jax.Array:
        if not (isinstance(path[-1], jax.tree_util.DictKey) and path[-1].key in POOL_NAMES):
            return leaf
        lead = (slice(None),) * (leaf.ndim - 4)
        return leaf.at[(*lead, target)].set(leaf[(*lead, jnp.clip(source, 0, leaf.shape[-4] - 1))],
                                           mode="drop")

    return jax.tree_util.tree_map_with_path(one, cache)
