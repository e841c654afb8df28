"""One diffusion process: a schedule, a target and a weighting, used alike in training and sampling.

``Diffusion`` noises clean samples (``noisy``), scores a model's output
(``loss``) and turns a model into a denoiser for the samplers
(``denoiser``). The model always sees its input scaled to unit variance,
x / sqrt(alpha^2 data_std^2 + sigma^2), and the schedule's noise level; the
same scaling happens in training and sampling because both go through here.

>>> import jax, jax.numpy as jnp
>>> from dew.diffusion.schedules import VPCosine
>>> process = Diffusion(VPCosine(), target="v")
>>> x0 = jnp.zeros((4, 3))
>>> noisy = process.noisy(jax.random.key(0), x0)
>>> noisy.x.shape, noisy.t.shape
((4, 3), (4,))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import flax.struct
import jax
import jax.numpy as jnp

from dew.diffusion.samplers import Denoiser, Method, sample
from dew.diffusion.schedules import Schedule
from dew.diffusion.targets import (
    TARGETS,
    WEIGHTINGS,
    Target,
    Weighting,
    loss_weight,
    target_of,
    to_x0_eps,
)

__all__ = ["Diffusion", "Model", "Noisy"]

Model = Callable[[jax.Array, jax.Array], jax.Array]
"""(scaled noisy input [B, ...], noise level [B]) -> output [B, ...]."""


@flax.struct.dataclass
class Noisy:
    """Clean samples noised: x = alpha x0 + sigma eps at per-example times t."""

    x: jax.Array
    t: jax.Array
    eps: jax.Array
    alpha: jax.Array
    sigma: jax.Array


def _rows(value: jax.Array, like: jax.Array) -> jax.Array:
    return value.reshape(value.shape + (1,) * (like.ndim - value.ndim))


@dataclass(frozen=True)
class Diffusion:
    """A schedule with the target its model predicts and the loss weighting.

    data_std is the standard deviation of the clean data (0.5 for images in
    [-1, 1] as EDM assumes); it sets the input scaling and the edm weighting.
    """

    schedule: Schedule
    target: Target = "eps"
    weighting: Weighting = "uniform"
    data_std: float = 0.5
    snr_gamma: float = 5.0

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"Unknown diffusion target {self.target!r}; use one of {TARGETS}.")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"Unknown loss weighting {self.weighting!r}; use one of {WEIGHTINGS}.")
        if self.data_std <= 0:
            raise ValueError(f"Diffusion.data_std must be positive, got {self.data_std}.")

    def noisy(self, key: jax.Array, x0: jax.Array, t: jax.Array | None = None) -> Noisy:
        """x0 [B, ...] noised at times drawn from the schedule (or the given t [B])."""
        time_key, noise_key = jax.random.split(key)
        if t is None:
            t = self.schedule.sample_times(time_key, (x0.shape[0],))
        alpha, sigma = self.schedule.alpha_sigma(t)
        eps = jax.random.normal(noise_key, x0.shape, jnp.float32)
        x = _rows(alpha, x0) * x0 + _rows(sigma, x0) * eps
        return Noisy(x, t, eps, alpha, sigma)

    def model_input(self, x: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What the model reads at x and times t [B]: the scaled input and the noise level."""
        alpha, sigma = self.schedule.alpha_sigma(t)
        scale = jax.lax.rsqrt(alpha * alpha * self.data_std**2 + sigma * sigma)
        return x * _rows(scale, x), self.schedule.noise_input(t)

    def per_example_loss(self, output: jax.Array, x0: jax.Array, noisy: Noisy) -> jax.Array:
        """The weighted mean squared error of output per example [B]."""
        alpha, sigma = _rows(noisy.alpha, x0), _rows(noisy.sigma, x0)
        goal = target_of(self.target, x0, noisy.eps, alpha, sigma)
        error = jnp.mean(jnp.square(output.astype(jnp.float32) - goal).reshape(x0.shape[0], -1), axis=1)
        weight = loss_weight(self.weighting, self.target, noisy.alpha, noisy.sigma,
                             data_std=self.data_std, snr_gamma=self.snr_gamma)
        return weight * error

    def denoiser(self, model: Model) -> Denoiser:
        """The samplers' view of model: (x [B, ...], t scalar) -> (x0_hat, eps_hat)."""

        def denoise(x: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
            times = jnp.full((x.shape[0],), t, jnp.float32)
            inputs, level = self.model_input(x, times)
            alpha, sigma = self.schedule.alpha_sigma(t)
            return to_x0_eps(model(inputs, level).astype(jnp.float32), x, alpha, sigma, self.target)

        return denoise

    def sample(self, denoise: Denoiser, noise: jax.Array, *, steps: int, method: Method = "ddim",
               key: jax.Array | None = None) -> jax.Array:
        """:func:`dew.diffusion.samplers.sample` with this process's schedule."""
        return sample(denoise, noise, self.schedule, steps=steps, method=method, key=key)
