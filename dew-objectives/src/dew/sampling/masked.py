"""Sampling from masked and block diffusion models.

``masked_generate`` starts from all-mask sequences and reveals tokens over
``steps`` reverse steps from t = 1 to 0 (MDLM's ancestral sampler).
``block_generate`` writes a sequence block by block: each block is denoised
the same way while attending to the clean blocks before it through their
cached keys and values, and a finished block is run once through the model to
add its keys and values to the cache (BD3-LM's sampler).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from dew.diffusion.masking import unmask_step

if TYPE_CHECKING:
    from collections.abc import Callable

    from flax.linen import Module

    from dew.objectives.base import Variables
    from dew.typing import PyTree

__all__ = ["block_generate", "masked_generate", "prompt_cache"]


def _steps(key: jax.Array, tokens: jax.Array, steps: int, mask_id: int, temperature: float,
           logits_of: Callable[..., jax.Array]) -> jax.Array:
    """Reveal tokens from t = 1 down to t = 0 in steps equal steps."""
    times = jnp.linspace(1.0, 0.0, steps + 1)

    def body(i, tokens):
        logits = logits_of(tokens)
        return unmask_step(jax.random.fold_in(key, i), tokens, logits, times[i], times[i + 1],
                           mask_id, temperature)

    return jax.lax.fori_loop(0, steps, body, tokens)


def masked_generate(model: Module, variables: Variables, rows: int, length: int, key: jax.Array, *,
                    steps: int = 64, temperature: float = 1.0,
                    prefix: jax.Array | None = None) -> jax.Array:
    """rows sequences of length ids from a TokenDenoiser; prefix [rows, P] is kept as given."""
    mask_id = model.vocab_size
    tokens = jnp.full((rows, length), mask_id, jnp.int32)
    if prefix is not None:
        tokens = tokens.at[:, : prefix.shape[1]].set(prefix.astype(jnp.int32))
    return _steps(key, tokens, steps, mask_id, temperature,
                  lambda tokens: model.apply(variables, tokens))


def _past_of(state: PyTree, layers: int) -> list[tuple[jax.Array, jax.Array]]:
    inner = state["intermediates"]
    return [inner[f"attention_{i}"]["kv"][0] for i in range(layers)]


def _cached(model: Module, variables: Variables, block: jax.Array, past: PyTree,
            start: int) -> list[tuple[jax.Array, jax.Array]]:
    """past with block's keys and values (its positions from start) appended, each layer's."""
    positions = jnp.broadcast_to(start + jnp.arange(block.shape[1]), block.shape)
    _, state = model.apply(variables, block, positions, None, past, mutable=["intermediates"])
    new = _past_of(state, model.num_layers)
    if past is None:
        return new
    return [(jnp.concatenate([p[0], n[0]], 1), jnp.concatenate([p[1], n[1]], 1))
            for p, n in zip(past, new, strict=True)]


def prompt_cache(model: Module, variables: Variables, prefix: jax.Array,
                 block_size: int) -> list[tuple[jax.Array, jax.Array]]:
    """The keys and values of prefix's whole blocks, cached a block at a time: each sees the blocks up
    to its own, as a clean block does in training (one call would let the first see the later ones)."""
    past = None
    for start in range(0, prefix.shape[1], block_size):
        past = _cached(model, variables, prefix[:, start:start + block_size], past, start)
    assert past is not None, "a prompt of at least one block"
    return past


def block_generate(model: Module, variables: Variables, rows: int, length: int, block_size: int,
                   key: jax.Array, *, steps: int = 16, temperature: float = 1.0,
                   prefix: jax.Array | None = None) -> jax.Array:
    """rows sequences of length ids, block_size ids at a time, with a KV cache across blocks.

    prefix [rows, P] (P a multiple of block_size) fills the first blocks as given.
    """
    if length % block_size:
        raise ValueError(f"length={length} is not a multiple of block_size={block_size}.")
    mask_id = model.vocab_size
    done = 0 if prefix is None else prefix.shape[1]
    if done % block_size:
        raise ValueError(f"A prefix of {done} ids does not fill whole blocks of {block_size}.")
    blocks: list[jax.Array] = []
    past: list[tuple[jax.Array, jax.Array]] | None = None
    if prefix is not None and done:
        prefix = prefix.astype(jnp.int32)
        blocks.append(prefix)
        past = prompt_cache(model, variables, prefix, block_size)
    for start in range(done, length, block_size):
        positions = jnp.broadcast_to(start + jnp.arange(block_size), (rows, block_size))
        block = jnp.full((rows, block_size), mask_id, jnp.int32)

        def logits_of(tokens, past=past, positions=positions):
            return model.apply(variables, tokens, positions, None, past)

        block = _steps(jax.random.fold_in(key, start), block, steps, mask_id, temperature, logits_of)
        blocks.append(block)
        past = _cached(model, variables, block, past, start)
    return jnp.concatenate(blocks, axis=1)
