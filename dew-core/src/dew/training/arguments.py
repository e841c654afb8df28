"""What the Trainer is given, checked when it is built: a wrong type named by its argument.

Without these checks a string where a key, a tracker or a Checkpoints belongs surfaced later, as
an AttributeError about a method the string lacks or a JAX error about an abstract array, deep
inside fit (a tracker only after the first step had compiled and run).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

from dew.checkpoints.manager import Checkpoints
from dew.data.base import Dataset
from dew.errors import DewError
from dew.objectives.base import Objective
from dew.tracking.protocol import Reported
from dew.training.cadence import check_cadence
from dew.training.optim import ConfiguredOptimizer

__all__ = ["TrainerArgumentError", "check_parts", "checked_key", "fit_steps"]


class TrainerArgumentError(DewError, TypeError):
    """A Trainer argument of the wrong type: the argument, what it got and what it takes."""


def checked_key(key: object) -> jax.Array:
    """key as a typed PRNG key (a legacy uint32 key is wrapped); anything else is refused."""
    if not isinstance(key, jax.Array) or (not jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                                          and (key.dtype != jnp.uint32 or key.shape[-1:] != (2,))):
        raise TrainerArgumentError(
            f"Trainer's key must be a JAX random key, such as jax.random.key(0); got {_shown(key)}.")
    key = key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
    if key.shape != ():  # a batch of keys (jax.random.split's result) passed the type, then failed deep in fit
        raise TrainerArgumentError(
            f"Trainer's key must be one JAX random key; got a batch of {key.shape} keys (jax.random.split "
            "returns one); pass one of them, such as keys[0].")
    return key


def check_parts(objective: object, optimizer: object, checkpoints: object, tracker: object, mesh: object,
                layout: object, accumulation: object, dynamic_scale: object, profile: object) -> None:
    """Refuse an objective, optimizer, Checkpoints, tracker or setting of the wrong type, saying what fits."""
    from dew.training.placement.layout import Layout
    from dew.training.placement.mesh import MeshSpec
    from dew.training.profiling import ProfileWindow

    for name, value, kind, what in (("mesh", mesh, MeshSpec, "a dew MeshSpec, such as MeshSpec(fsdp=4)"),
                                    ("layout", layout, Layout, "a dew Layout, such as Layout()"),
                                    ("profile", profile, ProfileWindow | None, "a dew ProfileWindow or None")):
        if not isinstance(value, kind):
            raise TrainerArgumentError(f"Trainer's {name} must be {what}; got {_shown(value)}.")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise TrainerArgumentError(f"Trainer's accumulation must be a whole number of at least 1 (the microbatches "
                                   f"an update sums); got {_shown(accumulation)}.")
    if not isinstance(dynamic_scale, bool):
        raise TrainerArgumentError(f"Trainer's dynamic_scale must be True or False (a dynamic loss scale on or "
                                   f"off); got {_shown(dynamic_scale)}.")
    if not isinstance(objective, Objective):
        raise TrainerArgumentError(
            f"Trainer's objective must be a dew Objective (such as LMObjective(model=...)), which holds the "
            f"model; got {_shown(objective)}.")
    if not isinstance(optimizer, optax.GradientTransformation | ConfiguredOptimizer):
        raise TrainerArgumentError(
            f"Trainer's optimizer must be an optax GradientTransformation (such as optax.adam(1e-3)) or a "
            f"built OptimizerConfig; got {_shown(optimizer)}.")
    if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
        raise TrainerArgumentError(
            f"Trainer's checkpoints must be a dew.Checkpoints (such as Checkpoints('runs/a')); got "
            f"{_shown(checkpoints)}.")
    if tracker is not None and not isinstance(tracker, _Reporting):
        raise TrainerArgumentError(
            f"Trainer's tracker must have log and artifact (a dew.tracking tracker, such as "
            f"LocalTracker('runs/a')); got {_shown(tracker)}.")


@runtime_checkable
class _Reporting(Protocol):
    """What fit calls on its tracker (closing it is its owner's: a recipe closes its trackers)."""

    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def artifact(self, value: Reported, step: int) -> None: ...


def _shown(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _check_dataset(dataset: object) -> None:
    """Refuse fit's data that is not a Dataset (a list of batches, an iterator), saying how to wrap it."""
    if not isinstance(dataset, Dataset):
        raise TrainerArgumentError(
            f"fit's data must be a dew.data.Dataset; got {_shown(dataset)}. Wrap batches as "
            "Dataset(train=lambda partition: iter(batches), batch=ROWS).")


def fit_steps(dataset: object, steps: object, log_every: object, eval_every: object, checkpoint_every: object) -> int:
    """The step count fit trains to, once its data and cadence are checked."""
    _check_dataset(dataset)
    return check_cadence(steps, log_every, eval_every, checkpoint_every)
