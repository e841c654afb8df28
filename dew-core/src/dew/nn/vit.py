"""A small Vision Transformer over image or video patches, for JEPA and as a feature extractor.

Images [B, H, W, C] are cut into patch x patch squares; videos [B, F, H, W, C]
into tubelets of ``tubelet`` frames by patch x patch. Each patch is embedded by
one matrix and a learned position table, then pre-norm layers of
bidirectional attention and a feed-forward block follow. ``visible`` [B, N]
(optional) limits attention to the visible patches: a masked patch neither
attends nor is attended to, so the visible patches' outputs are exactly those
of an encoder that never saw the others (JEPA's context encoder). Every
parameter carries logical axis names, so the trainer's Layout shards it.

>>> import jax, jax.numpy as jnp
>>> encoder = ViTEncoder(image_size=8, patch=2, channels=1, emb_features=16, num_layers=1, num_heads=2,
...                      mlp_features=32)
>>> variables = encoder.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
>>> encoder.apply(variables, jnp.zeros((3, 8, 8, 1))).shape
(3, 16, 16)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import sharding as axes
from dew.nn.layers import FieldProblems, MLPBlock, RMSNorm, built_problems, heads_problems
from dew.nn.sharding import constrain, param

__all__ = ["EncoderLayer", "Predictor", "ViTEncoder", "patchify", "sincos_positions"]

Dtype = Any
_RESIDUAL = (axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED)


def sincos_positions(grid: tuple[int, int, int], features: int) -> jax.Array:
    """Fixed sine-cosine embeddings [N, features] of each patch's (frame, row, column), a third of the width each.

    >>> sincos_positions((1, 2, 2), 12).shape
    (4, 12)
    """
    part = 2 * (features // 6)
    coordinates_fyxn = jnp.stack(jnp.meshgrid(*(jnp.arange(n, dtype=jnp.float32) for n in grid), indexing="ij"),
                                 -1)
    coordinates_pn = coordinates_fyxn.reshape(-1, 3)
    frequencies_n = 1.0 / 10_000.0 ** (jnp.arange(part // 2, dtype=jnp.float32) / max(part // 2, 1))
    pieces = []
    for axis in range(3):
        angles_pn = coordinates_pn[:, axis:axis + 1] * frequencies_n[None, :]
        pieces += [jnp.sin(angles_pn), jnp.cos(angles_pn)]
    table_pd = jnp.concatenate(pieces, axis=-1)
    return jnp.pad(table_pd, ((0, 0), (0, features - table_pd.shape[-1])))


def patchify(pixels: jax.Array, patch: int, tubelet: int = 1) -> jax.Array:
    """[B, H, W, C] or [B, F, H, W, C] to [B, N, values per patch], patches in (frame, row, column) order."""
    if pixels.ndim == 4:
        pixels = pixels[:, None]
    batch, frames, height, width, channels = pixels.shape
    if height % patch or width % patch or frames % tubelet:
        raise ValueError(f"An input of {frames}x{height}x{width} does not divide into tubelets of "
                         f"{tubelet}x{patch}x{patch}; pick a patch (and tubelet) that divides it.")
    # f y x count tubelets, patch rows and patch columns; the n's are the frames, rows and columns inside one.
    cut_bfnynxnc = pixels.reshape(batch, frames // tubelet, tubelet, height // patch, patch, width // patch, patch,
                                  channels)
    cut_bfyxnnnc = cut_bfnynxnc.transpose(0, 1, 3, 5, 2, 4, 6, 7)
    return cut_bfyxnnnc.reshape(batch, -1, tubelet * patch * patch * channels)


class EncoderLayer(nn.Module):
    """A pre-norm layer of bidirectional multi-head attention (over allowed keys) and an MLP."""

    num_heads: int
    mlp_features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, allowed: jax.Array | None = None) -> jax.Array:
        features = x.shape[-1]
        width = features // self.num_heads
        kinds = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        h_btd = RMSNorm(name="attention_norm", **kinds)(x)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2))
        q_bthk, k_bshk, v_bshk = (
            jnp.einsum("btd,dhk->bthk", h_btd, param(self, name, init, (features, self.num_heads, width),
                                                     (axes.EMBED, axes.HEADS, axes.KV), self.param_dtype))
            for name in ("query", "key", "value"))
        scores_bhts = jnp.einsum("bthk,bshk->bhts", q_bthk, k_bshk).astype(jnp.float32) / math.sqrt(width)
        if allowed is not None:  # [B, S]: keys a query may read
            scores_bhts = jnp.where(allowed[:, None, None, :], scores_bhts, jnp.finfo(jnp.float32).min)
        out_bthk = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores_bhts, axis=-1).astype(self.dtype), v_bshk)
        out_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=(0, 1), out_axis=2)
        out_kernel_hkd = param(self, "out", out_init, (self.num_heads, width, features),
                               (axes.HEADS, axes.KV, axes.EMBED), self.param_dtype)
        # "a" is the head width here, so einsum sums it before the heads, as it always has
        x = constrain(x + jnp.einsum("btha,had->btd", out_bthk, out_kernel_hkd), _RESIDUAL)
        x = x + MLPBlock(self.mlp_features, "gelu", name="mlp", **kinds)(RMSNorm(name="mlp_norm", **kinds)(x))
        return constrain(x, _RESIDUAL)


def _tiling_problems(model: ViTEncoder) -> FieldProblems:
    """Heads that do not split the encoder's width, patches or tubelets that do not tile its input."""
    problems = heads_problems(model.emb_features, model.num_heads)
    if model.patch < 1 or model.image_size % model.patch:
        problems.append((("patch",), f"image_size={model.image_size} is not divisible by patch={model.patch}: "
                                     "the patches must tile the image."))
    if model.tubelet < 1 or model.frames % model.tubelet:
        problems.append((("tubelet",), f"frames={model.frames} is not divisible by tubelet={model.tubelet}."))
    return problems


class ViTEncoder(nn.Module):
    """Patches of an image (or tubelets of a video) to one embedding each, [B, N, emb_features].

    image_size is the side of a square input; frames (1 for images) and
    tubelet set the video's time axis. ``visible`` [B, N] bool limits which
    patches attend to each other (see the module's docstring).
    """

    image_size: int
    patch: int
    channels: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    frames: int = 1
    tubelet: int = 1
    positions: Literal["sincos", "learned"] = "sincos"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """Heads that do not split the width, patches or tubelets that do not tile the input, said before
        anything is built (dew.registry.ChecksFields)."""
        return built_problems(cls, fields, _tiling_problems)

    @property
    def grid(self) -> tuple[int, int, int]:
        """Patches along (time, rows, columns)."""
        side = self.image_size // self.patch
        return (self.frames // self.tubelet, side, side)

    @property
    def num_patches(self) -> int:
        return math.prod(self.grid)

    @nn.compact
    def __call__(self, pixels: jax.Array, visible: jax.Array | None = None) -> jax.Array:
        if self.emb_features % self.num_heads:
            raise ValueError(f"emb_features={self.emb_features} is not divisible by num_heads={self.num_heads}.")
        # n: the values of one patch (tubelet x patch x patch x channels)
        patches_bpn = patchify(jnp.asarray(pixels, self.dtype), self.patch, self.tubelet)
        if patches_bpn.shape[1] != self.num_patches:
            raise ValueError(f"The input makes {patches_bpn.shape[1]} patches but the encoder was built for "
                             f"{self.num_patches} (image_size={self.image_size}, frames={self.frames}).")
        kernel_nd = param(self, "patch_embed", nn.initializers.lecun_normal(),
                          (patches_bpn.shape[-1], self.emb_features), (None, axes.EMBED), self.param_dtype)
        if self.positions == "learned":
            table_pd = param(self, "position", nn.initializers.normal(0.02), (self.num_patches, self.emb_features),
                             (None, axes.EMBED), self.param_dtype)
        else:
            table_pd = sincos_positions(self.grid, self.emb_features)
        x_bpd = constrain(jnp.einsum("bpn,nd->bpd", patches_bpn, kernel_nd) + table_pd[None], _RESIDUAL)
        for i in range(self.num_layers):
            x_bpd = EncoderLayer(self.num_heads, self.mlp_features, self.dtype, self.param_dtype,
                                 name=f"layers_{i}")(x_bpd, visible)
        return RMSNorm(name="final_norm", dtype=self.dtype, param_dtype=self.param_dtype)(x_bpd)


class Predictor(nn.Module):
    """JEPA's predictor: the context's embeddings plus mask tokens at the target places, to the targets'.

    context [B, N, E] holds the context encoder's outputs (read where
    ``visible``), targets [B, N] bool marks the patches to predict. The
    output [B, N, out_features] is meaningful at the target patches.
    """

    grid: tuple[int, int, int]
    emb_features: int
    out_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, context: jax.Array, visible: jax.Array, targets: jax.Array) -> jax.Array:
        width = context.shape[-1]
        # d: the context encoder's width (and out_features), m: the predictor's own (emb_features)
        into_dm = param(self, "embed", nn.initializers.lecun_normal(), (width, self.emb_features),
                        (axes.EMBED, axes.MLP), self.param_dtype)
        mask_token_m = param(self, "mask_token", nn.initializers.normal(0.02), (self.emb_features,), (axes.MLP,),
                             self.param_dtype)
        table_pm = sincos_positions(self.grid, self.emb_features)
        x_bpm = jnp.einsum("bpd,dm->bpm", context, into_dm)
        x_bpm = jnp.where(targets[..., None], mask_token_m[None, None, :], x_bpm) + table_pm[None]
        allowed_bp = visible | targets
        for i in range(self.num_layers):
            x_bpm = EncoderLayer(self.num_heads, self.mlp_features, self.dtype, self.param_dtype,
                                 name=f"layers_{i}")(x_bpm, allowed_bp)
        x_bpm = RMSNorm(name="final_norm", dtype=self.dtype, param_dtype=self.param_dtype)(x_bpm)
        out_md = param(self, "out", nn.initializers.lecun_normal(), (self.emb_features, self.out_features),
                       (axes.MLP, axes.EMBED), self.param_dtype)
        return jnp.einsum("bpm,md->bpd", x_bpm, out_md)
