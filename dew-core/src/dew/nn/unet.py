"""A small UNet denoiser for images, conditioned like the DiT.

Residual blocks of group-normalized 3x3 convolutions at each resolution,
average pooling down and nearest-neighbour up, with skip connections between
the two halves. The noise level and condition vector (see
``dew.nn.dit``'s conditioning) are added to every block. The output
convolution starts at zero, so an untrained UNet predicts zero.

>>> import jax, jax.numpy as jnp
>>> model = UNet(image_size=8, channels=1, features=8, multipliers=(1, 2), emb_features=16)
>>> x, level = jnp.zeros((2, 8, 8, 1)), jnp.zeros((2,))
>>> variables = model.init(jax.random.key(0), x, level)
>>> model.apply(variables, x, level).shape
(2, 8, 8, 1)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import sharding as axes
from dew.nn.conditioning import Dense
from dew.nn.dit import ConditionedModule
from dew.nn.sharding import param

__all__ = ["Conv", "GroupNorm", "ResBlock", "UNet"]


class Conv(nn.Module):
    """A same-padded convolution whose kernel [k, k, in, out] carries named axes."""

    features: int
    size: int = 3
    zero: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.zero else nn.initializers.lecun_normal()
        kernel = param(self, "kernel", init, (self.size, self.size, x.shape[-1], self.features),
                       (None, None, axes.EMBED, axes.MLP))
        bias = param(self, "bias", nn.initializers.zeros, (self.features,), (axes.MLP,))
        out = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                           dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return out + bias[None, None, None, :]


class GroupNorm(nn.Module):
    """Normalize channels in groups over space, then a learned scale and shift per channel."""

    groups: int = 8

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        groups = self.groups if c % self.groups == 0 else 1
        grouped = x.reshape(b, h, w, groups, c // groups).astype(jnp.float32)
        mean = grouped.mean(axis=(1, 2, 4), keepdims=True)
        var = grouped.var(axis=(1, 2, 4), keepdims=True)
        normed = ((grouped - mean) * jax.lax.rsqrt(var + 1e-5)).reshape(b, h, w, c)
        scale = param(self, "scale", nn.initializers.ones, (c,), (axes.MLP,))
        shift = param(self, "bias", nn.initializers.zeros, (c,), (axes.MLP,))
        return normed * scale[None, None, None, :] + shift[None, None, None, :]


class ResBlock(nn.Module):
    """x + conv(silu(norm(conv(silu(norm(x))) + embedding))), with a 1x1 skip when widths differ."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array, c: jax.Array) -> jax.Array:
        h = Conv(self.features, name="conv1")(nn.silu(GroupNorm(name="norm1")(x)))
        h = h + Dense(self.features, axes.EMBED, axes.MLP, name="embedding")(nn.silu(c))[:, None, None]
        h = Conv(self.features, zero=True, name="conv2")(nn.silu(GroupNorm(name="norm2")(h)))
        if x.shape[-1] != self.features:
            x = Conv(self.features, size=1, name="skip")(x)
        return x + h


class UNet(ConditionedModule):
    """A UNet over images [B, image_size, image_size, channels]; one level per multiplier.

    ``__call__(x, level, condition=None)`` as DiT. image_size must be
    divisible by 2^(levels - 1).
    """

    image_size: int = 16
    channels: int = 1
    features: int = 32
    multipliers: tuple[int, ...] = (1, 2)

    @nn.compact
    def __call__(self, x: jax.Array, level: jax.Array,
                 condition: jax.Array | None = None) -> jax.Array:
        expected = (self.image_size, self.image_size, self.channels)
        if x.ndim != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(f"UNet takes images [batch, {expected[0]}, {expected[1]}, "
                             f"{expected[2]}], got shape {tuple(x.shape)}.")
        if self.image_size % (2 ** (len(self.multipliers) - 1)):
            raise ValueError(f"image_size={self.image_size} cannot be halved "
                             f"{len(self.multipliers) - 1} times; change it or the multipliers.")
        c = self.conditioning(level, condition)
        h = Conv(self.features, name="conv_in")(x.astype(jnp.float32))
        skips = []
        for i, multiplier in enumerate(self.multipliers):
            h = ResBlock(self.features * multiplier, name=f"down_{i}")(h, c)
            skips.append(h)
            if i + 1 < len(self.multipliers):
                b, hh, ww, ch = h.shape
                h = h.reshape(b, hh // 2, 2, ww // 2, 2, ch).mean(axis=(2, 4))
        h = ResBlock(h.shape[-1], name="middle")(h, c)
        for i, multiplier in reversed(list(enumerate(self.multipliers))):
            if h.shape[1] != skips[i].shape[1]:
                h = h.repeat(2, axis=1).repeat(2, axis=2)
            h = ResBlock(self.features * multiplier, name=f"up_{i}")(
                jnp.concatenate([h, skips[i]], axis=-1), c)
        h = nn.silu(GroupNorm(name="norm_out")(h))
        return Conv(self.channels, zero=True, name="conv_out")(h)
