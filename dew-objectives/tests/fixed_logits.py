"""A policy whose parameters are its logits, for checking losses against their formulas.

``FixedLogits`` returns a parameter table [rows, length, vocab] whatever the
tokens, so a loss and its gradient with respect to the logits can be held
against a formula written by hand, without a network in between.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.base import Step


class FixedLogits(nn.Module):
    rows: int
    length: int
    vocab: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.param("logits", nn.initializers.normal(1.5), (self.rows, self.length, self.vocab))
        return table[: tokens.shape[0], : tokens.shape[1]]


def logits(seed: int, rows: int, length: int, vocab: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(scale=1.5, size=(rows, length, vocab)), jnp.float32)


def logp_by_hand(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(table)[next token], [B, T-1], written with a one-hot and a shifted log-sum-exp."""
    z = table[: tokens.shape[0], : tokens.shape[1] - 1]
    top = jax.lax.stop_gradient(z.max(-1, keepdims=True))
    log_z = jnp.log(jnp.sum(jnp.exp(z - top), -1)) + top[..., 0]
    return jnp.sum(z * jax.nn.one_hot(tokens[:, 1:], z.shape[-1]), -1) - log_z


def step() -> Step:
    zero = jnp.asarray(0)
    return Step(step=zero, microstep=zero, updates=zero, key=jax.random.key(0))


def assert_tree_close(got, expected, rtol: float = 1e-4) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-5 * float(np.abs(b).max()) + 1e-7)
