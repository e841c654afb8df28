"""What a denoising network reads besides its input: the noise level and a condition.

``NoiseEmbedding`` turns a noise level per example into a vector
(sinusoidal features, then a small MLP). ``LabelEmbedding`` maps class
labels, with one extra row for the null condition that classifier-free
guidance trains and samples with. ``TextEncoder`` is a small bidirectional
transformer over token ids whose mean over positions is the condition
vector. Every parameter carries logical axis names.

>>> import jax, jax.numpy as jnp
>>> embed = LabelEmbedding(num_classes=3, features=8)
>>> variables = embed.init(jax.random.key(0), jnp.asarray([0, 3]))
>>> embed.apply(variables, jnp.asarray([0, 3])).shape
(2, 8)
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import sharding as axes
from dew.nn.sharding import param

__all__ = ["Dense", "LabelEmbedding", "NoiseEmbedding", "TextEncoder", "sinusoidal"]


def sinusoidal(values: jax.Array, features: int, scale: float = 1000.0,
               max_period: float = 10_000.0) -> jax.Array:
    """Sine and cosine features [B, features] of values [B] * scale at geometric frequencies."""
    half = features // 2
    frequencies = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = (scale * values.astype(jnp.float32))[:, None] * frequencies[None]
    out = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    return jnp.pad(out, ((0, 0), (0, features - 2 * half)))


class Dense(nn.Module):
    """x @ kernel + bias with named axes; zero init makes a block start as the identity."""

    features: int
    in_axis: str | None = axes.EMBED
    out_axis: str | None = axes.MLP
    zero: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.zero else nn.initializers.lecun_normal()
        kernel = param(self, "kernel", init, (x.shape[-1], self.features),
                       (self.in_axis, self.out_axis), self.param_dtype)
        bias = param(self, "bias", nn.initializers.zeros, (self.features,), (self.out_axis,),
                     self.param_dtype)
        y = jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))
        return y + jax.lax.broadcast_to_rank(bias.astype(self.dtype), y.ndim)


class NoiseEmbedding(nn.Module):
    """A noise level [B] as a vector [B, features]: sinusoidal features through an MLP."""

    features: int
    frequencies: int = 256

    @nn.compact
    def __call__(self, level: jax.Array) -> jax.Array:
        h = sinusoidal(jnp.reshape(level, (-1,)), self.frequencies)
        h = nn.silu(Dense(self.features, None, axes.EMBED, name="fc1")(h))
        return Dense(self.features, axes.EMBED, None, name="fc2")(h)


class LabelEmbedding(nn.Module):
    """Class labels [B] in [0, num_classes] as vectors; label num_classes is the null condition."""

    num_classes: int
    features: int

    @nn.compact
    def __call__(self, labels: jax.Array) -> jax.Array:
        table = param(self, "embedding", nn.initializers.normal(0.02),
                      (self.num_classes + 1, self.features), (None, axes.EMBED))
        return jnp.take(table, labels.astype(jnp.int32), axis=0)


class TextEncoder(nn.Module):
    """Token ids [B, L] (id vocab_size is the null token) to a vector [B, features].

    Embedding, learned positions, num_layers pre-norm bidirectional
    attention/MLP layers, then the mean over positions.
    """

    vocab_size: int
    max_length: int
    features: int
    num_layers: int = 1
    num_heads: int = 2

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        from dew.nn.dit import Attention  # the attention of dew's denoisers

        table = param(self, "embedding", nn.initializers.normal(0.02),
                      (self.vocab_size + 1, self.features), (axes.VOCAB, axes.EMBED))
        position = param(self, "position", nn.initializers.normal(0.02),
                         (self.max_length, self.features), (None, axes.EMBED))
        x = jnp.take(table, tokens.astype(jnp.int32), axis=0) + position[None, : tokens.shape[1]]
        for i in range(self.num_layers):
            h = nn.LayerNorm(use_scale=False, use_bias=False, name=f"norm_{i}")(x)
            x = x + Attention(self.num_heads, name=f"attention_{i}")(h)
            h = nn.LayerNorm(use_scale=False, use_bias=False, name=f"mlp_norm_{i}")(x)
            h = nn.gelu(Dense(4 * self.features, name=f"mlp_in_{i}")(h))
            x = x + Dense(self.features, axes.MLP, axes.EMBED, name=f"mlp_out_{i}")(h)
        return jnp.mean(x, axis=1)
