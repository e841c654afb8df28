"""The parts a trainer composes around a custom step: gradient accumulation and the loss scale.

A custom step (``Trainer(step=...)``) is a whole transaction the trainer
cannot cut, so these parts reach it through the two things it is handed.
The optimizer is wrapped in optax's own ``MultiSteps``, which sums a window
of microbatch gradients before the inner optimizer sees them and, with
``skip_not_finite``, drops a non-finite microbatch without moving anything;
under a dynamic loss scale the gradients are first divided by the scale.
The objective is wrapped so that differentiating its loss multiplies every
cotangent of the backward pass by the scale (the loss's value is unchanged),
which is what scaling the loss does for low-precision gradients.

Each part owns its state: the window and the skip record sit in the
optimizer state, the scale in ``TrainState.scaler``, and the trainer derives
the counters and the scaler's move from them after the step, so a custom
step composes with accumulation and scaling exactly as the built-in one does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from dew.errors import DewError
from dew.objectives.base import Aux, Batch, Mean, Objective, Step, Variables
from dew.training.state import TrainState

__all__ = ["CustomStepUnusedPartError", "Composition"]


class CustomStepUnusedPartError(DewError, ValueError):
    """A custom step never called the optimizer or the loss through which a composed part works."""


@jax.custom_vjp
def _scaled_backward(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x unchanged; its cotangent multiplied by scale on the way back."""
    return x


def _forward(x: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, scale


def _backward(scale: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, jax.Array]:
    return cotangent * scale.astype(cotangent.dtype), jnp.zeros_like(scale)


_scaled_backward.defvjp(_forward, _backward)


@dataclass
class _Trace:
    """What one trace of the composed step saw: the scale it runs under and which parts were used."""

    scale: jax.Array | None = None
    optimizer_calls: int = 0
    loss_calls: int = 0


class _ScaledObjective:
    """The run's objective, as a custom step sees it under a loss scale: its loss's backward is scaled.

    Everything but ``loss`` is the objective's own (attributes included), so a
    step that reads, say, its DPO objective's beta reads it unchanged.
    """

    def __init__(self, inner: Objective, trace: _Trace) -> None:
        self._inner, self._trace = inner, trace

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        loss, aux = self._inner.loss(variables, batch, step)
        trace = self._trace
        if trace.scale is None:  # called outside a composed step (a test, a notebook): plain
            return loss, aux
        trace.loss_calls += 1
        return Mean(_scaled_backward(loss.total, trace.scale), loss.count), aux

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass(frozen=True)
class Composition:
    """Accumulation over ``accumulation`` microbatches and, optionally, a dynamic loss scale, around a custom step."""

    accumulation: int
    dynamic_scale: bool
    _trace: _Trace = field(default_factory=_Trace, compare=False, repr=False)

    @property
    def needed(self) -> bool:
        """Whether there is anything to compose (a custom step alone runs as it is)."""
        return self.accumulation > 1 or self.dynamic_scale

    def optimizer(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
        """The optimizer a custom step is handed: unscale, then skip or accumulate, then inner."""
        window = optax.MultiSteps(inner, every_k_schedule=self.accumulation,
                                  should_skip_update_fn=optax.skip_not_finite).gradient_transformation()
        trace = self._trace

        def update(grads: optax.Updates, opt_state: optax.OptState,
                   params: optax.Params | None = None, **extra: Any) -> tuple[optax.Updates, optax.OptState]:
            trace.optimizer_calls += 1
            if trace.scale is not None:
                scale = trace.scale
                grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
            return window.update(grads, opt_state, params, **extra)

        return optax.GradientTransformation(window.init, update)

    def objective(self, inner: Objective) -> Objective:
        """The objective a custom step is handed: under a loss scale its loss's backward is scaled."""
        if not self.dynamic_scale:
            return inner
        return cast(Objective, _ScaledObjective(inner, self._trace))

    @contextmanager
    def _tracing(self, state: TrainState) -> Iterator[_Trace]:
        trace = self._trace
        trace.scale = state.scaler.scale if state.scaler is not None else None
        trace.optimizer_calls = trace.loss_calls = 0
        try:
            yield trace
        finally:
            trace.scale = None

    def around(self, custom: Any) -> Any:
        """The composed step: the custom step, then the counters and the scaler moved from what its parts recorded."""
        dynamic_scale, accumulation = self.dynamic_scale, self.accumulation

        def step(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
            with self._tracing(state) as trace:
                new, metrics = custom(state, batch)
            if trace.optimizer_calls == 0:
                raise CustomStepUnusedPartError(
                    f"accumulation={accumulation}{' with dynamic_scale=True' if dynamic_scale else ''} happens in "
                    "the optimizer the step factory is handed (optax.MultiSteps around yours), but this custom "
                    "step never calls its update, so nothing would be accumulated or skipped. Update with "
                    "optimizer.update(grads, state.opt_state, params), or drop accumulation and dynamic_scale.")
            if dynamic_scale and trace.loss_calls == 0:
                raise CustomStepUnusedPartError(
                    "dynamic_scale=True scales the backward pass of the objective's loss the step factory is "
                    "handed, but this custom step never calls objective.loss, so its gradients would be divided "
                    "by a scale they never carried. Differentiate objective.loss, or drop dynamic_scale.")
            window = _window_state(new.opt_state)
            before = _window_state(state.opt_state)
            finite = jnp.logical_not(window.skip_state["should_skip"])
            emitted = (window.gradient_step - before.gradient_step).astype(state.updates.dtype)
            new = new.replace(step=state.step + 1, microstep=state.microstep + finite.astype(state.microstep.dtype),
                              updates=state.updates + emitted)
            metrics = {**metrics, "finite": finite, "updates": new.updates}
            if state.scaler is not None:
                new = new.replace(scaler=state.scaler.update(finite))
                metrics["loss_scale"] = new.scaler.scale
            return new, metrics

        return step


def _window_state(opt_state: optax.OptState) -> optax.MultiStepsState:
    if not isinstance(opt_state, optax.MultiStepsState):
        raise CustomStepUnusedPartError(
            "A custom step composed with accumulation or a loss scale must keep the optimizer state its "
            f"optimizer.update returns in state.opt_state; it holds a {type(opt_state).__name__}.")
    return opt_state
