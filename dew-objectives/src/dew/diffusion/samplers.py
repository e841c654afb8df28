"""Samplers: turn noise into samples by walking a schedule's times with a denoiser.

A denoiser is a function ``(x, t) -> (x0_hat, eps_hat)``: given noisy samples
x at time t (a scalar), it estimates the clean sample and the noise (see
:func:`dew.diffusion.targets.to_x0_eps`). Every sampler starts from
``sigma(t_0) * noise`` at the schedule's noisiest sampling time, visits the
schedule's ``sampling_times(steps)`` and ends at the clean end
(alpha = 1, sigma = 0). The loop is a ``lax.scan``, so the denoiser is traced
once whatever the number of steps.

- ``ddpm``: ancestral sampling (DDIM with eta = 1 by default): fresh noise each step.
- ``ddim``: DDIM, deterministic (eta = 0).
- ``euler`` / ``heun``: the probability-flow ODE, first and second order, in
  the schedule's ODE coordinates (:func:`ode_space`): EDM's (x / alpha,
  sigma / alpha) or the flow's (x / (alpha + sigma), sigma / (alpha + sigma)).
- ``dpmpp_2m``: DPM-Solver++(2M), second-order multistep in log-SNR, first
  order on its first and last steps.

>>> import jax, jax.numpy as jnp
>>> from dew.diffusion.schedules import RectifiedFlow
>>> def exact(x, t):  # data = 3 exactly: x0 is known, eps follows from x
...     return jnp.full_like(x, 3.0), (x - (1 - t) * 3.0) / t
>>> out = sample(exact, jnp.ones((2,)), RectifiedFlow(), steps=4, method="heun")
>>> [round(float(v), 4) for v in out]
[3.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from dew.diffusion.schedules import RectifiedFlow, Schedule

__all__ = ["METHODS", "Denoiser", "Method", "grid", "ode_space", "sample"]

Denoiser = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
Method = Literal["ddpm", "ddim", "euler", "heun", "dpmpp_2m"]
METHODS: tuple[str, ...] = ("ddpm", "ddim", "euler", "heun", "dpmpp_2m")


def ode_space(schedule: Schedule) -> Literal["sigma", "flow"]:
    """The ODE coordinates Euler and Heun integrate in: 'flow' for rectified flow, else 'sigma'."""
    return "flow" if isinstance(schedule, RectifiedFlow) else "sigma"


def grid(schedule: Schedule, steps: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sampling times [steps] and their (alpha, sigma) [steps + 1], the clean end last."""
    times = jnp.asarray(schedule.sampling_times(steps), jnp.float32)
    alpha, sigma = schedule.alpha_sigma(times)
    alpha = jnp.concatenate([alpha, jnp.ones((1,), jnp.float32)])
    sigma = jnp.concatenate([sigma, jnp.zeros((1,), jnp.float32)])
    return times, alpha, sigma


def _coordinates(space: str, alpha: jax.Array, sigma: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(scale, c): the ODE state is x / scale and its clock is c."""
    scale = alpha if space == "sigma" else alpha + sigma
    return scale, sigma / scale


def _slope(space: str, x0: jax.Array, eps: jax.Array) -> jax.Array:
    return eps if space == "sigma" else eps - x0


def sample(denoise: Denoiser, noise: jax.Array, schedule: Schedule, *, steps: int,
           method: Method = "ddim", key: jax.Array | None = None, eta: float = 1.0,
           space: Literal["sigma", "flow"] | None = None) -> jax.Array:
    """Samples of the shape of noise (standard normal) by method in steps model steps.

    ddpm needs a key (its per-step noise) and reads eta (1 is DDPM's
    posterior variance, 0 is DDIM). space overrides :func:`ode_space` for
    euler and heun. Heun evaluates the denoiser twice per step but once on
    the last (its endpoint is clean).
    """
    if method not in METHODS:
        raise ValueError(f"Unknown sampler {method!r}; use one of {METHODS}.")
    if method == "ddpm" and key is None:
        raise ValueError("The ddpm sampler draws fresh noise each step; pass key=jax.random.key(...).")
    times, alpha, sigma = grid(schedule, steps)
    space = space or ode_space(schedule)
    if space not in ("sigma", "flow"):
        raise ValueError(f"Unknown ODE space {space!r}; use 'sigma' or 'flow'.")
    x = sigma[0] * noise.astype(jnp.float32)
    keys = jax.random.split(key if key is not None else jax.random.key(0), steps)
    log_snr = jnp.log(alpha) - jnp.log(sigma)  # +inf at the clean end

    def step(carry, i):
        x, previous_x0 = carry
        a_i, s_i, a_n, s_n = alpha[i], sigma[i], alpha[i + 1], sigma[i + 1]
        x0, eps = denoise(x, times[i])
        if method in ("ddim", "ddpm"):
            ratio = (a_i * s_n) / (a_n * s_i)
            c = (eta if method == "ddpm" else 0.0) * s_n * jnp.sqrt(jnp.maximum(1 - ratio**2, 0.0))
            z = jax.random.normal(keys[i], x.shape, jnp.float32)
            new = a_n * x0 + jnp.sqrt(jnp.maximum(s_n**2 - c**2, 0.0)) * eps + c * z
        elif method in ("euler", "heun"):
            scale_i, c_i = _coordinates(space, a_i, s_i)
            scale_n, c_n = _coordinates(space, a_n, s_n)
            d_i = _slope(space, x0, eps)
            euler = (x / scale_i + (c_n - c_i) * d_i) * scale_n
            if method == "euler":
                new = euler
            else:
                def corrected(_):
                    x0_e, eps_e = denoise(euler, times[jnp.minimum(i + 1, steps - 1)])
                    d_n = _slope(space, x0_e, eps_e)
                    return (x / scale_i + (c_n - c_i) * 0.5 * (d_i + d_n)) * scale_n

                new = jax.lax.cond(i + 1 < steps, corrected, lambda _: euler, None)
        else:  # dpmpp_2m
            h = log_snr[i + 1] - log_snr[i]
            h_previous = log_snr[i] - log_snr[jnp.maximum(i - 1, 0)]
            first_order = (i == 0) | (i + 1 == steps)
            r = h_previous / jnp.where(first_order, 1.0, h)
            r = jnp.where(first_order, 1.0, r)
            second = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * previous_x0
            d = jnp.where(first_order, x0, second)
            new = (s_n / s_i) * x - a_n * jnp.expm1(-h) * d
        return (new, x0), None

    (x, _), _ = jax.lax.scan(step, (x, jnp.zeros_like(x)), jnp.arange(steps))
    return x
