"""What a diffusion model predicts, and how much each noise level counts in its loss.

A model's output means one of four things (``target``): the noise ``eps``,
the clean sample ``x0``, ``v = alpha * eps - sigma * x0`` (Salimans and Ho), or
the flow ``velocity = eps - x0`` (rectified flow's dx/dt). :func:`to_x0_eps`
turns any of them back into estimates of both x0 and eps, which is all a
sampler needs, so samplers never care which target a model was trained on.

A weighting is a weight per example on the squared error of the output.
"uniform" weighs every error alike; "min_snr" and "edm" are defined on the
error of the implied x0 and converted to the output's error here.

>>> import jax.numpy as jnp
>>> x0, eps, a, s = jnp.asarray(2.0), jnp.asarray(-1.0), jnp.asarray(0.6), jnp.asarray(0.8)
>>> x = a * x0 + s * eps
>>> [tuple(round(float(v), 4) for v in to_x0_eps(target_of(t, x0, eps, a, s), x, a, s, t))
...  for t in TARGETS]
[(2.0, -1.0), (2.0, -1.0), (2.0, -1.0), (2.0, -1.0)]
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

__all__ = [
    "TARGETS",
    "WEIGHTINGS",
    "Target",
    "Weighting",
    "loss_weight",
    "target_of",
    "to_x0_eps",
]

Target = Literal["eps", "x0", "v", "velocity"]
Weighting = Literal["uniform", "min_snr", "edm"]
TARGETS: tuple[str, ...] = ("eps", "x0", "v", "velocity")
WEIGHTINGS: tuple[str, ...] = ("uniform", "min_snr", "edm")


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"Unknown diffusion target {target!r}; use one of {TARGETS}.")


def target_of(target: Target, x0: jax.Array, eps: jax.Array, alpha: jax.Array,
              sigma: jax.Array) -> jax.Array:
    """What the model should output for clean x0 noised with eps at (alpha, sigma)."""
    _check_target(target)
    if target == "eps":
        return eps
    if target == "x0":
        return x0
    if target == "v":
        return alpha * eps - sigma * x0
    return eps - x0


def to_x0_eps(output: jax.Array, x: jax.Array, alpha: jax.Array, sigma: jax.Array,
              target: Target) -> tuple[jax.Array, jax.Array]:
    """Estimates of (x0, eps) implied by a model's output at the noisy sample x.

    The inverse of :func:`target_of` given x = alpha x0 + sigma eps; it holds
    for any schedule (v does not assume alpha^2 + sigma^2 = 1).
    """
    _check_target(target)
    if target == "eps":
        return (x - sigma * output) / alpha, output
    if target == "x0":
        return output, (x - alpha * output) / sigma
    if target == "v":
        norm = alpha * alpha + sigma * sigma
        return (alpha * x - sigma * output) / norm, (sigma * x + alpha * output) / norm
    x0 = (x - sigma * output) / (alpha + sigma)
    return x0, output + x0


def _x0_error_per_output_error(target: Target, alpha: jax.Array, sigma: jax.Array) -> jax.Array:
    """k such that an output error e moves the implied x0 by k * e."""
    if target == "eps":
        return sigma / alpha
    if target == "x0":
        return jnp.ones_like(alpha)
    if target == "v":
        return sigma / (alpha * alpha + sigma * sigma)
    return sigma / (alpha + sigma)


def loss_weight(weighting: Weighting, target: Target, alpha: jax.Array, sigma: jax.Array, *,
                data_std: float = 0.5, snr_gamma: float = 5.0) -> jax.Array:
    """The weight of the output's squared error at (alpha, sigma).

    uniform: 1. min_snr: min(SNR, gamma) on the x0 error (Hang et al.), SNR =
    alpha^2 / sigma^2. edm: (sigma^2 + alpha^2 data_std^2) / (sigma data_std)^2
    on the x0 error (Karras et al.'s lambda, written for any alpha).
    """
    _check_target(target)
    if weighting == "uniform":
        return jnp.ones_like(alpha)
    k = _x0_error_per_output_error(target, alpha, sigma)
    if weighting == "min_snr":
        snr = (alpha * alpha) / (sigma * sigma)
        return jnp.minimum(snr, snr_gamma) * k * k
    if weighting == "edm":
        lam = (sigma * sigma + alpha * alpha * data_std**2) / (sigma * data_std) ** 2
        return lam * k * k
    raise ValueError(f"Unknown loss weighting {weighting!r}; use one of {WEIGHTINGS}.")
