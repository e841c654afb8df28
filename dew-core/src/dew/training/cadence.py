"""How long a fit runs and how often it logs, evaluates and saves: the arguments of Trainer.fit.

A recipe writes them in its ``trainer`` section; ``Cadence.fit_arguments``
turns them into ``Trainer.fit``'s keywords, counting ``epochs`` in steps.

>>> Cadence(epochs=2.5, log_every=7).fit_arguments(steps_per_epoch=4)["steps"]
10
"""

from __future__ import annotations

import operator
from typing import TypedDict

import pydantic
from pydantic import Field

from dew.errors import DewError
from dew.settings import Settings

__all__ = ["Cadence", "CadenceError", "EpochsNeedRecordsError", "FitArguments", "check_cadence", "log_interval"]

LOGS_AT_LEAST = 10  # a run shorter than log_every logs this many times over its steps


class EpochsNeedRecordsError(DewError, ValueError):
    """A run counted in epochs reads a dataset that does not know its size."""


class CadenceError(DewError, ValueError):
    """Trainer.fit was given a step count below 0 or an interval below 1."""


def check_cadence(steps: object, log_every: object, eval_every: object, checkpoint_every: object) -> int:
    """steps, once fit's arguments are whole numbers in range: what a recipe's Cadence refuses is
    refused when fit is called directly (an interval of 0 ran as "never", which None says, a
    negative step count returned without a word, and steps=10.7 trained 10)."""
    for name, value in (("steps", steps), ("log_every", log_every), ("eval_every", eval_every),
                        ("checkpoint_every", checkpoint_every)):
        if value is None and name in ("eval_every", "checkpoint_every"):
            continue
        try:
            number = operator.index(value)  # type: ignore[arg-type]  # what is not a whole number is refused
        except TypeError:
            raise CadenceError(f"{name} must be a whole number, got {type(value).__name__} {value!r}.") from None
        if name == "steps" and number < 0:
            raise CadenceError(f"steps is the step count to train to, at least 0; got {number}.")
        if name != "steps" and number < 1:
            off = "" if name == "log_every" else " (None turns it off)"
            raise CadenceError(f"{name} must be at least 1{off}, got {number}.")
    return operator.index(steps)  # type: ignore[arg-type]  # checked above


class FitArguments(TypedDict):
    """Trainer.fit's keywords a cadence gives."""

    steps: int
    log_every: int
    eval_every: int | None
    checkpoint_every: int | None
    preview: bool


class Cadence(Settings):
    """The step a fit finishes at, and the intervals of its logging, validation and checkpoints."""

    # allow_inf_nan=False: an infinite number of epochs never ends (and cannot count steps).
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    steps: int | None = Field(None, ge=1, description="train until this step")
    epochs: float | None = Field(
        None, gt=0, description="or train this many passes over the data (when steps is unset)"
    )
    log_every: int = Field(100, ge=1, description="steps between logged metrics")
    eval_every: int | None = Field(None, ge=1, description="steps between validations")
    preview: bool = Field(False, description="write the objective's preview at each validation")
    checkpoint_every: int | None = Field(None, ge=1, description="steps between checkpoints")

    @pydantic.model_validator(mode="after")
    def _length_is_given(self) -> Cadence:
        if self.steps is None and self.epochs is None:
            raise ValueError("set trainer.steps (the step to finish at) or trainer.epochs")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("set trainer.steps or trainer.epochs, not both")
        return self

    def total_steps(self, steps_per_epoch: int | None = None) -> int:
        """The step to finish at: steps, or epochs over a dataset of steps_per_epoch."""
        if self.steps is not None:
            return self.steps
        if steps_per_epoch is None:
            raise EpochsNeedRecordsError(
                "trainer.epochs needs a dataset that knows its size (records); this one does "
                "not, so set trainer.steps instead."
            )
        assert self.epochs is not None
        return max(1, round(self.epochs * steps_per_epoch))

    def fit_arguments(self, steps_per_epoch: int | None = None) -> FitArguments:
        """Trainer.fit's keywords: the step to finish at and the loop's intervals."""
        return {
            "steps": self.total_steps(steps_per_epoch),
            "log_every": self.log_every,
            "eval_every": self.eval_every,
            "checkpoint_every": self.checkpoint_every,
            "preview": self.preview,
        }


def log_interval(steps: int, log_every: int) -> int:
    """The steps between logs a fit of steps uses: log_every, unless that is more than the run
    lasts; then enough to log LOGS_AT_LEAST times over it (every step of a run shorter than that).

    >>> log_interval(1000, 100), log_interval(20, 100), log_interval(5, 100)
    (100, 2, 1)
    """
    if steps >= log_every:
        return log_every
    return max(1, steps // LOGS_AT_LEAST)
