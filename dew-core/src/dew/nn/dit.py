"""Diffusion transformers: DiT for images, and a video DiT with factorized attention.

A DiT cuts an image [B, Y, X, C] into patch tokens, runs transformer blocks
whose layer norms are modulated by the noise level and the condition
(adaLN-zero: each block's shift, scale and gate come from a zero-initialized
projection, so every block starts as the identity), and folds the tokens back
into an output of the input's shape. ``VideoDiT`` does the same for videos
[B, F, Y, X, C], alternating attention over the patches of one frame with
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
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.errors import DewError
from dew.nn import sharding as axes
from dew.nn.conditioning import Dense, LabelEmbedding, NoiseEmbedding, TextEncoder
from dew.nn.layers import FieldProblems, built_problems, heads_problems
from dew.nn.sharding import constrain, param

__all__ = ["AdaLNBlock", "Attention", "ConditionError", "ConditionedModule", "DiT", "VideoDiT"]

TOKENS = (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED)


class ConditionError(DewError, ValueError):
    """A denoiser was given a condition it was not built for, or none when it needs one."""


class Attention(nn.Module):
    """Multi-head attention over x [B, T, D]; mask [B or 1, 1, T, S] keeps True pairs.

    With context [B, S, D], keys and values come from it instead of x. past
    (keys, values [B, S_past, H, K]) is attended before this call's own keys
    (S = S_past + T). This call's keys and values are sown under
    ``intermediates/.../kv``, so a caller can keep them as the next call's past.
    """

    num_heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None,
                 context: jax.Array | None = None,
                 past: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        x_btd = x
        width = x_btd.shape[-1]
        if width % self.num_heads:
            raise ValueError(f"Attention width {width} is not divisible by num_heads="
                             f"{self.num_heads}; change one of them.")
        head_width = width // self.num_heads
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                in_axis=0, out_axis=(1, 2))
        source_bsd = x_btd if context is None else context
        kernels_dhk = {name: param(self, name, init, (width, self.num_heads, head_width),
                                   (axes.EMBED, axes.HEADS, axes.KV))
                       for name in ("query", "key", "value")}
        q_bthk = jnp.einsum("btd,dhk->bthk", x_btd, kernels_dhk["query"])
        k_bshk = jnp.einsum("bsd,dhk->bshk", source_bsd, kernels_dhk["key"])
        v_bshk = jnp.einsum("bsd,dhk->bshk", source_bsd, kernels_dhk["value"])
        self.sow("intermediates", "kv", (k_bshk, v_bshk))  # kept only when applied with that collection mutable
        if past is not None:  # keys and values of earlier tokens, attended before this call's
            k_bshk = jnp.concatenate([past[0], k_bshk], axis=1)
            v_bshk = jnp.concatenate([past[1], v_bshk], axis=1)
        scores_bhts = (jnp.einsum("bthk,bshk->bhts", q_bthk, k_bshk).astype(jnp.float32)
                       / math.sqrt(head_width))
        if mask is not None:
            scores_bhts = jnp.where(mask, scores_bhts, jnp.finfo(jnp.float32).min)
        weights_bhts = jax.nn.softmax(scores_bhts, axis=-1)
        attended_bthk = jnp.einsum("bhts,bshk->bthk", weights_bhts, v_bshk)
        out_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=(0, 1), out_axis=2)
        out_hkd = param(self, "out", out_init, (self.num_heads, head_width, width),
                        (axes.HEADS, axes.KV, axes.EMBED))
        # jnp.einsum sums contracted axes in the sorted order of their letters. Here "a"
        # (before "h") stands for the head width k, so the sum runs over head width, then
        # heads, as it always has: outputs stay bit for bit what earlier versions computed.
        return jnp.einsum("btha,had->btd", attended_bthk, out_hkd)


def _modulate(x_btd: jax.Array, shift_bd: jax.Array, scale_bd: jax.Array) -> jax.Array:
    return x_btd * (1 + scale_bd[:, None]) + shift_bd[:, None]


def _norm(x_btd: jax.Array) -> jax.Array:
    x32_btd = x_btd.astype(jnp.float32)
    mean_bt = jnp.mean(x32_btd, axis=-1, keepdims=True)  # keepdims: [B, T, 1]
    var_bt = jnp.var(x32_btd, axis=-1, keepdims=True)
    return ((x32_btd - mean_bt) * jax.lax.rsqrt(var_bt + 1e-6)).astype(x_btd.dtype)


class AdaLNBlock(nn.Module):
    """x + gate * attention(modulated norm(x)), then the same with an MLP (DiT's adaLN-zero).

    x is [B, T, D] and c, the condition vector, [B, D]. With ``groups`` (a
    reshape [B, T, D] -> [B*G, T/G, D] and back) the attention runs within
    groups of tokens: a video block attends within one frame or within one
    patch's frames.
    """

    num_heads: int
    mlp_features: int

    @nn.compact
    def __call__(self, x: jax.Array, c: jax.Array, mask: jax.Array | None = None,
                 group: Any = None, ungroup: Any = None) -> jax.Array:
        x_btd, c_bd = x, c
        width = x_btd.shape[-1]
        # [D, 6D] is the block's largest kernel: its output axis is named so a tensor axis splits it.
        modulation = Dense(6 * width, axes.EMBED, axes.MLP, zero=True,
                           name="modulation")(nn.silu(c_bd))
        shift_a_bd, scale_a_bd, gate_a_bd, shift_m_bd, scale_m_bd, gate_m_bd = jnp.split(
            modulation, 6, axis=-1)
        h_btd = _modulate(_norm(x_btd), shift_a_bd, scale_a_bd)
        if group is not None:  # the groups become the attention's batch: [B*G, T/G, D]
            h_btd = group(h_btd)
        h_btd = Attention(self.num_heads, name="attention")(h_btd, mask)
        if ungroup is not None:
            h_btd = ungroup(h_btd)
        x_btd = constrain(x_btd + gate_a_bd[:, None] * h_btd, TOKENS)
        h_btd = _modulate(_norm(x_btd), shift_m_bd, scale_m_bd)
        h_btm = nn.gelu(Dense(self.mlp_features, name="mlp_in")(h_btd))
        h_btm = constrain(h_btm, (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_MLP))
        h_btd = Dense(width, axes.MLP, axes.EMBED, name="mlp_out")(h_btm)
        return constrain(x_btd + gate_m_bd[:, None] * h_btd, TOKENS)


class ConditionedModule(nn.Module):
    """What DiT and VideoDiT share: reading the noise level and the condition."""

    emb_features: int
    num_classes: int = 0
    text_vocab_size: int = 0
    text_length: int = 0
    text_layers: int = 1

    def conditioning(self, level: jax.Array, condition: jax.Array | None) -> jax.Array:
        c_bd = NoiseEmbedding(self.emb_features, name="noise")(level)
        if self.num_classes and self.text_vocab_size:
            raise ConditionError(f"{type(self).__name__} reads class labels or text, not both; set "
                                 "num_classes or text_vocab_size to 0.")
        if not (self.num_classes or self.text_vocab_size):
            if condition is not None:
                raise ConditionError(
                    f"{type(self).__name__} was built unconditional (num_classes=0, "
                    "text_vocab_size=0) but was given a condition; drop it or build the model "
                    "with num_classes or text_vocab_size.")
            return c_bd
        if condition is None:
            raise ConditionError(f"{type(self).__name__} is conditional; pass labels or token ids "
                                 "(the null condition for an unconditional sample).")
        if self.num_classes:
            return c_bd + LabelEmbedding(self.num_classes, self.emb_features, name="label")(condition)
        if not self.text_length:
            raise ConditionError("A text-conditioned model needs text_length > 0.")
        return c_bd + TextEncoder(self.text_vocab_size, self.text_length, self.emb_features,
                                  self.text_layers, name="text")(condition)

    def head(self, x: jax.Array, c: jax.Array, out_features: int) -> jax.Array:
        x_btd, c_bd = x, c
        shift_bd, scale_bd = jnp.split(Dense(2 * self.emb_features, axes.EMBED, axes.MLP, zero=True,
                                             name="final_modulation")(nn.silu(c_bd)), 2, axis=-1)
        x_btd = _modulate(_norm(x_btd), shift_bd, scale_bd)
        return Dense(out_features, axes.EMBED, None, zero=True, name="final")(x_btd)


def _patchify(x_byxc: jax.Array, patch_size: int) -> jax.Array:
    """[B, Y, X, C] -> [B, P, N]: P = (Y/patch)(X/patch) patches of N = patch * patch * C values."""
    batch, rows, cols, channels = x_byxc.shape
    size = patch_size
    x_bynxnc = x_byxc.reshape(batch, rows // size, size, cols // size, size, channels)
    x_byxnnc = x_bynxnc.transpose(0, 1, 3, 2, 4, 5)  # patch row, patch column, then within
    return x_byxnnc.reshape(batch, (rows // size) * (cols // size), size * size * channels)


def _unpatchify(patches_bpn: jax.Array, patch_size: int, rows: int, cols: int,
                channels: int) -> jax.Array:
    """[B, P, N] -> [B, Y, X, C], the inverse of ``_patchify``."""
    batch, size = patches_bpn.shape[0], patch_size
    x_byxnnc = patches_bpn.reshape(batch, rows // size, cols // size, size, size, channels)
    x_bynxnc = x_byxnnc.transpose(0, 1, 3, 2, 4, 5)
    return x_bynxnc.reshape(batch, rows, cols, channels)


class DiT(ConditionedModule):
    """A diffusion transformer over images [B, image_size, image_size, channels].

    ``__call__(x, level, condition=None)`` maps the noisy image, the noise
    level [B] and the condition (labels [B] or token ids [B, text_length]) to
    an output of x's shape. Parameters: ``patch``, ``position``, ``noise``,
    ``label`` or ``text``, ``blocks_0`` ... and ``final``. The tokens the
    blocks see are the image's patches.
    """

    image_size: int = 32
    channels: int = 3
    patch_size: int = 2
    num_layers: int = 4
    num_heads: int = 4
    mlp_features: int = 512

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """Patches that do not tile the image, or heads that do not split the width, said before anything
        is built (dew.registry.ChecksFields)."""
        return built_problems(cls, fields, _shape_problems)

    @nn.compact
    def __call__(self, x: jax.Array, level: jax.Array,
                 condition: jax.Array | None = None) -> jax.Array:
        x_byxc = x
        expected = (self.image_size, self.image_size, self.channels)
        if x_byxc.ndim != 4 or tuple(x_byxc.shape[1:]) != expected:
            raise ValueError(f"DiT takes images [batch, {expected[0]}, {expected[1]}, "
                             f"{expected[2]}], got shape {tuple(x_byxc.shape)}.")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by "
                             f"patch_size={self.patch_size}.")
        size = self.patch_size
        patches_bpn = _patchify(x_byxc.astype(jnp.float32), size)
        h_bpd = Dense(self.emb_features, None, axes.EMBED, name="patch")(patches_bpn)
        position_pd = param(self, "position", nn.initializers.normal(0.02),
                            (patches_bpn.shape[1], self.emb_features), (None, axes.EMBED))
        h_bpd = constrain(h_bpd + position_pd[None], TOKENS)
        c_bd = self.conditioning(level, condition)
        for i in range(self.num_layers):
            h_bpd = AdaLNBlock(self.num_heads, self.mlp_features, name=f"blocks_{i}")(h_bpd, c_bd)
        out_bpn = self.head(h_bpd, c_bd, size * size * self.channels)
        return _unpatchify(out_bpn, size, self.image_size, self.image_size, self.channels)


def _shape_problems(model: DiT | VideoDiT) -> FieldProblems:
    """A DiT's or VideoDiT's fields whose values cannot serve: an image (or clip) of no pixels, patches
    that do not tile the image, heads that do not split the width."""
    sizes = {"image_size": model.image_size, "channels": model.channels}
    if isinstance(model, VideoDiT):
        sizes["frames"] = model.frames
    problems: FieldProblems = [((name,), f"{name}={value} describes no image: it is at least 1.")
                               for name, value in sizes.items() if value < 1]
    if problems:
        return problems
    if model.patch_size < 1 or model.image_size % model.patch_size:
        problems.append((("patch_size",), f"image_size={model.image_size} is not divisible by patch_size="
                                          f"{model.patch_size}: the patches must tile the image."))
    problems += heads_problems(model.emb_features, model.num_heads)
    return problems


class VideoDiT(ConditionedModule):
    """A diffusion transformer over videos [B, frames, image_size, image_size, channels].

    Each layer is two adaLN-zero blocks: attention among the patches of one
    frame (space), then among the frames of one patch position (time).
    Positions are a learned table per patch plus one per frame. The tokens the
    blocks see are every frame's patches, frame by frame (T = F * P).
    """

    frames: int = 8
    image_size: int = 16
    channels: int = 1
    patch_size: int = 4
    num_layers: int = 2
    num_heads: int = 4
    mlp_features: int = 256

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """As DiT's: patches that do not tile a frame, heads that do not split the width."""
        return built_problems(cls, fields, _shape_problems)

    @nn.compact
    def __call__(self, x: jax.Array, level: jax.Array,
                 condition: jax.Array | None = None) -> jax.Array:
        x_bfyxc = x
        expected = (self.frames, self.image_size, self.image_size, self.channels)
        if x_bfyxc.ndim != 5 or tuple(x_bfyxc.shape[1:]) != expected:
            raise ValueError(f"VideoDiT takes videos [batch, {', '.join(map(str, expected))}], "
                             f"got shape {tuple(x_bfyxc.shape)}.")
        batch, frames = x_bfyxc.shape[:2]
        size = self.patch_size
        # Each frame is patchified on its own: the batch here is batch * frames.
        patches_bpn = _patchify(x_bfyxc.astype(jnp.float32).reshape(batch * frames, *expected[1:]),
                                size)
        num_patches, width = patches_bpn.shape[1], self.emb_features
        h_bpd = Dense(self.emb_features, None, axes.EMBED, name="patch")(patches_bpn)
        space_pd = param(self, "space_position", nn.initializers.normal(0.02),
                         (num_patches, self.emb_features), (None, axes.EMBED))
        time_fd = param(self, "time_position", nn.initializers.normal(0.02),
                        (frames, self.emb_features), (None, axes.EMBED))
        h_bfpd = (h_bpd.reshape(batch, frames, num_patches, -1) + space_pd[None, None]
                  + time_fd[None, :, None])
        h_btd = constrain(h_bfpd.reshape(batch, frames * num_patches, -1), TOKENS)
        c_bd = self.conditioning(level, condition)

        def by_frame(h_btd):  # [B, F*P, D] -> [B*F, P, D]
            return h_btd.reshape(batch * frames, num_patches, width)

        def from_frame(h_bpd):  # [B*F, P, D] -> [B, F*P, D]
            return h_bpd.reshape(batch, frames * num_patches, width)

        def by_patch(h_btd):  # [B, F*P, D] -> [B*P, F, D]
            h_bfpd = h_btd.reshape(batch, frames, num_patches, width)
            return h_bfpd.transpose(0, 2, 1, 3).reshape(batch * num_patches, frames, width)

        def from_patch(h_bfd):  # [B*P, F, D] -> [B, F*P, D]
            h_bpfd = h_bfd.reshape(batch, num_patches, frames, width)
            return h_bpfd.transpose(0, 2, 1, 3).reshape(batch, frames * num_patches, width)

        for i in range(self.num_layers):
            h_btd = AdaLNBlock(self.num_heads, self.mlp_features, name=f"space_{i}")(
                h_btd, c_bd, group=by_frame, ungroup=from_frame)
            h_btd = AdaLNBlock(self.num_heads, self.mlp_features, name=f"time_{i}")(
                h_btd, c_bd, group=by_patch, ungroup=from_patch)
        out_btn = self.head(h_btd, c_bd, size * size * self.channels)
        out_bpn = out_btn.reshape(batch * frames, num_patches, -1)  # frames back into the batch
        return _unpatchify(out_bpn, size, self.image_size, self.image_size,
                           self.channels).reshape(batch, *expected)
