"""Variables with every leaf moved off its initial value, for tests that compare two computations
of one model: a norm scale of 1 or a zero bias at init would hide a missing or misread leaf."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def perturbed(variables, *, key: int = 1, scale: float = 0.05):
    """variables, unboxed, with scale times a normal draw (from key) added to every leaf."""
    leaves, tree = jax.tree.flatten(nn.meta.unbox(variables))
    keys = jax.random.split(jax.random.key(key), len(leaves))
    return jax.tree.unflatten(tree, [leaf + scale * jax.random.normal(k, leaf.shape)
                                     for leaf, k in zip(leaves, keys, strict=True)])


def perturbed_init(model: nn.Module):
    """model's variables (initialized with key 0 on a [1, 4] token batch), perturbed."""
    return perturbed(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
