"""Diffusion transformers: DiT for images, and a video DiT with factorized attention.

A DiT cuts an image [B, H, W, C] into patch tokens, runs transformer blocks
whose layer norms are modulated by the noise level and the condition
(adaLN-zero: each block's shift, scale and gate come from a zero-initialized
projection, so every block starts as the identity), and folds the tokens back
into an output of the input's shape. ``VideoDiT`` does the same for videos
[B, T, H, W, C], alternating attention over the patches of one frame with
attention over the frames of one patch.

The condition is class labels (``num_classes > 0``; label num_classes is the
null condition), token ids (``text_vocab_size > 0``; id text_vocab_size is
the null token) or nothing. Every parameter is named by its logical axes.

>>> import jax, jax.numpy as jnp
>>> model = DiT(image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1,
...             num_heads=2, mlp_features=32, num_classes=10)
>>> x, level, labels = jnp.zeros((2, 8, 8, 1)), jnp.zeros((2,)), jnp.asarray([1, 10])
>>> variables = model.init(jax.random.key(0), x, level, labels)
>>> model.apply(variables, x, level, labels).shape
(2, 8, 8, 1)
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import sharding as axes
from dew.nn.conditioning import Dense, LabelEmbedding, NoiseEmbedding, TextEncoder
from dew.nn.sharding import constrain, param

__all__ = ["AdaLNBlock", "Attention", "ConditionError", "ConditionedModule", "DiT", "VideoDiT"]

TOKENS = (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED)


class ConditionError(ValueError):
    """A denoiser was given a condition it was not built for, or none when it needs one."""


class Attention(nn.Module):
    """Multi-head attention over x [B, T, E]; mask [B or 1, 1, T, S] keeps True pairs.

    With context [B, S, E], keys and values come from it instead of x. past
    (keys, values [B, P, heads, head width]) is attended before this call's
    own keys (S = P + T). This call's keys and values are sown under
    ``intermediates/.../kv``, so a caller can keep them as the next call's past.
    """

    num_heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None,
                 context: jax.Array | None = None,
                 past: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        features = x.shape[-1]
        if features % self.num_heads:
            raise ValueError(f"Attention width {features} is not divisible by num_heads="
                             f"{self.num_heads}; change one of them.")
        width = features // self.num_heads
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                in_axis=0, out_axis=(1, 2))
        source = x if context is None else context
        kernels = {name: param(self, name, init, (features, self.num_heads, width),
                               (axes.EMBED, axes.HEADS, axes.KV))
                   for name in ("query", "key", "value")}
        q = jnp.einsum("bte,ehd->bthd", x, kernels["query"])
        k = jnp.einsum("bse,ehd->bshd", source, kernels["key"])
        v = jnp.einsum("bse,ehd->bshd", source, kernels["value"])
        self.sow("intermediates", "kv", (k, v))  # kept only when applied with that collection mutable
        if past is not None:  # keys and values of earlier tokens, attended before this call's
            k, v = jnp.concatenate([past[0], k], axis=1), jnp.concatenate([past[1], v], axis=1)
        scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / math.sqrt(width)
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        attended = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
        out_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=(0, 1), out_axis=2)
        out = param(self, "out", out_init, (self.num_heads, width, features),
                    (axes.HEADS, axes.KV, axes.EMBED))
        return jnp.einsum("bthd,hde->bte", attended, out)


def _modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    return x * (1 + scale[:, None]) + shift[:, None]


def _norm(x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.var(x32, axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype)


class AdaLNBlock(nn.Module):
    """x + gate * attention(modulated norm(x)), then the same with an MLP (DiT's adaLN-zero).

    With ``groups`` (a reshape [B, T, E] -> [B*G, T/G, E] and back) the
    attention runs within groups of tokens: a video block attends within one
    frame or within one patch's frames.
    """

    num_heads: int
    mlp_features: int

    @nn.compact
    def __call__(self, x: jax.Array, c: jax.Array, mask: jax.Array | None = None,
                 group: Any = None, ungroup: Any = None) -> jax.Array:
        features = x.shape[-1]
        modulation = Dense(6 * features, axes.EMBED, None, zero=True, name="modulation")(nn.silu(c))
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = jnp.split(modulation, 6, axis=-1)
        h = _modulate(_norm(x), shift_a, scale_a)
        if group is not None:
            h = group(h)
        h = Attention(self.num_heads, name="attention")(h, mask)
        if ungroup is not None:
            h = ungroup(h)
        x = constrain(x + gate_a[:, None] * h, TOKENS)
        h = _modulate(_norm(x), shift_m, scale_m)
        h = nn.gelu(Dense(self.mlp_features, name="mlp_in")(h))
        h = constrain(h, (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_MLP))
        h = Dense(features, axes.MLP, axes.EMBED, name="mlp_out")(h)
        return constrain(x + gate_m[:, None] * h, TOKENS)


class ConditionedModule(nn.Module):
    """What DiT and VideoDiT share: reading the noise level and the condition."""

    emb_features: int
    num_classes: int = 0
    text_vocab_size: int = 0
    text_length: int = 0
    text_layers: int = 1

    def conditioning(self, level: jax.Array, condition: jax.Array | None) -> jax.Array:
        c = NoiseEmbedding(self.emb_features, name="noise")(level)
        if self.num_classes and self.text_vocab_size:
            raise ConditionError(f"{type(self).__name__} reads class labels or text, not both; set "
                                 "num_classes or text_vocab_size to 0.")
        if not (self.num_classes or self.text_vocab_size):
            if condition is not None:
                raise ConditionError(
                    f"{type(self).__name__} was built unconditional (num_classes=0, "
                    "text_vocab_size=0) but was given a condition; drop it or build the model "
                    "with num_classes or text_vocab_size.")
            return c
        if condition is None:
            raise ConditionError(f"{type(self).__name__} is conditional; pass labels or token ids "
                                 "(the null condition for an unconditional sample).")
        if self.num_classes:
            return c + LabelEmbedding(self.num_classes, self.emb_features, name="label")(condition)
        if not self.text_length:
            raise ConditionError("A text-conditioned model needs text_length > 0.")
        return c + TextEncoder(self.text_vocab_size, self.text_length, self.emb_features,
                               self.text_layers, name="text")(condition)

    def head(self, x: jax.Array, c: jax.Array, out_features: int) -> jax.Array:
        shift, scale = jnp.split(Dense(2 * self.emb_features, axes.EMBED, None, zero=True,
                                       name="final_modulation")(nn.silu(c)), 2, axis=-1)
        x = _modulate(_norm(x), shift, scale)
        return Dense(out_features, axes.EMBED, None, zero=True, name="final")(x)


def _patchify(x: jax.Array, p: int) -> jax.Array:
    """[B, H, W, C] -> [B, (H/p)(W/p), p p C]."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def _unpatchify(x: jax.Array, p: int, h: int, w: int, c: int) -> jax.Array:
    b = x.shape[0]
    x = x.reshape(b, h // p, w // p, p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, w, c)


class DiT(ConditionedModule):
    """A diffusion transformer over images [B, image_size, image_size, channels].

    ``__call__(x, level, condition=None)`` maps the noisy image, the noise
    level [B] and the condition (labels [B] or token ids [B, text_length]) to
    an output of x's shape. Parameters: ``patch``, ``position``, ``noise``,
    ``label`` or ``text``, ``blocks_0`` ... and ``final``.
    """

    image_size: int = 32
    channels: int = 3
    patch_size: int = 2
    num_layers: int = 4
    num_heads: int = 4
    mlp_features: int = 512

    @nn.compact
    def __call__(self, x: jax.Array, level: jax.Array,
                 condition: jax.Array | None = None) -> jax.Array:
        expected = (self.image_size, self.image_size, self.channels)
        if x.ndim != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(f"DiT takes images [batch, {expected[0]}, {expected[1]}, "
                             f"{expected[2]}], got shape {tuple(x.shape)}.")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by "
                             f"patch_size={self.patch_size}.")
        p = self.patch_size
        tokens = _patchify(x.astype(jnp.float32), p)
        h = Dense(self.emb_features, None, axes.EMBED, name="patch")(tokens)
        position = param(self, "position", nn.initializers.normal(0.02),
                         (tokens.shape[1], self.emb_features), (None, axes.EMBED))
        h = constrain(h + position[None], TOKENS)
        c = self.conditioning(level, condition)
        for i in range(self.num_layers):
            h = AdaLNBlock(self.num_heads, self.mlp_features, name=f"blocks_{i}")(h, c)
        out = self.head(h, c, p * p * self.channels)
        return _unpatchify(out, p, self.image_size, self.image_size, self.channels)


class VideoDiT(ConditionedModule):
    """A diffusion transformer over videos [B, frames, image_size, image_size, channels].

    Each layer is two adaLN-zero blocks: attention among the patches of one
    frame (space), then among the frames of one patch position (time).
    Positions are a learned table per patch plus one per frame.
    """

    frames: int = 8
    image_size: int = 16
    channels: int = 1
    patch_size: int = 4
    num_layers: int = 2
    num_heads: int = 4
    mlp_features: int = 256

    @nn.compact
    def __call__(self, x: jax.Array, level: jax.Array,
                 condition: jax.Array | None = None) -> jax.Array:
        expected = (self.frames, self.image_size, self.image_size, self.channels)
        if x.ndim != 5 or tuple(x.shape[1:]) != expected:
            raise ValueError(f"VideoDiT takes videos [batch, {', '.join(map(str, expected))}], "
                             f"got shape {tuple(x.shape)}.")
        b, t = x.shape[:2]
        p = self.patch_size
        tokens = _patchify(x.astype(jnp.float32).reshape(b * t, *expected[1:]), p)
        n = tokens.shape[1]
        h = Dense(self.emb_features, None, axes.EMBED, name="patch")(tokens)
        space = param(self, "space_position", nn.initializers.normal(0.02),
                      (n, self.emb_features), (None, axes.EMBED))
        time = param(self, "time_position", nn.initializers.normal(0.02),
                     (t, self.emb_features), (None, axes.EMBED))
        h = (h.reshape(b, t, n, -1) + space[None, None] + time[None, :, None])
        h = constrain(h.reshape(b, t * n, -1), TOKENS)
        c = self.conditioning(level, condition)
        e = self.emb_features

        def by_frame(v):  # [B, T*N, E] -> [B*T, N, E]
            return v.reshape(b * t, n, e)

        def from_frame(v):
            return v.reshape(b, t * n, e)

        def by_patch(v):  # [B, T*N, E] -> [B*N, T, E]
            return v.reshape(b, t, n, e).transpose(0, 2, 1, 3).reshape(b * n, t, e)

        def from_patch(v):
            return v.reshape(b, n, t, e).transpose(0, 2, 1, 3).reshape(b, t * n, e)

        for i in range(self.num_layers):
            h = AdaLNBlock(self.num_heads, self.mlp_features, name=f"space_{i}")(
                h, c, group=by_frame, ungroup=from_frame)
            h = AdaLNBlock(self.num_heads, self.mlp_features, name=f"time_{i}")(
                h, c, group=by_patch, ungroup=from_patch)
        out = self.head(h, c, p * p * self.channels).reshape(b * t, n, -1)
        return _unpatchify(out, p, self.image_size, self.image_size,
                           self.channels).reshape(b, *expected)

