"""Transformer layers whose parameters carry logical axis names.

Every parameter is declared through :func:`dew.nn.sharding.param`, so the
trainer can shard it by name. Activations are constrained by their logical
names at the block boundaries. Computation runs in ``dtype``; parameters are
stored in ``param_dtype``; softmax and normalization statistics run in float32.

The options published decoders differ in are fields of these layers, each
computing exactly what that architecture computes: RMSNorm's ``1 +`` offset
(Gemma), norms of the queries and keys per head (Qwen 3, Gemma 3) or over the
whole projection (OLMo 2), biases on the projections (Qwen 2) and on the
feed-forward block, partial and rescaled rotary positions (dew.nn.rotary),
sliding windows, soft-capped attention scores and the query scale (Gemma 2),
a GELU-gated feed-forward block (Gemma), and where the norms sit around each
block (DecoderLayer.norm_placement).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.errors import DewError
from dew.nn import paged_attention as paged
from dew.nn import sharding as axes
from dew.nn.experts import Routing
from dew.nn.latent_attention import Latent, LatentAttention
from dew.nn.moe import MoEBlock
from dew.nn.ring_attention import RingAttentionError, ring_attention
from dew.nn.rotary import RopeScaling, attention_scaling, frequencies, inverse_frequencies, rotate
from dew.nn.sharding import constrain, param

__all__ = [
    "ATTENTION_BLOCKS",
    "ATTENTION_KINDS",
    "MLP_ACTIVATIONS",
    "MLP_BLOCKS",
    "NORM_PLACEMENTS",
    "QK_NORMS",
    "CausalSelfAttention",
    "DecoderLayer",
    "Embed",
    "FieldProblems",
    "MLPBlock",
    "RMSNorm",
    "FusedAttentionError",
    "apply_rotary",
    "attention_mask",
    "built_problems",
    "check_fused_attention",
    "heads_problems",
]

Dtype = Any


class FusedAttentionError(DewError, ValueError):
    """attention='cudnn' asked for where cuDNN's fused kernel does not run (a sequence split, no GPU)."""


FieldProblems = list[tuple[tuple[str, ...], str]]  # (a recipe field's path, what is wrong with it): ChecksFields'


def built_problems(cls: type, fields: Mapping[str, Any], check: Callable[[Any], FieldProblems]) -> FieldProblems:
    """What check finds in the model cls builds from a recipe's fields, or the error building it raised: the
    body of a model's field_problems (dew.registry.ChecksFields)."""
    try:
        model = cls(**dict(fields))
    except (ValueError, TypeError) as error:
        return [((), str(error))]
    return check(model)


def heads_problems(emb_features: int, num_heads: int) -> FieldProblems:
    """The recipe field to change when num_heads does not split emb_features into whole heads, for a
    model's field_problems (dew.registry.ChecksFields): said by dew train --check, not at the first trace."""
    if num_heads < 1 or emb_features % num_heads:
        return [(("num_heads",), f"emb_features={emb_features} is not divisible by num_heads={num_heads}: each "
                                 "head takes an equal share of the width; change one of them.")]
    return []


def check_fused_attention(split: tuple[str, ...], backend: str) -> None:
    """Refuse attention='cudnn' where cuDNN's fused kernel cannot run: positions split over the mesh
    axes split, or a backend other than an (NVIDIA) GPU."""
    if split:
        raise FusedAttentionError(
            f"attention='cudnn' cannot run with the sequence split over mesh axes {split}: cuDNN's fused "
            "kernel takes whole sequences. Use attention='ring' (keys and values passed around the sequence "
            "axis) or 'xla', or keep MeshSpec.sequence at 1.")
    if backend != "gpu":
        raise FusedAttentionError(
            f"attention='cudnn' runs cuDNN's fused kernel, on an NVIDIA GPU only, and this process computes "
            f"on {backend}: use attention='xla' here (the same weights and function).")

# How CausalSelfAttention computes softmax(q k^T) v outside decoding: "einsum"
# spells it out (the default), "xla" and "cudnn" hand it to
# jax.nn.dot_product_attention with that implementation (cudnn: fused flash
# attention on NVIDIA GPUs, bf16/fp16 only, and not under a sequence split:
# its partitioner takes queries, keys and values sharded alike and no split
# along the sequence). "einsum" and "xla" gather every key and value onto each
# device of the sequence axis; "ring" passes them around it instead,
# blockwise and load-balanced (dew.nn.ring_attention). A model with soft-capped
# scores computes them with "einsum" whichever fused kind it names.
ATTENTION_KINDS = ("einsum", "xla", "cudnn", "ring")

# Where a decoder layer's norms sit: "pre" x + f(norm(x)) (Llama), "sandwich"
# x + norm(f(norm(x))) (Gemma 2 and 3), "post" x + norm(f(x)) (OLMo 2).
NORM_PLACEMENTS = ("pre", "sandwich", "post")
# Norms of queries and keys before the rotation: none, one per head over its
# width (Qwen 3, Gemma 3), or one over the whole projection (OLMo 2).
QK_NORMS = ("none", "head", "projection")
# The feed-forward block's nonlinearity: GELU (two matrices), or a gate of
# SiLU (SwiGLU) or tanh-approximated GELU (GeGLU) over a third matrix.
MLP_ACTIVATIONS = ("gelu", "swiglu", "geglu")
# The attention and feed-forward blocks a decoder layer is built of: the place
# where another kind of block (latent attention, routed experts) plugs in.
ATTENTION_BLOCKS = ("grouped_query", "latent")
MLP_BLOCKS = ("dense", "routed")


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned per-feature scale.

    It normalizes over the last ``len(scale_axes)`` dimensions (one by
    default; two, heads and width, for OLMo 2's norm over a whole query
    projection), whose scale carries those logical names. With offset the
    stored weight w is an offset from one, and the scale is ``1 + w``
    (Gemma's convention, its weights starting at zero).
    """

    epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    offset: bool = False
    scale_axes: tuple[str | None, ...] = (axes.EMBED,)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        count = len(self.scale_axes)
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = param(self, "scale", init, x.shape[-count:], self.scale_axes, self.param_dtype)
        x32 = x.astype(jnp.float32)
        over = tuple(range(-count, 0))
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=over, keepdims=True) + self.epsilon)
        scale32 = scale.astype(jnp.float32)
        if self.offset:
            scale32 = 1.0 + scale32
        return (normed * jax.lax.broadcast_to_rank(scale32, normed.ndim)).astype(self.dtype)


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
    return rotate(x, positions, inverse_frequencies(x.shape[-1], base))


def attention_mask(query_positions: jax.Array, key_positions: jax.Array,
                   window: int | None = None) -> jax.Array:
    """Which keys each query sees, [B, 1, 1, T, S]: keys at or before it, within window if set.

    Positions are [B, T] and [B, S] (or [1, ...]); with a window w a query
    at t sees keys s with ``t - w < s <= t``, the sliding window of Mistral,
    Qwen 2 and Gemma 2 and 3.
    """
    query = query_positions[:, None, None, :, None]
    key = key_positions[:, None, None, None, :]
    mask = key <= query
    if window is not None:
        mask = mask & (query - key < window)
    return mask


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
    max_len, not by how long the prompt was. The cache is read and written in
    one method (``_update_cache``), which returns the keys, the values and
    the position each cached key holds, so another cache can replace it.

    The options of published architectures: qkv_bias and out_bias add biases
    to the projections; qk_norm normalizes queries and keys before the
    rotation (per head, or over the whole projection); rope_scaling and
    rotary_fraction pick the rotary frequencies (dew.nn.rotary); window
    limits each query to the window keys before it; softcap bounds the
    scores by ``softcap * tanh(scores / softcap)``; query_pre_attn_scalar
    replaces the head width in the ``1/sqrt`` score scale. The norms use
    norm_epsilon and, with norm_offset, Gemma's ``1 + w`` scale.
    """

    num_heads: int
    head_features: int
    max_len: int
    rotary: bool = False
    num_kv_heads: int | None = None
    rope_base: float = 10_000.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: Literal["einsum", "xla", "cudnn", "ring"] = "einsum"
    rope_scaling: RopeScaling | None = None
    rotary_fraction: float = 1.0
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: Literal["none", "head", "projection"] = "none"
    norm_epsilon: float = 1e-6
    norm_offset: bool = False
    window: int | None = None
    softcap: float | None = None
    query_pre_attn_scalar: float | None = None

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
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"Unknown qk_norm {self.qk_norm!r}; use one of "
                             f"{', '.join(map(repr, QK_NORMS))}.")
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
            out_bthk = jnp.einsum("btd,dhk->bthk", x, kernel_dhk.astype(self.dtype))
            if self.qkv_bias:
                bias_hk = param(self, f"{name}_bias", nn.initializers.zeros, (count, width),
                                (axes.HEADS, axes.KV), self.param_dtype)
                out_bthk = out_bthk + bias_hk.astype(self.dtype)[None, None]
            return out_bthk

        q_bthk, k_bshk, v_bshk = project("query", heads), project("key", kv_heads), project("value", kv_heads)
        if self.qk_norm != "none":
            scaled = (axes.KV,) if self.qk_norm == "head" else (axes.HEADS, axes.KV)
            norm = {"epsilon": self.norm_epsilon, "offset": self.norm_offset, "scale_axes": scaled,
                    "dtype": self.dtype, "param_dtype": self.param_dtype}
            q_bthk = RMSNorm(name="query_norm", **norm)(q_bthk)
            k_bshk = RMSNorm(name="key_norm", **norm)(k_bshk)
        head_axes = (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_HEADS, None)
        q_bthk, k_bshk, v_bshk = (constrain(t, head_axes) for t in (q_bthk, k_bshk, v_bshk))
        if self.rotary:
            inverse = frequencies(width, self.rope_base, self.rope_scaling, self.rotary_fraction, positions)
            scale = attention_scaling(self.rope_scaling)
            q_bthk = rotate(q_bthk, positions, inverse, scale)
            k_bshk = rotate(k_bshk, positions, inverse, scale)

        # Queries keep their share of the positions; every device sees all keys and values
        # (an all-gather over the sequence axis), so attention is exact under a sequence split.
        # "ring" instead passes the keys and values around the sequence axis (not when decoding).
        ring = self.attention == "ring" and not decode
        if ring and self.softcap is not None:
            raise RingAttentionError("attention='ring' folds raw scores blockwise and cannot soft-cap "
                                     "them; use attention='einsum' for a model with softcap.")
        if self.attention == "cudnn" and not decode:
            check_fused_attention(axes.split_over(axes.ACTIVATION_LENGTH)[0], jax.default_backend())
        whole = (axes.BATCH, None, axes.ACTIVATION_HEADS, None)
        if not ring:
            k_bshk, v_bshk = constrain(k_bshk, whole), constrain(v_bshk, whole)
        if decode:  # keys and values come from the cache (paged blocks, or max_len slots)
            if paged.current_view() is not None:
                k_bshk, v_bshk, key_positions = paged.update(self, k_bshk, v_bshk, positions)
            else:
                k_bshk, v_bshk, key_positions = self._update_cache(k_bshk, v_bshk, positions)
            mask = attention_mask(positions, key_positions, self.window)
        elif not ring:  # positions along the row, whatever the rotary positions were
            order = jnp.arange(length, dtype=jnp.int32)[None, :]
            mask = attention_mask(order, order, self.window)
            if segment_ids is not None:  # packed documents: a query sees its own document only
                mask = mask & (segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :])

        if ring:
            score_scale = (None if self.query_pre_attn_scalar is None
                           else float(self.query_pre_attn_scalar) ** -0.5)
            out_bthk = ring_attention(q_bthk, k_bshk, v_bshk, segment_ids, scale=score_scale,
                                      window=self.window).astype(self.dtype)
        elif decode or self.attention in ("einsum", "ring") or self.softcap is not None:
            # Query heads in groups of n per key/value head (g groups): [B, T, G, N, K].
            share = heads // kv_heads
            q_btgnk = q_bthk.reshape(batch, length, kv_heads, share, width)
            scores_bgnts = jnp.einsum("btgnk,bsgk->bgnts", q_btgnk, k_bshk).astype(jnp.float32)
            if self.query_pre_attn_scalar is None:
                scores_bgnts = scores_bgnts / math.sqrt(width)
            else:
                scores_bgnts = scores_bgnts * float(self.query_pre_attn_scalar) ** -0.5
            if self.softcap is not None:
                scores_bgnts = jnp.tanh(scores_bgnts / self.softcap) * self.softcap
            scores_bgnts = jnp.where(mask, scores_bgnts, jnp.finfo(jnp.float32).min)
            weights_bgnts = jax.nn.softmax(scores_bgnts, axis=-1).astype(self.dtype)
            out_btgnk = jnp.einsum("bgnts,bsgk->btgnk", weights_bgnts, v_bshk)
            out_bthk = out_btgnk.reshape(batch, length, heads, width)
        else:  # grouped key/value heads are read the same way: head h uses h // share
            documents = None if segment_ids is None else (
                segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
            score_scale = (None if self.query_pre_attn_scalar is None
                           else float(self.query_pre_attn_scalar) ** -0.5)
            local = None if self.window is None else (self.window - 1, 0)
            out_bthk = jax.nn.dot_product_attention(q_bthk, k_bshk, v_bshk, mask=documents, scale=score_scale,
                                                    is_causal=True, local_window_size=local,
                                                    implementation="cudnn" if self.attention == "cudnn" else "xla")
        out_bthk = constrain(out_bthk, head_axes)

        out_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=(0, 1), out_axis=2)
        out_kernel_hkd = param(self, "out", out_init, (heads, width, features),
                               (axes.HEADS, axes.KV, axes.EMBED), self.param_dtype)
        # "a" stands for the head width here: einsum sums the contracted axes in the order of
        # their letters, and heads-then-width ("hk") would change the result in the last bits.
        out_btd = jnp.einsum("btha,had->btd", out_bthk, out_kernel_hkd.astype(self.dtype))
        if self.out_bias:
            bias_d = param(self, "out_bias", nn.initializers.zeros, (features,), (axes.EMBED,),
                           self.param_dtype)
            out_btd = out_btd + bias_d.astype(self.dtype)[None, None]
        return out_btd

    def _update_cache(
        self, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Write k and v [B, T, kv_heads, kv] at positions [B, T]; return every cached key and
        value [B, S, kv_heads, kv] with the position each slot holds [B or 1, S]."""
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
        slots = jnp.arange(self.max_len, dtype=jnp.int32)[None, :]
        return cached_key.value, cached_value.value, slots


class MLPBlock(nn.Module):
    """A feed-forward block: GELU (two matrices), SwiGLU or GeGLU (three).

    The gated kinds compute ``act(x W_gate) * (x W_in)`` with SiLU (swiglu)
    or tanh-approximated GELU (geglu, Gemma's ``gelu_pytorch_tanh``). With
    bias every matrix has one (Llama's ``mlp_bias``).
    """

    hidden_features: int
    activation: Literal["gelu", "swiglu", "geglu"] = "gelu"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.activation not in MLP_ACTIVATIONS:
            raise ValueError(f"Unknown MLP activation {self.activation!r}; use one of "
                             f"{', '.join(map(repr, MLP_ACTIVATIONS))}.")
        features = x.shape[-1]
        init = nn.initializers.lecun_normal()

        def linear(name: str, h: jax.Array, shape: tuple[int, int], names: tuple[str, str],
                   spec: str) -> jax.Array:
            kernel = param(self, name, init, shape, names, self.param_dtype).astype(self.dtype)
            out = jnp.einsum(spec, h, kernel)
            if self.bias:
                bias = param(self, f"{name}_bias", nn.initializers.zeros, shape[1:], names[1:],
                             self.param_dtype)
                out = out + jax.lax.broadcast_to_rank(bias.astype(self.dtype), out.ndim)
            return out

        up = (features, self.hidden_features)
        h_btm = linear("wi", x, up, (axes.EMBED, axes.MLP), "btd,dm->btm")
        if self.activation == "gelu":
            h_btm = nn.gelu(h_btm)
        else:
            gate_btm = linear("wi_gate", x, up, (axes.EMBED, axes.MLP), "btd,dm->btm")
            act = nn.silu if self.activation == "swiglu" else functools.partial(nn.gelu, approximate=True)
            h_btm = act(gate_btm) * h_btm
        h_btm = constrain(h_btm, (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_MLP))
        return linear("wo", h_btm, (self.hidden_features, features), (axes.MLP, axes.EMBED),
                      "btm,md->btd")


class DecoderLayer(nn.Module):
    """One decoder layer: attention, then a feed-forward block, each with a residual.

    norm_placement says where the RMSNorms sit: "pre" (Llama) computes
    x + attention(norm(x)), "sandwich" (Gemma 2, 3) x + norm(attention(norm(x))),
    "post" (OLMo 2) x + norm(attention(x)); the same around the feed-forward
    block. The norms before a block are named ``attention_norm`` and
    ``mlp_norm``, those after it ``attention_post_norm`` and ``mlp_post_norm``.

    With experts above 0 the feed-forward block is a MoEBlock (named "moe")
    of that many experts, experts_per_token of them per token, each with
    expert_capacity times its even share of a sequence's tokens.
    attention_block and mlp_block name the kind of each block: "latent" is
    DeepSeek's multi-head latent attention (dew.nn.latent_attention, shaped by
    latent), "routed" the routed experts of the published MoE families
    (dew.nn.experts.RoutedExperts under "moe", with routing's options).
    The other fields are those of CausalSelfAttention and MLPBlock.
    """

    num_heads: int
    head_features: int
    mlp_features: int
    max_len: int
    rotary: bool = False
    mlp_activation: Literal["gelu", "swiglu", "geglu"] = "gelu"
    num_kv_heads: int | None = None
    rope_base: float = 10_000.0
    norm_epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: Literal["einsum", "xla", "cudnn", "ring"] = "einsum"
    experts: int = 0
    experts_per_token: int = 2
    expert_capacity: float = 1.25
    norm_placement: Literal["pre", "sandwich", "post"] = "pre"
    norm_offset: bool = False
    qk_norm: Literal["none", "head", "projection"] = "none"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None
    rotary_fraction: float = 1.0
    window: int | None = None
    attention_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    attention_block: Literal["grouped_query", "latent"] = "grouped_query"
    mlp_block: Literal["dense", "routed"] = "dense"
    latent: Latent | None = None
    routing: Routing | None = None

    def _attention_block(self) -> nn.Module:
        """The attention block this layer's attention_block names."""
        if self.attention_block not in ATTENTION_BLOCKS:
            raise ValueError(f"Unknown attention_block {self.attention_block!r}; use one of "
                             f"{', '.join(map(repr, ATTENTION_BLOCKS))}.")
        if self.attention_block == "latent":
            if self.latent is None:
                raise ValueError("attention_block='latent' needs latent (a dew.nn.latent_attention.Latent "
                                 "with the latent ranks and head widths).")
            shape = self.latent
            return LatentAttention(
                self.num_heads, self.max_len, kv_lora_rank=shape.kv_lora_rank, q_lora_rank=shape.q_lora_rank,
                qk_nope_head_features=shape.qk_nope_head_features,
                qk_rope_head_features=shape.qk_rope_head_features, v_head_features=shape.v_head_features,
                rope_base=self.rope_base, rope_scaling=self.rope_scaling, rope_interleave=shape.interleave,
                attention_bias=self.qkv_bias, latent_norm_epsilon=shape.norm_epsilon, name="attention",
                dtype=self.dtype, param_dtype=self.param_dtype)
        return CausalSelfAttention(
            self.num_heads, self.head_features, self.max_len, rotary=self.rotary,
            num_kv_heads=self.num_kv_heads, rope_base=self.rope_base, attention=self.attention,
            rope_scaling=self.rope_scaling, rotary_fraction=self.rotary_fraction,
            qkv_bias=self.qkv_bias, out_bias=self.out_bias, qk_norm=self.qk_norm,
            norm_epsilon=self.norm_epsilon, norm_offset=self.norm_offset, window=self.window,
            softcap=self.attention_softcap, query_pre_attn_scalar=self.query_pre_attn_scalar,
            name="attention", dtype=self.dtype, param_dtype=self.param_dtype)

    def _mlp_block(self) -> nn.Module:
        """The feed-forward block: dense, routed experts, or dew's MoEBlock when experts > 0."""
        if self.mlp_block not in MLP_BLOCKS:
            raise ValueError(f"Unknown mlp_block {self.mlp_block!r}; use one of "
                             f"{', '.join(map(repr, MLP_BLOCKS))}.")
        kinds = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        if self.mlp_block == "routed":
            return (self.routing or Routing()).block(self.experts, self.mlp_features, self.experts_per_token,
                                                     self.expert_capacity, name="moe", **kinds)
        if self.experts:
            return MoEBlock(self.experts, self.mlp_features, self.experts_per_token,
                            self.expert_capacity, self.mlp_activation, name="moe", **kinds)
        return MLPBlock(self.mlp_features, self.mlp_activation, bias=self.mlp_bias, name="mlp", **kinds)

    def _norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.norm_epsilon, dtype=self.dtype, param_dtype=self.param_dtype,
                       offset=self.norm_offset, name=name)

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, *, decode: bool = False,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"Unknown norm_placement {self.norm_placement!r}; use one of "
                             f"{', '.join(map(repr, NORM_PLACEMENTS))}.")
        residual_axes = (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED)
        before = self.norm_placement in ("pre", "sandwich")
        after = self.norm_placement in ("sandwich", "post")
        attention = self._attention_block()
        h = self._norm("attention_norm")(x) if before else x
        h = attention(h, positions, decode=decode, segment_ids=segment_ids)
        x = x + (self._norm("attention_post_norm")(h) if after else h)
        x = constrain(x, residual_axes)
        mlp = self._mlp_block()
        h = self._norm("mlp_norm")(x) if before else x
        if isinstance(mlp, MLPBlock):
            h = mlp(h)
        else:  # experts leave padding (segment id 0 of packed rows) out of their statistics
            h = mlp(h, None if segment_ids is None else segment_ids != 0)
        x = x + (self._norm("mlp_post_norm")(h) if after else h)
        return constrain(x, residual_axes)
