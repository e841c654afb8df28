"""Noise schedules: how much signal and noise a noisy sample holds at each time.

Every process here writes a noisy sample as ``x_t = alpha(t) * x0 + sigma(t) * eps``
with ``eps`` standard normal, so the targets, losses and samplers of
:mod:`dew.diffusion` are written once against ``(alpha, sigma)`` and work with
any schedule. A schedule also says how training draws times
(``sample_times``), which times a sampler visits (``sampling_times``; the
sampler then steps to the clean end ``alpha = 1, sigma = 0``) and what number
the model reads as its noise level (``noise_input``).

>>> import jax.numpy as jnp
>>> alpha, sigma = RectifiedFlow().alpha_sigma(jnp.asarray(0.25))
>>> float(alpha), float(sigma)
(0.75, 0.25)
>>> [round(float(s), 3) for s in EDM(sigma_min=0.002, sigma_max=80.0).sampling_times(3)]
[80.0, 2.515, 0.002]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.scipy.special import ndtri

__all__ = ["EDM", "SCHEDULES", "RectifiedFlow", "Schedule", "VPCosine", "VPLinear", "karras_sigmas", "noise_schedule",
           "schedule_named"]


@runtime_checkable
class Schedule(Protocol):
    """What a sampler and a loss need to know of a noise process."""

    def alpha_sigma(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The signal and noise scales at time t (elementwise)."""
        ...

    def time_at(self, u: jax.Array) -> jax.Array:
        """The u-quantile (u in (0, 1)) of the times training draws, least noisy first."""
        ...

    def sample_times(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """Times at which training noises its examples: time_at of uniform draws."""
        ...

    def sampling_times(self, steps: int) -> jax.Array:
        """steps decreasing times where a sampler evaluates the model, noisiest first."""
        ...

    def noise_input(self, t: jax.Array) -> jax.Array:
        """The number the model reads as its noise level at time t."""
        ...


def _check_steps(steps: int) -> None:
    if steps < 1:
        raise ValueError(f"A sampler needs at least 1 step, got steps={steps}.")


def _name(schedule: object) -> str:
    return next((n for n, kind in SCHEDULES.items() if kind is type(schedule)), type(schedule).__name__)


def _numbers(schedule: object) -> None:
    """ValueError naming the schedule's first setting that is no finite number (a recipe's "20")."""
    for field in dataclasses.fields(schedule):  # type: ignore[arg-type]  # every schedule is a dataclass
        value = getattr(schedule, field.name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"The {_name(schedule)} schedule's {field.name} must be a finite number, got {value!r}.")


def _rules(schedule: object, *rules: tuple[bool, str]) -> None:
    """ValueError naming the first rule (holds, what it asks) that does not hold: a recipe's value is
    refused before a run trains on it (an EDM sigma_min above its sigma_max inverted every time)."""
    for holds, wanted in rules:
        if not holds:
            raise ValueError(f"The {_name(schedule)} schedule's {wanted}.")


class _UnitTime:
    """Times uniform on [t_min, 1] for training and evenly spaced for sampling; the model reads t."""

    t_min: float

    def time_at(self, u: jax.Array) -> jax.Array:
        return self.t_min + jnp.asarray(u, jnp.float32) * (1.0 - self.t_min)

    def sample_times(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return self.time_at(jax.random.uniform(key, shape, jnp.float32))

    def sampling_times(self, steps: int) -> jax.Array:
        _check_steps(steps)
        return jnp.linspace(1.0, self.t_min, steps, dtype=jnp.float32)

    def noise_input(self, t: jax.Array) -> jax.Array:
        return jnp.asarray(t, jnp.float32)


@dataclass(frozen=True)
class VPLinear(_UnitTime):
    """DDPM's variance-preserving process with a linear beta(t) on t in [0, 1].

    alpha(t) = exp(-(beta_min t + (beta_max - beta_min) t^2 / 2) / 2) and
    sigma = sqrt(1 - alpha^2); beta_min and beta_max are the continuous-time
    rates (0.1 and 20 match DDPM's 1000 steps from 1e-4 to 0.02).
    """

    beta_min: float = 0.1
    beta_max: float = 20.0
    t_min: float = 1e-3

    def __post_init__(self) -> None:
        _numbers(self)
        _rules(self, (0 <= self.beta_min < self.beta_max,
                        f"beta_min ({self.beta_min}) must be at least 0 and below beta_max ({self.beta_max})"),
                 (0 < self.t_min < 1, f"t_min must be between 0 and 1, got {self.t_min}"))

    def alpha_sigma(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = jnp.asarray(t, jnp.float32)
        log_alpha = -0.5 * (self.beta_min * t + 0.5 * (self.beta_max - self.beta_min) * t * t)
        alpha = jnp.exp(log_alpha)
        return alpha, jnp.sqrt(-jnp.expm1(2.0 * log_alpha))



@dataclass(frozen=True)
class VPCosine(_UnitTime):
    """The cosine variance-preserving schedule (Nichol and Dhariwal) on t in [0, 1].

    alpha(t) = cos(pi/2 (t + s) / (1 + s)) / cos(pi/2 s / (1 + s)), kept above
    alpha_min so that the noisiest time still carries a trace of signal.
    """

    offset: float = 0.008
    alpha_min: float = 1e-3
    t_min: float = 1e-3

    def __post_init__(self) -> None:
        _numbers(self)
        _rules(self, (self.offset >= 0, f"offset must be at least 0, got {self.offset}"),
                 (0 < self.alpha_min < 1, f"alpha_min must be between 0 and 1, got {self.alpha_min}"),
                 (0 < self.t_min < 1, f"t_min must be between 0 and 1, got {self.t_min}"))

    def alpha_sigma(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = jnp.asarray(t, jnp.float32)
        s = self.offset
        alpha = jnp.cos(0.5 * math.pi * (t + s) / (1 + s)) / math.cos(0.5 * math.pi * s / (1 + s))
        alpha = jnp.clip(alpha, self.alpha_min, 1.0)
        return alpha, jnp.sqrt(jnp.maximum(1.0 - alpha * alpha, 0.0))



def karras_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float = 7.0) -> jax.Array:
    """Karras et al.'s noise levels: evenly spaced in sigma^(1/rho), sigma_max first.

    >>> [round(float(s), 2) for s in karras_sigmas(2, 0.5, 8.0)]
    [8.0, 0.5]
    """
    _check_steps(steps)
    if steps == 1:
        return jnp.asarray([sigma_max], jnp.float32)
    ramp = jnp.linspace(0.0, 1.0, steps, dtype=jnp.float32)
    low, high = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (high + ramp * (low - high)) ** rho


@dataclass(frozen=True)
class EDM:
    """Karras et al.'s variance-exploding process: the time is the noise level sigma.

    alpha = 1 and sigma = t. Training draws log sigma from a normal
    (p_mean, p_std); sampling visits karras_sigmas; the model reads log(sigma)/4.
    """

    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0
    p_mean: float = -1.2
    p_std: float = 1.2

    def __post_init__(self) -> None:
        _numbers(self)
        _rules(self, (0 < self.sigma_min < self.sigma_max,
                        f"sigma_min ({self.sigma_min}) must be above 0 and below sigma_max ({self.sigma_max})"),
                 (self.rho > 0, f"rho must be above 0, got {self.rho}"),
                 (self.p_std > 0, f"p_std must be above 0, got {self.p_std}"))

    def alpha_sigma(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = jnp.asarray(t, jnp.float32)
        return jnp.ones_like(t), t

    def time_at(self, u: jax.Array) -> jax.Array:
        log_sigma = self.p_mean + self.p_std * ndtri(jnp.asarray(u, jnp.float32))
        return jnp.clip(jnp.exp(log_sigma), self.sigma_min, self.sigma_max)

    def sample_times(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return self.time_at(jax.random.uniform(key, shape, jnp.float32, 1e-6, 1 - 1e-6))

    def sampling_times(self, steps: int) -> jax.Array:
        return karras_sigmas(steps, self.sigma_min, self.sigma_max, self.rho)

    def noise_input(self, t: jax.Array) -> jax.Array:
        return 0.25 * jnp.log(jnp.asarray(t, jnp.float32))


@dataclass(frozen=True)
class RectifiedFlow:
    """Flow matching on straight paths: alpha = 1 - t, sigma = t for t in [0, 1].

    Training draws t from a logit-normal (logit_mean, logit_std), or uniformly
    when logit_std is 0. Sampling visits evenly spaced times from t_max, just
    short of pure noise so that every parameterization stays finite.
    """

    logit_mean: float = 0.0
    logit_std: float = 1.0
    t_max: float = 0.999

    def __post_init__(self) -> None:
        _numbers(self)
        _rules(self, (self.logit_std >= 0, f"logit_std must be at least 0 (0 draws t uniformly), got {self.logit_std}"),
                 (1e-5 < self.t_max < 1, f"t_max must be between 1e-5 and 1 (below pure noise), got {self.t_max}"))

    def alpha_sigma(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = jnp.asarray(t, jnp.float32)
        return 1.0 - t, t

    def time_at(self, u: jax.Array) -> jax.Array:
        u = jnp.asarray(u, jnp.float32)
        if self.logit_std == 0:
            t = u
        else:
            t = jax.nn.sigmoid(self.logit_mean + self.logit_std * ndtri(u))
        return jnp.clip(t, 1e-5, self.t_max)

    def sample_times(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return self.time_at(jax.random.uniform(key, shape, jnp.float32, 1e-6, 1 - 1e-6))

    def sampling_times(self, steps: int) -> jax.Array:
        _check_steps(steps)
        return jnp.linspace(self.t_max, 0.0, steps + 1, dtype=jnp.float32)[:-1]

    def noise_input(self, t: jax.Array) -> jax.Array:
        return jnp.asarray(t, jnp.float32)


SCHEDULES: dict[str, type] = {"vp_linear": VPLinear, "vp_cosine": VPCosine, "edm": EDM,
                              "flow": RectifiedFlow}


def schedule_named(name: str) -> Schedule:
    """A schedule with its default settings by name (as recipes give it).

    >>> schedule_named("flow")
    RectifiedFlow(logit_mean=0.0, logit_std=1.0, t_max=0.999)
    """
    if name not in SCHEDULES:
        raise ValueError(f"Unknown noise schedule {name!r}; use one of {sorted(SCHEDULES)}.")
    return SCHEDULES[name]()


def noise_schedule(value: object) -> Schedule:
    """A schedule from what a recipe or a caller gives: a name (its default settings), a mapping
    of a name and settings (``{name: edm, sigma_max: 20}``), or a Schedule itself. An unknown name
    or setting is refused in one line, naming the ones there are.

    >>> noise_schedule({"name": "edm", "sigma_max": 20.0}).sigma_max
    20.0
    """
    if isinstance(value, str):
        return schedule_named(value)
    if isinstance(value, Mapping):
        settings: dict[str, Any] = dict(value)
        name = settings.pop("name", None)
        if not isinstance(name, str) or name not in SCHEDULES:
            raise ValueError(f"A schedule given as settings names its kind under 'name' (one of "
                             f"{sorted(SCHEDULES)}), got {name!r}.")
        kind = SCHEDULES[name]
        known = [f.name for f in dataclasses.fields(kind)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ValueError(f"The {name} schedule has no setting {', '.join(map(repr, unknown))}; its settings "
                             f"are {', '.join(known)}.")
        return kind(**settings)
    if isinstance(value, Schedule):
        return value
    raise ValueError(f"A schedule is a name ({', '.join(sorted(SCHEDULES))}), a mapping of a name and its "
                     f"settings, or a Schedule; got {type(value).__name__} {value!r}.")
