"""Transformer layers whose parameters carry logical axis names.

Every parameter is declared through :func:`dew.nn.sharding.param`, so the
trainer can shard it by name. Activations are constrained by their logical
names at the block boundaries. Computation runs in ``dtype``; parameters are
stored in ``param_dtype``; softmax and normalization statistics run in float32.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import paged_attention as paged
from dew.nn import sharding as axes
from dew.nn.moe import MoEBlock
from dew.nn.sharding import constrain, param

__all__ = [
    "ATTENTION_KINDS",
    "MLPBlock",
    "CausalSelfAttention",
    "DecoderLayer",
    "Embed",
    "RMSNorm",
    "apply_rotary",
]

Dtype = Any

# How CausalSelfAttention computes softmax(q k^T) v outside decoding: "einsum"
# spells it out (the default), "xla" and "cudnn" hand it to
# jax.nn.dot_product_attention with that implementation (cudnn: fused flash
# attention on NVIDIA GPUs, bf16/fp16 only).
ATTENTION_KINDS = ("einsum", "xla", "cudnn")


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned per-feature scale."""

    epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = param(self, "scale", nn.initializers.ones, (x.shape[-1],), (axes.EMBED,),
                      self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        scale_e = jax.lax.broadcast_to_rank(scale.astype(jnp.float32), normed.ndim)
        return (normed * scale_e).astype(self.dtype)


class Embed(nn.Module):
    """A token embedding table [vocab, embed], usable as the output head too."""

    num_embeddings: int
    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    stddev: float = 0.02

    def setup(self) -> None:
        self.embedding = param(
            self, "embedding", nn.initializers.normal(self.stddev),
            (self.num_embeddings, self.features), (axes.VOCAB, axes.EMBED), self.param_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding.astype(self.dtype), ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits of x against every row of the table (a tied output head)."""
        return jnp.einsum("...e,ve->...v", x, self.embedding.astype(self.dtype))


def apply_rotary(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotate pairs of features of x [B, T, H, D] by angles set by positions [B, T]."""
    half = x.shape[-1] // 2
    frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, :, None, None] * frequencies[None, None, None, :]  # [B, T, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x32 = x.astype(jnp.float32)
    first, second = x32[..., :half], x32[..., half : 2 * half]
    rotated = jnp.concatenate(
        [first * cos - second * sin, second * cos + first * sin, x32[..., 2 * half :]], axis=-1
    )
    return rotated.astype(x.dtype)


class CausalSelfAttention(nn.Module):
    """Causal self-attention with grouped key/value heads and an optional key/value cache.

    num_kv_heads key/value heads serve num_heads query heads (None: one each);
    query head h reads key/value head ``h // (num_heads // num_kv_heads)``, the
    grouping Hugging Face's Llama uses, so its checkpoints map head for head.

    Without decode, position t attends to positions 0..t of the same call.
    segment_ids [B, T], when given, number the documents packed into each
    row: a position then attends only within its own document.
    With decode, keys and values are written into the 'cache' collection
    (``cached_key`` and ``cached_value`` of shape [B, max_len, kv_heads, kv])
    at each row's ``positions``, and every query attends to the cached slots
    at or before its own position. The work per new token is then fixed by
    max_len, not by how long the prompt was.
    """

    num_heads: int
    head_features: int
    max_len: int
    rotary: bool = False
    num_kv_heads: int | None = None
    rope_base: float = 10_000.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: Literal["einsum", "xla", "cudnn"] = "einsum"

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or one per query head."""
        return self.num_kv_heads or self.num_heads

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, *, decode: bool = False,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"Unknown attention {self.attention!r}; use one of "
                             f"{', '.join(map(repr, ATTENTION_KINDS))}.")
        batch, length, features = x.shape
        heads, kv_heads, width = self.num_heads, self.kv_heads, self.head_features
        if heads % kv_heads:
            raise ValueError(f"num_heads={heads} is not a multiple of num_kv_heads={kv_heads}; "
                             "each key/value head must serve the same number of query heads.")
        qkv_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=0, out_axis=(1, 2))

        def project(name: str, count: int) -> jax.Array:
            kernel_dhk = param(self, name, qkv_init, (features, count, width),
                               (axes.EMBED, axes.HEADS, axes.KV), self.param_dtype)
            return jnp.einsum("btd,dhk->bthk", x, kernel_dhk.astype(self.dtype))

        q_bthk, k_bshk, v_bshk = project("query", heads), project("key", kv_heads), project("value", kv_heads)
        head_axes = (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_HEADS, None)
        q_bthk, k_bshk, v_bshk = (constrain(t, head_axes) for t in (q_bthk, k_bshk, v_bshk))
        if self.rotary:
            q_bthk = apply_rotary(q_bthk, positions, self.rope_base)
            k_bshk = apply_rotary(k_bshk, positions, self.rope_base)

        # Queries keep their share of the positions; every device sees all keys and values
        # (an all-gather over the sequence axis), so attention is exact under a sequence split.
        whole = (axes.BATCH, None, axes.ACTIVATION_HEADS, None)
        k_bshk, v_bshk = constrain(k_bshk, whole), constrain(v_bshk, whole)
        if decode and paged.current_view() is not None:  # a paged cache: s runs over the row's blocks
            k_bshk, v_bshk, mask = paged.update(self, k_bshk, v_bshk, positions)
        elif decode:  # keys and values come from the cache: s runs over its max_len slots
            k_bshk, v_bshk, mask = self._update_cache(k_bshk, v_bshk, positions)
        else:
            mask = jnp.tril(jnp.ones((length, length), bool))[None, None, None]
            if segment_ids is not None:  # packed documents: a query sees its own document only
                mask = mask & (segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :])

        if decode or self.attention == "einsum":
            # Query heads in groups of n per key/value head (g groups): [B, T, G, N, K].
            share = heads // kv_heads
            q_btgnk = q_bthk.reshape(batch, length, kv_heads, share, width)
            scores_bgnts = jnp.einsum("btgnk,bsgk->bgnts", q_btgnk, k_bshk).astype(jnp.float32)
            scores_bgnts = jnp.where(mask, scores_bgnts / math.sqrt(width), jnp.finfo(jnp.float32).min)
            weights_bgnts = jax.nn.softmax(scores_bgnts, axis=-1).astype(self.dtype)
            out_btgnk = jnp.einsum("bgnts,bsgk->btgnk", weights_bgnts, v_bshk)
            out_bthk = out_btgnk.reshape(batch, length, heads, width)
        else:  # grouped key/value heads are read the same way: head h uses h // share
            documents = None if segment_ids is None else (
                segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
            out_bthk = jax.nn.dot_product_attention(q_bthk, k_bshk, v_bshk, mask=documents,
                                                    is_causal=True, implementation=self.attention)
        out_bthk = constrain(out_bthk, head_axes)

        out_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=(0, 1), out_axis=2)
        out_kernel_hkd = param(self, "out", out_init, (heads, width, features),
                               (axes.HEADS, axes.KV, axes.EMBED), self.param_dtype)
        # "a" stands for the head width here: einsum sums the contracted axes in the order of
        # their letters, and heads-then-width ("hk") would change the result in the last bits.
        return jnp.einsum("btha,had->btd", out_bthk, out_kernel_hkd.astype(self.dtype))

    def _update_cache(
        self, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        batch = k.shape[0]
        shape = (batch, self.max_len, self.kv_heads, self.head_features)
        cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, self.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, self.dtype)
        if cached_key.value.shape[0] != batch:
            raise ValueError(
                f"The decode cache holds {cached_key.value.shape[0]} rows but this call has "
                f"{batch}; start a new cache (apply without a 'cache' collection) for a "
                "batch of another size."
            )
        rows = jnp.arange(batch)[:, None]
        cached_key.value = cached_key.value.at[rows, positions].set(k.astype(self.dtype),
                                                                   mode="drop")
        cached_value.value = cached_value.value.at[rows, positions].set(v.astype(self.dtype),
                                                                       mode="drop")
        slots = jnp.arange(self.max_len)
        mask = (slots[None, None, :] <= positions[:, :, None])[:, None, None]  # [B, 1, 1, T, S]
        return cached_key.value, cached_value.value, mask


class MLPBlock(nn.Module):
    """A feed-forward block: GELU (two matrices) or SwiGLU (three)."""

    hidden_features: int
    activation: Literal["gelu", "swiglu"] = "gelu"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        init = nn.initializers.lecun_normal()

        def kernel(name: str, shape: tuple[int, int], names: tuple[str, str]) -> jax.Array:
            return param(self, name, init, shape, names, self.param_dtype).astype(self.dtype)

        up = (features, self.hidden_features)
        h_btm = jnp.einsum("btd,dm->btm", x, kernel("wi", up, (axes.EMBED, axes.MLP)))
        if self.activation == "swiglu":
            gate_btm = jnp.einsum("btd,dm->btm", x, kernel("wi_gate", up, (axes.EMBED, axes.MLP)))
            h_btm = nn.silu(gate_btm) * h_btm
        elif self.activation == "gelu":
            h_btm = nn.gelu(h_btm)
        else:
            raise ValueError(f"Unknown MLP activation {self.activation!r}; use 'gelu' or 'swiglu'.")
        h_btm = constrain(h_btm, (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_MLP))
        down_md = kernel("wo", (self.hidden_features, features), (axes.MLP, axes.EMBED))
        return jnp.einsum("btm,md->btd", h_btm, down_md)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: x + attention(norm(x)), then x + mlp(norm(x)).

    With experts above 0 the feed-forward block is a MoEBlock (named "moe")
    of that many experts, experts_per_token of them per token, each with
    expert_capacity times its even share of a sequence's tokens.
    """

    num_heads: int
    head_features: int
    mlp_features: int
    max_len: int
    rotary: bool = False
    mlp_activation: Literal["gelu", "swiglu"] = "gelu"
    num_kv_heads: int | None = None
    rope_base: float = 10_000.0
    norm_epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: Literal["einsum", "xla", "cudnn"] = "einsum"
    experts: int = 0
    experts_per_token: int = 2
    expert_capacity: float = 1.25

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, *, decode: bool = False,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        kinds = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        residual_axes = (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED)
        attention = CausalSelfAttention(self.num_heads, self.head_features, self.max_len,
                                        rotary=self.rotary, num_kv_heads=self.num_kv_heads,
                                        rope_base=self.rope_base, attention=self.attention,
                                        name="attention", **kinds)
        norm = {"epsilon": self.norm_epsilon, **kinds}
        x = x + attention(RMSNorm(name="attention_norm", **norm)(x), positions, decode=decode,
                          segment_ids=segment_ids)
        x = constrain(x, residual_axes)
        mlp: nn.Module
        if self.experts:
            mlp = MoEBlock(self.experts, self.mlp_features, self.experts_per_token,
                           self.expert_capacity, self.mlp_activation, name="moe", **kinds)
        else:
            mlp = MLPBlock(self.mlp_features, self.mlp_activation, name="mlp", **kinds)
        x = x + mlp(RMSNorm(name="mlp_norm", **norm)(x))
        return constrain(x, residual_axes)
