"""Rotary position embeddings: the frequencies published models use, and the rotation.

A rotary layer turns pairs of a head's features by angles ``position *
inverse_frequency``. Feature i is paired with feature ``i + rotary_width/2``
(the "rotate half" convention of Llama and every family after it), over the
first ``rotary_width = int(head_width * fraction)`` features; the rest pass
through unrotated (Phi-3's partial rotary). The frequencies are
``base ** (-2i / rotary_width)``, optionally rescaled for longer contexts:

* ``linear``: every frequency divided by ``factor`` (position interpolation);
* ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth
  blend between (Llama 3.1 and later);
* ``yarn``: a ramp between interpolated and original frequencies, and the
  rotated features scaled by an attention factor (YaRN; Qwen's long context);
* ``longrope``: each frequency divided by its own factor, from one list
  while the positions stay within the pretraining context and another once
  they pass it, with an attention factor (LongRoPE; Phi-3's 128k checkpoints,
  Phi-3.5 and Phi-4-mini). The choice follows the largest position a call
  sees, as transformers makes it, so ``frequencies`` takes the positions.

Each is computed here exactly as ``transformers`` computes it, in float32, so
a checkpoint's positions mean the same in dew.

>>> [round(float(f), 6) for f in inverse_frequencies(8, 10_000.0)]
[1.0, 0.1, 0.01, 0.001]
>>> scaled = RopeScaling("linear", factor=2.0)
>>> [round(float(f), 6) for f in inverse_frequencies(8, 10_000.0, scaled)]
[0.5, 0.05, 0.005, 0.0005]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ROPE_KINDS", "RopeScaling", "attention_scaling", "frequencies", "inverse_frequencies", "rotate",
           "rotary_width"]

ROPE_KINDS = ("linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are rescaled for a longer context (None on a model: not at all).

    kind picks the method; factor is how much longer the context is. llama3
    needs low_freq_factor, high_freq_factor and original_max_len (the
    pretraining context); yarn needs original_max_len and reads beta_fast
    and beta_slow (None: 32 and 1), attention_factor (None: derived from
    factor, or from mscale and mscale_all_dim when both are set) and
    truncate, as ``transformers`` does. longrope needs short_factor and
    long_factor (one number per rotated pair) and original_max_len, and reads
    attention_factor (None: derived from factor and original_max_len).
    """

    kind: Literal["linear", "llama3", "yarn", "longrope"]
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_len: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind={self.kind!r} is not one of "
                             f"{', '.join(map(repr, ROPE_KINDS))}.")
        needed = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_len"),
                  "yarn": ("original_max_len",), "linear": (),
                  "longrope": ("short_factor", "long_factor", "original_max_len")}[self.kind]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"RopeScaling of kind {self.kind!r} needs {', '.join(missing)}; "
                             "copy them from the checkpoint's rope_scaling (rope_parameters).")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be positive, got {self.factor}.")
        if self.kind == "longrope" and len(self.short_factor or ()) != len(self.long_factor or ()):
            raise ValueError(f"RopeScaling's short_factor and long_factor hold one number per rotated pair, "
                             f"but hold {len(self.short_factor or ())} and {len(self.long_factor or ())}.")


def rotary_width(head_width: int, fraction: float = 1.0) -> int:
    """How many of a head's features rotate: ``int(head_width * fraction)``."""
    return int(head_width * fraction)


def _default(width: int, base: float) -> np.ndarray:
    exponents = np.arange(0, width, 2, dtype=np.int64).astype(np.float32) / np.float32(width)
    return (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)


def _llama3(inv: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    factor = np.float32(scaling.factor)
    old = float(scaling.original_max_len)  # type: ignore[arg-type]
    low, high = float(scaling.low_freq_factor), float(scaling.high_freq_factor)  # type: ignore[arg-type]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
    smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(width: int, base: float, scaling: RopeScaling) -> np.ndarray:
    original = float(scaling.original_max_len)  # type: ignore[arg-type]
    beta_fast = scaling.beta_fast or 32
    beta_slow = scaling.beta_slow or 1

    def correction(rotations: float) -> float:
        return (width * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction(beta_fast), correction(beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, width - 1)
    if low == high:
        high += 0.001  # as transformers does, to avoid dividing by zero
    positions = np.float32(base) ** (np.arange(0, width, 2).astype(np.float32) / np.float32(width))
    extrapolation = np.float32(1.0) / positions
    interpolation = np.float32(1.0) / (np.float32(scaling.factor) * positions)
    ramp = np.clip((np.arange(width // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = np.float32(1) - ramp
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def _longrope(width: int, base: float, factors: tuple[float, ...] | None) -> np.ndarray:
    ext = np.asarray(factors, np.float32)
    if ext.shape != (width // 2,):
        raise ValueError(f"LongRoPE's factor lists hold {ext.size} numbers, but the model rotates {width // 2} "
                         "feature pairs a head; the checkpoint's short_factor and long_factor give one per pair.")
    exponents = np.arange(0, width, 2, dtype=np.int64).astype(np.float32) / np.float32(width)
    return (np.float32(1.0) / (ext * np.float32(base) ** exponents)).astype(np.float32)


def inverse_frequencies(head_width: int, base: float, scaling: RopeScaling | None = None,
                        fraction: float = 1.0, *, long: bool = False) -> np.ndarray:
    """The float32 inverse frequencies of the rotated feature pairs: [rotary_width // 2].

    long picks LongRoPE's list for positions past the pretraining context (``frequencies``
    chooses by the positions); other kinds have one set.
    """
    width = rotary_width(head_width, fraction)
    if scaling is not None and scaling.kind == "longrope":
        return _longrope(width, base, scaling.long_factor if long else scaling.short_factor)
    if scaling is not None and scaling.kind == "yarn":
        return _yarn(width, base, scaling)
    inv = _default(width, base)
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return (inv / np.float32(scaling.factor)).astype(np.float32)
    return _llama3(inv, scaling)


def frequencies(head_width: int, base: float, scaling: RopeScaling | None, fraction: float,
                positions: jax.Array) -> np.ndarray | jax.Array:
    """The inverse frequencies a call with these positions [B, T] rotates by: ``inverse_frequencies``
    [half], except that LongRoPE takes its long list for a row whose largest position reaches past
    the pretraining context (transformers' choice, by ``max(position_ids) + 1``, made row by row so
    that a row rotates as it would alone): then [B, half]."""
    short = inverse_frequencies(head_width, base, scaling, fraction)
    if scaling is None or scaling.kind != "longrope":
        return short
    long = inverse_frequencies(head_width, base, scaling, fraction, long=True)
    past = jnp.max(positions, axis=-1) + 1 > int(scaling.original_max_len)  # type: ignore[arg-type]
    return jnp.where(past[:, None], jnp.asarray(long)[None], jnp.asarray(short)[None])


def attention_scaling(scaling: RopeScaling | None) -> float:
    """The factor the rotated cos and sin are multiplied by (YaRN's and LongRoPE's attention
    factor, else 1)."""
    if scaling is None or scaling.kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.kind == "longrope":
        original = float(scaling.original_max_len)  # type: ignore[arg-type]
        return 1.0 if scaling.factor <= 1 else math.sqrt(1 + math.log(scaling.factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim))
    return mscale(scaling.factor)


def rotate(x: jax.Array, positions: jax.Array, inverse: np.ndarray | jax.Array, scale: float = 1.0) -> jax.Array:
    """x [B, T, H, D] with its first ``2 * half`` features rotated by positions [B, T], where inverse
    is [half] (every row's frequencies) or [B, half] (each row's own: LongRoPE's).

    Feature i turns with feature ``i + half``; cos and sin are multiplied by
    scale (YaRN's attention factor); the result has x's dtype.
    """
    half = int(inverse.shape[-1])
    rows = jnp.asarray(inverse).reshape(-1, 1, 1, half)  # [1 or B, 1, 1, half]
    angles = positions.astype(jnp.float32)[:, :, None, None] * rows
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    first, second = x32[..., :half], x32[..., half : 2 * half]
    rotated = jnp.concatenate(
        [first * cos - second * sin, second * cos + first * sin, x32[..., 2 * half :]], axis=-1
    )
    return rotated.astype(x.dtype)
