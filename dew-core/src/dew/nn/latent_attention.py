"""Multi-head latent attention (DeepSeek-V2/V3): keys and values read from a small shared latent.

Each position's keys and values come from one compressed vector: the input
is projected down to a latent of ``kv_lora_rank`` features (RMS-normalized)
and up again to every head's key and value, so a decode cache holds the
latent alone. Queries may be compressed the same way (``q_lora_rank``; None
projects them directly). Rotary positions cannot pass through the shared
up-projection, so they ride on a decoupled part: each query head has
``qk_rope_head_features`` more features that are rotated, and every head
shares one rotated key of that width, projected beside the latent. A head's
score is its ``qk_nope_head_features`` plain features against its key plus
the rotated parts against each other, times ``1/sqrt(nope + rope)`` (and
YaRN's mscale squared when the rotary frequencies are rescaled with an
``mscale_all_dim``; ``dew.nn.rotary`` computes the frequencies); the values
have ``v_head_features`` per head.

With ``rope_interleave`` (DeepSeek's checkpoints) the rotary features are
stored as interleaved pairs (x0, x1), (x2, x3), ...; otherwise as two halves.

The decode path caches the normalized latent and the rotated shared key
(``cached_latent`` [B, max_len, kv_lora_rank], ``cached_key_rope`` [B,
max_len, rope]) and attends in the latent space: the key's up-projection is
folded into the query and the value's into the output, so nothing of size
heads x max_len is built per token.

A paged decode (inside ``dew.nn.paged_attention.paged``, as the generation
engine runs it) caches the same two things, in the pools ``paged_latent``
[blocks, block_size, 1, kv_lora_rank] and ``paged_key_rope`` [blocks,
block_size, 1, rope]: one shared "head" each, as a single key/value head
would be, so the block tables, prefix sharing and copy-on-write work as for
grouped-query attention. This is what DeepSeek's own inference caches, and
the point of the latent: kv_lora_rank + rope numbers per token and layer
(576 in DeepSeek-V3) where the expanded keys and values would take
heads x (nope + rope + v) (40960), 71 times less. Attention then runs in
the absorbed form above; it equals the expanded form up to rounding.

>>> import jax, jax.numpy as jnp
>>> attention = LatentAttention(num_heads=2, max_len=8, kv_lora_rank=4, qk_nope_head_features=4,
...                             qk_rope_head_features=2, v_head_features=3)
>>> x, positions = jnp.ones((1, 5, 6)), jnp.arange(5)[None]
>>> variables = attention.init(jax.random.key(0), x, positions)
>>> attention.apply(variables, x, positions).shape, variables["params"]["kv_up"].value.shape
((1, 5, 6), (4, 2, 7))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import paged_attention as paged
from dew.nn import sharding as axes
from dew.nn.rotary import RopeScaling, attention_scaling, frequencies, rotate
from dew.nn.sharding import constrain, param

__all__ = ["Latent", "LatentAttention", "softmax_scale"]

Dtype = Any


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(head_features: int, scaling: RopeScaling | None) -> float:
    """DeepSeek's score scale: 1/sqrt(head width), times mscale(factor, mscale_all_dim) squared
    when the rotary frequencies are rescaled with an mscale_all_dim (as YaRN's are)."""
    scale = 1.0 / math.sqrt(head_features)
    if scaling is not None and scaling.mscale_all_dim:
        scale *= _mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


@dataclass(frozen=True)
class Latent:
    """The shapes of a decoder's latent attention (CausalTransformer.latent, DeepSeek's config).

    kv_lora_rank and q_lora_rank (None: queries projected directly) are the
    latent widths; a head's query and key have qk_nope_head_features plain
    and qk_rope_head_features rotated features, its value v_head_features;
    interleave says the rotary features are stored as interleaved pairs;
    norm_epsilon is the latent RMSNorms' (DeepSeek's are 1e-6 whatever
    ``rms_norm_eps`` says).
    """

    kv_lora_rank: int
    qk_nope_head_features: int
    qk_rope_head_features: int
    v_head_features: int
    q_lora_rank: int | None = None
    interleave: bool = True
    norm_epsilon: float = 1e-6


def _rotate(x: jax.Array, positions: jax.Array, inverse: np.ndarray | jax.Array, scale: float,
            interleaved: bool) -> jax.Array:
    """x [B, T, H, R] rotated by positions [B, T]; interleaved pairs come out as two halves."""
    if interleaved:  # (x0, x1), (x2, x3), ... as [x0, x2, ...] then [x1, x3, ...]: the same dot products
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return rotate(x, positions, inverse, scale)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention with a latent decode cache (see the module docstring).

    Takes and returns x [B, T, D] with positions [B, T], as CausalSelfAttention
    does (``decode``, ``segment_ids``). Parameters: ``query`` [D, H, nope+rope]
    (or ``query_down`` [D, q_lora_rank], ``query_norm``, ``query_up`` [q_lora_rank,
    H, nope+rope]), ``kv_down`` [D, kv_lora_rank + rope], ``kv_norm``, ``kv_up``
    [kv_lora_rank, H, nope + v], ``out`` [H, v, D]; with attention_bias, biases on
    the down-projections and on the output.
    """

    num_heads: int
    max_len: int
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_features: int = 128
    qk_rope_head_features: int = 64
    v_head_features: int = 128
    rope_base: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    latent_norm_epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @property
    def qk_head_features(self) -> int:
        """A query's (and a key's) width per head: plain and rotated features together."""
        return self.qk_nope_head_features + self.qk_rope_head_features


    def _kernel(self, name: str, shape: tuple[int, ...], names: tuple[str | None, ...],
                inputs: int = 1) -> jax.Array:
        """A weight whose first ``inputs`` dimensions are contracted with the input."""
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                in_axis=tuple(range(inputs)),
                                                out_axis=tuple(range(inputs, len(shape))))
        return param(self, name, init, shape, names, self.param_dtype).astype(self.dtype)

    def _biased(self, y: jax.Array, name: str, names: tuple[str | None, ...]) -> jax.Array:
        """y plus a learned bias over its last dimension when attention_bias is set."""
        if not self.attention_bias:
            return y
        bias = param(self, name, nn.initializers.zeros, (y.shape[-1],), names, self.param_dtype)
        return y + jax.lax.broadcast_to_rank(bias.astype(self.dtype), y.ndim)

    def _norm(self, name: str, x: jax.Array) -> jax.Array:
        scale = param(self, name, nn.initializers.ones, (x.shape[-1],), (None,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.latent_norm_epsilon)
        return (normed * jax.lax.broadcast_to_rank(scale.astype(jnp.float32), x.ndim)).astype(self.dtype)

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, *, decode: bool = False,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        batch, length, features = x.shape
        heads, nope, rope, value = (self.num_heads, self.qk_nope_head_features,
                                    self.qk_rope_head_features, self.v_head_features)
        x = x.astype(self.dtype)
        head_axes = (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_HEADS, None)
        if self.q_lora_rank is None:
            query_dhk = self._kernel("query", (features, heads, nope + rope), (axes.EMBED, axes.HEADS, axes.KV))
            q_bthk = jnp.einsum("btd,dhk->bthk", x, query_dhk)
        else:
            down_dr = self._kernel("query_down", (features, self.q_lora_rank), (axes.EMBED, None))
            latent_btr = self._biased(jnp.einsum("btd,dr->btr", x, down_dr), "query_down_bias", (None,))
            latent_btr = self._norm("query_norm", latent_btr)
            up_rhk = self._kernel("query_up", (self.q_lora_rank, heads, nope + rope), (None, axes.HEADS, axes.KV))
            q_bthk = jnp.einsum("btr,rhk->bthk", latent_btr, up_rhk)
        q_bthk = constrain(q_bthk, head_axes)

        kv_down_dr = self._kernel("kv_down", (features, self.kv_lora_rank + rope), (axes.EMBED, None))
        compressed_btr = self._biased(jnp.einsum("btd,dr->btr", x, kv_down_dr), "kv_down_bias", (None,))
        latent_btr = self._norm("kv_norm", compressed_btr[..., : self.kv_lora_rank])
        key_rope_btp = compressed_btr[..., self.kv_lora_rank:]

        inverse = frequencies(rope, self.rope_base, self.rope_scaling, 1.0, positions)
        scale = attention_scaling(self.rope_scaling)
        q_nope_bthn = q_bthk[..., :nope]
        q_rope_bthp = _rotate(q_bthk[..., nope:], positions, inverse, scale, self.rope_interleave)
        key_rope_btp = _rotate(key_rope_btp[:, :, None], positions, inverse, scale,
                               self.rope_interleave)[:, :, 0]
        kv_up_rhk = self._kernel("kv_up", (self.kv_lora_rank, heads, nope + value), (None, axes.HEADS, axes.KV))

        if decode:
            if self.has_variable("params", "kv_up_lora_a"):
                # LoRA adapts kv_up as the training path multiplies it: the absorbed products
                # below read slices of it, so read it whole first, the adapted weight being the
                # up-projection of the identity (its adapters' product added as in training).
                identity_1rr = jnp.eye(self.kv_lora_rank, dtype=self.dtype)[None]
                kv_up_rhk = jnp.einsum("bsr,rhk->bshk", identity_1rr, kv_up_rhk)[0]
            latent_bsr, key_rope_bsp, mask = self._update_cache(latent_btr, key_rope_btp, positions)
            # Absorbed: the key's up-projection folded into the query, the value's into the output.
            q_latent_bthr = jnp.einsum("bthn,rhn->bthr", q_nope_bthn, kv_up_rhk[..., :nope])
            scores_bhts = (jnp.einsum("bthr,bsr->bhts", q_latent_bthr, latent_bsr)
                           + jnp.einsum("bthp,bsp->bhts", q_rope_bthp, key_rope_bsp))
            weights_bhts = self._softmax(scores_bhts, mask)
            out_latent_bthr = jnp.einsum("bhts,bsr->bthr", weights_bhts, latent_bsr)
            out_bthv = jnp.einsum("bthr,rhv->bthv", out_latent_bthr, kv_up_rhk[..., nope:])
        else:
            whole = (axes.BATCH, None, axes.ACTIVATION_HEADS, None)
            kv_bshk = constrain(jnp.einsum("bsr,rhk->bshk", latent_btr, kv_up_rhk), whole)
            k_nope_bshn, v_bshv = kv_bshk[..., :nope], kv_bshk[..., nope:]
            key_rope_bsp = constrain(key_rope_btp, (axes.BATCH, None, None))
            mask = jnp.tril(jnp.ones((length, length), bool))[None, None]
            if segment_ids is not None:  # packed documents: a query sees its own document only
                mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
            scores_bhts = (jnp.einsum("bthn,bshn->bhts", q_nope_bthn, k_nope_bshn)
                           + jnp.einsum("bthp,bsp->bhts", q_rope_bthp, key_rope_bsp))
            weights_bhts = self._softmax(scores_bhts, mask)
            out_bthv = jnp.einsum("bhts,bshv->bthv", weights_bhts, v_bshv)
        out_bthv = constrain(out_bthv, head_axes)
        out_hvd = self._kernel("out", (heads, value, features), (axes.HEADS, axes.KV, axes.EMBED), inputs=2)
        return self._biased(jnp.einsum("btha,had->btd", out_bthv, out_hvd), "out_bias", (axes.EMBED,))

    def _softmax(self, scores_bhts: jax.Array, mask: jax.Array) -> jax.Array:
        scores = scores_bhts.astype(jnp.float32) * softmax_scale(self.qk_head_features, self.rope_scaling)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        return jax.nn.softmax(scores, axis=-1).astype(self.dtype)

    def _update_cache(self, latent_btr: jax.Array, key_rope_btp: jax.Array,
                      positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Store this call's latents and rotated keys; every cached one, and the causal mask [B, 1, T, S]."""
        if paged.current_view() is not None:  # the engine's blocks: one shared "head" per pool
            (latent_bs1r, key_rope_bs1p), slots = paged.store(
                self, dict(zip(paged.LATENT_POOL_NAMES, (latent_btr[:, :, None], key_rope_btp[:, :, None]),
                               strict=True)), positions)
            mask = (slots[:, None, :] <= positions[:, :, None])[:, None]
            return latent_bs1r[:, :, 0], key_rope_bs1p[:, :, 0], mask
        batch = latent_btr.shape[0]
        cached_latent = self.variable("cache", "cached_latent", jnp.zeros,
                                      (batch, self.max_len, self.kv_lora_rank), self.dtype)
        cached_key = self.variable("cache", "cached_key_rope", jnp.zeros,
                                   (batch, self.max_len, self.qk_rope_head_features), self.dtype)
        if cached_latent.value.shape[0] != batch:
            raise ValueError(
                f"The decode cache holds {cached_latent.value.shape[0]} rows but this call has "
                f"{batch}; start a new cache (apply without a 'cache' collection) for a batch of "
                "another size.")
        rows = jnp.arange(batch)[:, None]
        cached_latent.value = cached_latent.value.at[rows, positions].set(latent_btr.astype(self.dtype),
                                                                          mode="drop")
        cached_key.value = cached_key.value.at[rows, positions].set(key_rope_btp.astype(self.dtype),
                                                                    mode="drop")
        slots = jnp.arange(self.max_len)
        mask = (slots[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, S]
        return cached_latent.value, cached_key.value, mask
