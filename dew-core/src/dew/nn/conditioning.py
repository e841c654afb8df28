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
    frequencies_n = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    angles_bn = (scale * values.astype(jnp.float32))[:, None] * frequencies_n[None]
    out_bn = jnp.concatenate([jnp.cos(angles_bn), jnp.sin(angles_bn)], axis=-1)
    return jnp.pad(out_bn, ((0, 0), (0, features - 2 * half)))  # an odd width ends in a zero


class Dense(nn.Module):
    """x [..., N] @ kernel + bias -> [..., features] with named axes.

    Zero init makes a block start as the identity. The leading axes are any
    (batch, tokens, image rows and columns), so the names below say only the
    last one: n for x's width, m for ``features``.
    """

    features: int
    in_axis: str | None = axes.EMBED
    out_axis: str | None = axes.MLP
    zero: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.zero else nn.initializers.lecun_normal()
        kernel_nm = param(self, "kernel", init, (x.shape[-1], self.features),
                          (self.in_axis, self.out_axis), self.param_dtype)
        bias_m = param(self, "bias", nn.initializers.zeros, (self.features,), (self.out_axis,),
                       self.param_dtype)
        y_m = jnp.dot(x.astype(self.dtype), kernel_nm.astype(self.dtype))  # [..., M]
        return y_m + jax.lax.broadcast_to_rank(bias_m.astype(self.dtype), y_m.ndim)


class NoiseEmbedding(nn.Module):
    """A noise level [B] as a vector [B, features]: sinusoidal features through an MLP."""

    features: int
    frequencies: int = 256

    @nn.compact
    def __call__(self, level: jax.Array) -> jax.Array:
        level_b = jnp.reshape(level, (-1,))
        h_bn = sinusoidal(level_b, self.frequencies)
        h_bd = nn.silu(Dense(self.features, None, axes.EMBED, name="fc1")(h_bn))
        return Dense(self.features, axes.EMBED, axes.MLP, name="fc2")(h_bd)


class LabelEmbedding(nn.Module):
    """Class labels [B] in [0, num_classes] as vectors; label num_classes is the null condition."""

    num_classes: int
    features: int

    @nn.compact
    def __call__(self, labels: jax.Array) -> jax.Array:
        # n: the classes and the null condition
        table_nd = param(self, "embedding", nn.initializers.normal(0.02),
                         (self.num_classes + 1, self.features), (None, axes.EMBED))
        labels_b = labels.astype(jnp.int32)
        return jnp.take(table_nd, labels_b, axis=0)


class TextEncoder(nn.Module):
    """Token ids [B, T] (id vocab_size is the null token) to a vector [B, features].

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

        ids_bt = tokens.astype(jnp.int32)
        # v: the vocabulary and the null token; t: the positions up to max_length
        table_vd = param(self, "embedding", nn.initializers.normal(0.02),
                         (self.vocab_size + 1, self.features), (axes.VOCAB, axes.EMBED))
        position_td = param(self, "position", nn.initializers.normal(0.02),
                            (self.max_length, self.features), (None, axes.EMBED))
        x_btd = jnp.take(table_vd, ids_bt, axis=0) + position_td[None, : ids_bt.shape[1]]
        for i in range(self.num_layers):
            h_btd = nn.LayerNorm(use_scale=False, use_bias=False, name=f"norm_{i}")(x_btd)
            x_btd = x_btd + Attention(self.num_heads, name=f"attention_{i}")(h_btd)
            h_btd = nn.LayerNorm(use_scale=False, use_bias=False, name=f"mlp_norm_{i}")(x_btd)
            h_btm = nn.gelu(Dense(4 * self.features, name=f"mlp_in_{i}")(h_btd))
            x_btd = x_btd + Dense(self.features, axes.MLP, axes.EMBED, name=f"mlp_out_{i}")(h_btm)
        return jnp.mean(x_btd, axis=1)  # [B, D]
