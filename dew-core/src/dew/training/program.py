"""The step program a run compiles: what one step computes, and the state it starts from.

A ``Program`` is the objective, the optimizer and the capabilities around
them (accumulation, the dynamic loss scale, the objective's EMA, or a
custom step): it builds the fresh state those parts need, the pure step
function over it, and the two halves a CPU-owned execution runs apart. It
also says what a checkpoint must agree with to be resumed by it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from dew.errors import DewError
from dew.objectives.base import Objective, Variables
from dew.training.composition import Composition
from dew.training.ema import ema_leaves, ema_storage
from dew.training.state import Scaler, TrainState, Window
from dew.training.step import (
    Gradients,
    StepFn,
    build_train_step,
    differentiate,
    float16_widened,
    follow_ema,
    transaction,
)
from dew.training.trees import select, trains

__all__ = ["Program", "ResumeMismatchError", "StepCompositionError"]

StepFactory = Callable[[Objective, optax.GradientTransformation], StepFn]
Halves = tuple[Callable[[TrainState, Mapping[str, jax.Array]], Gradients],
               Callable[[TrainState, Gradients], tuple[TrainState, dict[str, jax.Array]]]]


class ResumeMismatchError(DewError, ValueError):
    """A checkpoint was written with another accumulation length or loss-scaler configuration."""


class StepCompositionError(DewError, ValueError):
    """A custom step was combined with a capability it cannot compose with."""


@dataclass(frozen=True)
class Program:
    """One run's step: the objective and optimizer, and the parts composed around them."""

    objective: Objective
    optimizer: optax.GradientTransformation
    accumulation: int = 1
    dynamic_scale: bool = False
    custom: StepFactory | None = None  # Trainer(step=...): replaces the transaction
    owns_state: bool = False  # the execution cuts the step in two (a CPU-owned state)

    def __post_init__(self) -> None:
        if self.accumulation < 1:
            raise ValueError(f"accumulation must be at least 1, got {self.accumulation}.")
        if self.custom is not None and self.owns_state:
            raise StepCompositionError(
                "Trainer(step=...) is one program over the whole state, but Layout.host=('params',) "
                "splits every step in two (gradients on the accelerators, the optimizer on the CPU), "
                "which a custom step cannot be cut into. Drop step=, or keep the parameters on the "
                "devices with Layout.host=('opt_state', 'ema')."
            )

    @property
    def composition(self) -> Composition | None:
        """What composes around a custom step (accumulation, the loss scale); None when nothing does."""
        if self.custom is None:
            return None
        composition = Composition(self.accumulation, self.dynamic_scale)
        return composition if composition.needed else None

    @property
    def transform(self) -> optax.GradientTransformation:
        """The optimizer whose state the run keeps: the configured one, or a custom step's composed one."""
        composition = self.composition
        return self.optimizer if composition is None else composition.optimizer(self.optimizer)

    # -- the state --------------------------------------------------------------------
    def fresh(self, variables: Variables, key: jax.Array) -> TrainState:
        """The fresh state around the variables an objective's init returned."""
        variables = dict(nn.meta.unbox(variables))
        if "params" not in variables:
            raise ValueError(
                f"{type(self.objective).__name__}.init returned collections {sorted(variables)}; "
                "it must return Flax variables with a 'params' collection."
            )
        trainable = select(variables, trains(self.objective.frozen))
        zero = jnp.asarray(0, jnp.int32)
        window = None
        if self.accumulation > 1 and self.custom is None:  # a custom step's window is in its optimizer state
            window = Window(grads=jax.tree.map(jnp.zeros_like, trainable),
                            count=jnp.asarray(0.0, jnp.float32), filled=zero)
        ema = None
        if self.objective.ema is not None:
            ema = jax.tree.map(ema_storage, ema_leaves(self.objective.ema, self.objective.frozen, variables))
        return TrainState(
            params=variables, opt_state=self.transform.init(float16_widened(trainable)), key=jax.random.key_data(key),
            step=zero, microstep=zero, updates=zero, ema=ema,
            scaler=Scaler.create() if self.dynamic_scale else None, window=window,
        )

    # -- the step -----------------------------------------------------------------------
    def step(self) -> StepFn:
        """The pure step, (state, batch) -> (state, metrics), in one program."""
        ema = self.objective.ema
        if self.custom is None:
            return build_train_step(self.objective, self.optimizer, accumulation=self.accumulation, ema=ema)
        composition = self.composition
        if composition is None:
            bare = self.custom(self.objective, self.optimizer)

            def custom(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
                # The counters are the trainer's, as around a composed step: one step, one microbatch.
                new, metrics = bare(state, batch)
                return new.replace(step=state.step + 1, microstep=state.microstep + 1), metrics
        else:
            custom = composition.around(self.custom(composition.objective(self.objective),
                                                    composition.optimizer(self.optimizer)))
        if ema is None:
            return custom

        def with_ema(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
            new, metrics = custom(state, batch)
            moved = jax.lax.cond(new.updates != state.updates,
                                 lambda s: follow_ema(s, ema, previous_updates=state.updates), lambda s: s, new)
            return moved, metrics

        return with_ema

    def halves(self) -> Halves:
        """The step cut in two: the gradients of one microbatch, then the transaction that takes them."""
        return differentiate(self.objective), transaction(
            self.optimizer, accumulation=self.accumulation, ema=self.objective.ema, frozen=self.objective.frozen)

    # -- what a checkpoint must agree with ---------------------------------------------
    def meta(self) -> dict[str, object]:
        """The configuration a checkpoint records beside the state."""
        scaler = None
        if self.dynamic_scale:
            s = Scaler.create()
            scaler = {"growth_interval": s.growth_interval, "factor": s.factor, "minimum": s.minimum}
        from dew.versions import installed

        return {"accumulation": self.accumulation, "scaler": scaler, "ema": self.objective.ema is not None,
                "dew": installed()}  # which dew wrote the step: a later one's resume or refusal names it

    def check_resume(self, meta: Mapping[str, object], step: int) -> None:
        """Refuse a checkpoint written with another accumulation length or loss scaler, naming both."""
        mine = self.meta()
        differing = [k for k in ("accumulation", "scaler") if k in meta and meta[k] != mine[k]]
        if differing:
            details = "; ".join(f"{k}: checkpoint {meta[k]!r}, this trainer {mine[k]!r}" for k in differing)
            raise ResumeMismatchError(
                f"The checkpoint at step {step} was written by a trainer configured differently "
                f"({details}). Resume with the configuration it was trained with, or start a new "
                "checkpoint directory."
            )


