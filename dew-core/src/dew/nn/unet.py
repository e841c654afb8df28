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
    """A same-padded convolution of x [B, Y, X, C] whose kernel [k, k, in, out] carries named axes."""

    features: int
    size: int = 3
    zero: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x_byxc = x
        init = nn.initializers.zeros if self.zero else nn.initializers.lecun_normal()
        kernel_yxcc = param(self, "kernel", init,
                            (self.size, self.size, x_byxc.shape[-1], self.features),
                            (None, None, axes.EMBED, axes.MLP))
        bias_c = param(self, "bias", nn.initializers.zeros, (self.features,), (axes.MLP,))
        out_byxc = jax.lax.conv_general_dilated(x_byxc, kernel_yxcc, (1, 1), "SAME",
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return out_byxc + bias_c[None, None, None, :]


class GroupNorm(nn.Module):
    """Normalize channels in groups over space, then a learned scale and shift per channel."""

    groups: int = 8

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x_byxc = x
        batch, rows, cols, channels = x_byxc.shape
        groups = self.groups if channels % self.groups == 0 else 1
        # n: the groups; c: the channels within one group
        x_byxnc = x_byxc.reshape(batch, rows, cols, groups, channels // groups).astype(jnp.float32)
        mean_bn = x_byxnc.mean(axis=(1, 2, 4), keepdims=True)  # keepdims: [B, 1, 1, N, 1]
        var_bn = x_byxnc.var(axis=(1, 2, 4), keepdims=True)
        normed_byxc = ((x_byxnc - mean_bn) * jax.lax.rsqrt(var_bn + 1e-5)).reshape(
            batch, rows, cols, channels)
        scale_c = param(self, "scale", nn.initializers.ones, (channels,), (axes.MLP,))
        shift_c = param(self, "bias", nn.initializers.zeros, (channels,), (axes.MLP,))
        return normed_byxc * scale_c[None, None, None, :] + shift_c[None, None, None, :]


class ResBlock(nn.Module):
    """x + conv(silu(norm(conv(silu(norm(x))) + embedding))), with a 1x1 skip when widths differ.

    x is [B, Y, X, C] and c, the condition vector, [B, D].
    """

    features: int

    @nn.compact
    def __call__(self, x: jax.Array, c: jax.Array) -> jax.Array:
        x_byxc, c_bd = x, c
        h_byxc = Conv(self.features, name="conv1")(nn.silu(GroupNorm(name="norm1")(x_byxc)))
        embedding_bc = Dense(self.features, axes.EMBED, axes.MLP, name="embedding")(nn.silu(c_bd))
        h_byxc = h_byxc + embedding_bc[:, None, None]
        h_byxc = Conv(self.features, zero=True, name="conv2")(nn.silu(GroupNorm(name="norm2")(h_byxc)))
        if x_byxc.shape[-1] != self.features:
            x_byxc = Conv(self.features, size=1, name="skip")(x_byxc)
        return x_byxc + h_byxc


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
        x_byxc = x
        expected = (self.image_size, self.image_size, self.channels)
        if x_byxc.ndim != 4 or tuple(x_byxc.shape[1:]) != expected:
            raise ValueError(f"UNet takes images [batch, {expected[0]}, {expected[1]}, "
                             f"{expected[2]}], got shape {tuple(x_byxc.shape)}.")
        if self.image_size % (2 ** (len(self.multipliers) - 1)):
            raise ValueError(f"image_size={self.image_size} cannot be halved "
                             f"{len(self.multipliers) - 1} times; change it or the multipliers.")
        c_bd = self.conditioning(level, condition)
        h_byxc = Conv(self.features, name="conv_in")(x_byxc.astype(jnp.float32))
        skips_byxc = []  # one per level, at that level's resolution and width
        for i, multiplier in enumerate(self.multipliers):
            h_byxc = ResBlock(self.features * multiplier, name=f"down_{i}")(h_byxc, c_bd)
            skips_byxc.append(h_byxc)
            if i + 1 < len(self.multipliers):  # average pooling over 2x2 pixels
                batch, rows, cols, channels = h_byxc.shape
                h_bynxnc = h_byxc.reshape(batch, rows // 2, 2, cols // 2, 2, channels)
                h_byxc = h_bynxnc.mean(axis=(2, 4))
        h_byxc = ResBlock(h_byxc.shape[-1], name="middle")(h_byxc, c_bd)
        for i, multiplier in reversed(list(enumerate(self.multipliers))):
            if h_byxc.shape[1] != skips_byxc[i].shape[1]:  # nearest-neighbour up
                h_byxc = h_byxc.repeat(2, axis=1).repeat(2, axis=2)
            h_byxc = ResBlock(self.features * multiplier, name=f"up_{i}")(
                jnp.concatenate([h_byxc, skips_byxc[i]], axis=-1), c_bd)
        h_byxc = nn.silu(GroupNorm(name="norm_out")(h_byxc))
        return Conv(self.channels, zero=True, name="conv_out")(h_byxc)
