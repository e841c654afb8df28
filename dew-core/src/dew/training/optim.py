"""The optimizer a config describes: a solver, its schedule, parameter groups, clipping.

``build_optimizer(OptimizerConfig(...))`` returns one ``optax`` chain:

1. global-norm clipping of the raw gradients (when ``clip_norm`` is set);
2. the solver (adamw, lion, sgd or adafactor) with its learning-rate schedule
   and weight decay, the decay masked off the leaves the config exempts;
3. per-group learning-rate multipliers, which scale each leaf's whole update.

Leaves are selected by their path in the variables tree, written with ``/``
(``params/layer_0/norm/scale``) and matched case-insensitively against
shell-style globs, so the same patterns work whether the optimizer sees the
full ``{'params': ...}`` collection or a bare parameter tree.

>>> import jax.numpy as jnp
>>> from dew.training.optim import OptimizerConfig, build_optimizer
>>> tx = build_optimizer(OptimizerConfig(solver="sgd", learning_rate=0.1))
>>> params = {"params": {"w": jnp.ones(2)}}
>>> updates, _ = tx.update({"params": {"w": jnp.ones(2)}}, tx.init(params), params)
>>> [round(float(u), 3) for u in updates["params"]["w"]]
[-0.1, -0.1]
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import optax
import pydantic
from jax.tree_util import KeyPath

from dew.errors import DewError
from dew.settings import Settings
from dew.tree_paths import path_name
from dew.typing import PyTree

_SMALLEST_NORMAL = float(jnp.finfo(jnp.float32).tiny)

__all__ = [
    "DEFAULT_NO_DECAY",
    "OptimizerConfig",
    "OptimizerConfigError",
    "ParamGroup",
    "build_optimizer",
    "build_schedule",
    "ConfiguredOptimizer",
    "Optimizer",
    "leaf_path",
    "matches",
]

# Leaves that take no weight decay unless a group says otherwise: biases,
# normalisation scales and anything under a norm, and embeddings.
# DeepSeek's routing bias (score_correction) moves by its own rule, never by the optimizer: decay
# would shrink it, and with it the experts a token picks.
DEFAULT_NO_DECAY: tuple[str, ...] = ("*bias", "*scale", "*norm*", "*embed*", "*score_correction")


class OptimizerConfigError(DewError, ValueError):
    """An optimizer config that cannot be built as given."""


class ParamGroup(Settings):
    """Leaves selected by path globs, with their own learning-rate multiplier or decay rule.

    ``match`` holds globs over ``/``-joined leaf paths (``params/*/attention/*``).
    ``lr_scale`` multiplies the learning rate of the selected leaves;
    ``decay`` forces weight decay on (True) or off (False) for them, where
    None keeps the config's default rule.
    """

    # allow_inf_nan=False: an infinite multiplier trains to NaN as surely as a NaN one.
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    match: tuple[str, ...] = pydantic.Field(description="path globs selecting the leaves")
    lr_scale: float = pydantic.Field(1.0, ge=0.0, description="learning-rate multiplier")
    decay: bool | None = pydantic.Field(None, description="force weight decay on or off")

    @pydantic.field_validator("match", mode="before")
    @classmethod
    def _one_pattern_is_a_tuple(cls, value: object) -> object:
        return (value,) if isinstance(value, str) else value


# The solvers that read each optional field (_solver); on any other, a value set changes nothing.
_READ_BY: dict[str, tuple[str, ...]] = {"b1": ("adamw", "lion"), "b2": ("adamw", "lion"),
                                        "eps": ("adamw", "adafactor"), "nesterov": ("sgd",)}


class OptimizerConfig(Settings):
    """What ``build_optimizer`` builds.

    ``solver`` names the update rule. ``b1``, ``b2`` and ``eps`` default to
    the solver's own values when None; ``momentum`` and ``nesterov`` belong
    to sgd (``momentum`` is also adafactor's optional first moment).

    ``schedule`` shapes the learning rate after ``warmup_steps`` of linear
    warmup from zero: ``constant`` stays at ``learning_rate``; ``cosine`` and
    ``linear`` decay to ``end_factor * learning_rate`` at ``decay_steps``
    (counted from the first update, warmup included).

    ``weight_decay`` applies to every leaf except those ``no_decay`` matches;
    ``groups`` override that rule and set learning-rate multipliers, the
    first group whose pattern matches a leaf deciding for it.

    Every number is finite: an infinite learning rate, decay or epsilon
    passed the bounds below and trained the weights to NaN.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    solver: Literal["adamw", "lion", "sgd", "adafactor"] = pydantic.Field(
        "adamw", description="the update rule")
    learning_rate: float = pydantic.Field(3e-4, gt=0.0, description="the peak learning rate")
    schedule: Literal["constant", "cosine", "linear"] = pydantic.Field(
        "constant", description="the learning rate's shape after warmup")
    warmup_steps: int = pydantic.Field(0, ge=0, description="updates of linear warmup from 0")
    decay_steps: int | None = pydantic.Field(
        None, ge=1, description="updates after which the rate is the end value (a recipe: its count of "
                                "updates, so its last update takes the value one before the end, as "
                                "transformers' schedules do)")
    end_factor: float = pydantic.Field(
        0.0, ge=0.0, le=1.0, description="final learning rate, as a fraction of the peak (at most 1)")
    weight_decay: float = pydantic.Field(0.0, ge=0.0, description="weight decay (L2 for sgd)")
    no_decay: tuple[str, ...] = pydantic.Field(
        DEFAULT_NO_DECAY, description="path globs exempt from weight decay")
    groups: tuple[ParamGroup, ...] = pydantic.Field(
        (), description="path-selected groups: learning-rate multipliers, decay on or off")
    clip_norm: float | None = pydantic.Field(
        None, gt=0.0, description="clip gradients to this global norm")
    b1: float | None = pydantic.Field(None, ge=0.0, lt=1.0, description="first-moment decay (solver default)")
    b2: float | None = pydantic.Field(None, ge=0.0, lt=1.0, description="second-moment decay (solver default)")
    # Above 0: with eps 0 a parameter whose gradient is 0 updates by 0/0, and its weights turn NaN
    # while the loss and gradients stay finite (the non-finite guard sees neither).
    eps: float | None = pydantic.Field(None, gt=0.0, description="denominator epsilon (solver default)")
    momentum: float | None = pydantic.Field(None, ge=0.0, lt=1.0, description="sgd or adafactor momentum")
    nesterov: bool = pydantic.Field(False, description="Nesterov momentum (sgd)")

    @pydantic.field_validator("eps")
    @classmethod
    def _eps_is_not_zero_in_float32(cls, value: float | None) -> float | None:
        # Below float32's smallest normal number XLA computes an eps as 0 (subnormals are flushed).
        if value is not None and value < _SMALLEST_NORMAL:
            raise ValueError(f"{value:g} computes as 0 in float32 (below its smallest normal number, "
                             f"{_SMALLEST_NORMAL:.3g}), as eps 0 would: give at least {_SMALLEST_NORMAL:.3g}, "
                             "or leave eps out for the solver's default")
        return value

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> OptimizerConfig:
        # A field the solver or schedule does not read is refused: accepted, it changed nothing.
        unread = [name for name, readers in _READ_BY.items()  # None (and nesterov's False) is unset
                  if getattr(self, name) is not None and getattr(self, name) is not False
                  and self.solver not in readers]
        if unread:
            raise ValueError("; ".join(f"{name} applies to {' and '.join(_READ_BY[name])}, not {self.solver}"
                                       for name in unread) + ": leave it out, or choose a solver that reads it.")
        if self.schedule == "constant" and (self.decay_steps is not None or self.end_factor != 0.0):
            raise ValueError(
                "decay_steps and end_factor shape a decay, and schedule='constant' has none: set "
                "schedule to cosine or linear, or leave them out.")
        if self.nesterov and self.solver == "sgd" and self.momentum is None:
            raise ValueError("nesterov=True needs a momentum; set momentum (for example 0.9).")
        if self.momentum is not None and self.solver not in ("sgd", "adafactor"):
            raise ValueError(
                f"momentum applies to sgd and adafactor, not {self.solver}; use b1 for "
                f"{self.solver}'s first moment."
            )
        if (
            self.schedule != "constant"
            and self.decay_steps is not None
            and self.decay_steps <= self.warmup_steps
        ):
            raise ValueError(
                f"decay_steps ({self.decay_steps}) must exceed warmup_steps "
                f"({self.warmup_steps}): decay is counted from the first update."
            )
        return self


# -- schedules -------------------------------------------------------------------


def build_schedule(config: OptimizerConfig) -> optax.Schedule:
    """The learning rate at each update count that config describes."""
    peak = config.learning_rate
    if config.schedule == "constant":
        if not config.warmup_steps:
            return optax.constant_schedule(peak)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, config.warmup_steps), optax.constant_schedule(peak)],
            [config.warmup_steps],
        )
    if config.decay_steps is None:
        raise OptimizerConfigError(
            f"The {config.schedule} schedule needs decay_steps, the update count at which the "
            f"learning rate reaches its end; set optimizer.decay_steps (a recipe sets it to "
            f"trainer.steps when left out)."
        )
    end = config.end_factor * peak
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, config.warmup_steps, config.decay_steps, end_value=end
        )
    decay = optax.linear_schedule(peak, end, config.decay_steps - config.warmup_steps)
    if not config.warmup_steps:
        return decay
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, config.warmup_steps), decay], [config.warmup_steps]
    )


# -- parameter groups --------------------------------------------------------------


leaf_path = path_name  # a tree path as the ``/``-joined string the globs match


def matches(patterns: Sequence[str], path: str) -> bool:
    """Whether a '/'-joined leaf path matches any of the globs (case-insensitively)."""
    lowered = path.lower()
    return any(fnmatch.fnmatchcase(lowered, pattern.lower()) for pattern in patterns)


def _group(config: OptimizerConfig, path: str) -> ParamGroup | None:
    return next((g for g in config.groups if matches(g.match, path)), None)


def _decays(config: OptimizerConfig, path: str) -> bool:
    group = _group(config, path)
    if group is not None and group.decay is not None:
        return group.decay
    return not matches(config.no_decay, path)


def _lr_scale(config: OptimizerConfig, path: str) -> float:
    group = _group(config, path)
    return 1.0 if group is None else group.lr_scale


def decay_mask(config: OptimizerConfig) -> Callable[[optax.Params], PyTree]:
    """A function params -> tree of bools: True where weight decay applies."""

    def mask(params: optax.Params) -> PyTree:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: _decays(config, leaf_path(path)), params
        )

    return mask


def scale_by_group(config: OptimizerConfig) -> optax.GradientTransformation:
    """Multiply each leaf's update by its group's ``lr_scale`` (stateless)."""

    def init(params: optax.Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: optax.Updates, state: optax.EmptyState,
               params: optax.Params | None = None) -> tuple[optax.Updates, optax.EmptyState]:
        del params

        def scale(path: KeyPath, update: jax.Array) -> jax.Array:
            factor = _lr_scale(config, leaf_path(path))
            return update if factor == 1.0 else update * jnp.asarray(factor, update.dtype)

        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(init, update)


# -- solvers -----------------------------------------------------------------------


def _solver(config: OptimizerConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    mask = decay_mask(config)
    given = {k: v for k, v in (("b1", config.b1), ("b2", config.b2)) if v is not None}
    if config.solver == "adamw":
        eps = {} if config.eps is None else {"eps": config.eps}
        return optax.adamw(lr, **given, **eps, weight_decay=config.weight_decay, mask=mask)
    if config.solver == "lion":
        return optax.lion(lr, **given, weight_decay=config.weight_decay, mask=mask)
    if config.solver == "sgd":
        sgd = optax.sgd(lr, momentum=config.momentum, nesterov=config.nesterov)
        if not config.weight_decay:
            return sgd
        # Coupled (L2) decay, as SGD has always had it: added to the gradient
        # before momentum and the learning rate.
        return optax.chain(optax.add_decayed_weights(config.weight_decay, mask), sgd)
    eps = {} if config.eps is None else {"eps": config.eps}
    return optax.adafactor(
        lr,
        momentum=config.momentum,
        weight_decay_rate=config.weight_decay or None,
        weight_decay_mask=mask,
        **eps,
    )


@dataclass(frozen=True)
class ConfiguredOptimizer:
    """An optax transformation with what the trainer reads of it besides its updates.

    It is used like any optax transformation (``init``, ``update``). The
    trainer takes it as it takes a bare one, and reads two more things: the
    learning-rate ``schedule`` it follows (logged beside the loss), and its
    parameter ``groups`` (checked against what the objective freezes).

    >>> tx = build_optimizer(OptimizerConfig(learning_rate=0.5, groups=[{"match": "*head*"}]))
    >>> float(tx.schedule(10)), tx.groups[0].match
    (0.5, ('*head*',))
    """

    transformation: optax.GradientTransformation
    schedule: optax.Schedule | None = None
    groups: tuple[ParamGroup, ...] = ()

    def init(self, params: optax.Params) -> optax.OptState:
        return self.transformation.init(params)

    def update(self, updates: optax.Updates, state: optax.OptState,
               params: optax.Params | None = None) -> tuple[optax.Updates, optax.OptState]:
        return self.transformation.update(updates, state, params)


Optimizer = optax.GradientTransformation | ConfiguredOptimizer
"""What a Trainer takes: any optax transformation, or one with its schedule and groups."""


def build_optimizer(config: OptimizerConfig) -> ConfiguredOptimizer:
    """Build the optax chain config describes: clipping, the solver, group multipliers."""
    parts: list[optax.GradientTransformation] = []
    if config.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(config.clip_norm))
    schedule = build_schedule(config)
    parts.append(_solver(config, schedule))
    if any(group.lr_scale != 1.0 for group in config.groups):
        parts.append(scale_by_group(config))
    chain = parts[0] if len(parts) == 1 else optax.chain(*parts)
    return ConfiguredOptimizer(chain, schedule, config.groups)
