"""LoRA adapters that change what a model computes, for tests of merging and export.

A fresh adapter's B is zero, so an adapted model computes its base exactly
and a check of the merge or of an export could not fail; the helper here
draws every adapter away from zero on a loaded base.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.adapters.lora import Lora, apply_lora, is_adapter, with_base

__all__ = ["drawn_adapters"]


def drawn_adapters(model: nn.Module, base: Mapping[str, Any], spec: Lora, *, scale: float,
                   seed: int = 1) -> tuple[nn.Module, dict[str, Any]]:
    """model adapted by spec, and its variables on base with every adapter leaf moved by
    scale times a standard normal draw (the base weights untouched)."""
    adapted = apply_lora(model, spec)
    fresh = nn.meta.unbox(adapted.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    variables = with_base(fresh, base)
    leaves = jax.tree_util.tree_leaves_with_path(variables)
    keys = iter(jax.random.split(jax.random.key(seed), len(leaves)))
    drawn = jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf + scale * jax.random.normal(next(keys), leaf.shape)
        if is_adapter(tuple(getattr(p, "key", "") for p in path), leaf) else leaf, variables)  # JAX key entries: dict ones have keys
    return adapted, drawn
