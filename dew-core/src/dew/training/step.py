"""The training transaction that Trainer.compile jits: one microbatch in, one state out.

The built-in step is a chain of parts, each owning one field of TrainState:

- differentiate (``differentiate``): the gradients of the loss's total, the
  loss multiplied by the loss scale when there is one, divided back after;
- skip non-finite (``transaction``): a step whose loss or gradients are not
  finite is rejected whole, so only the attempt counter and the scaler move;
- scale (``Scaler.update``, owns ``scaler``): halve on a rejected step, grow
  after a streak of finite ones;
- accumulate (``_accumulate``, owns ``window``): gradients and loss counts
  summed over the window, divided once when it is full, so a window is
  exactly one batch that many times larger, and a half-filled window is
  checkpointed with the rest;
- optimize (``_optimize``, owns ``opt_state`` and ``updates``): the optax
  optimizer on the trainable leaves;
- the EMA (``follow_ema``, owns ``ema``): after each update, at the rate its
  schedule gives for that update.

A custom step replaces this chain; dew.training.composition puts
accumulation and the loss scale around it through optax's own MultiSteps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from dew.errors import BatchKeyError, DewError, LossReturnError
from dew.nn.pipeline import current_schedule
from dew.nn.pipeline_step import pipelined_gradients
from dew.objectives.base import (
    Aux,
    EMASpec,
    LeafFilter,
    Mean,
    Objective,
    Step,
    Variables,
    check_signature,
)
from dew.training.ema import ema_update
from dew.training.state import TrainState, Window
from dew.training.trees import leaves_at, overlay, select, trains

__all__ = ["Gradients", "StepFn", "build_train_step", "differentiate", "float16_widened", "follow_ema", "transaction", "write_back"]

StepFn = Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]


def write_back(params: Variables, variables: Variables | None) -> Variables:
    """Replace nonparameter collections whole; the optimizer owns params.

    >>> write_back({"params": 1, "stats": 2}, {"params": 9, "stats": 3})
    {'params': 1, 'stats': 3}
    """
    if not variables:
        return params
    merged = dict(params)
    for collection, value in variables.items():
        if collection != "params":
            merged[collection] = value
    return merged


def _scalar(value: Mean | ArrayLike) -> jax.Array:
    if isinstance(value, Mean):
        return value.value.astype(jnp.float32)
    return jnp.mean(jnp.asarray(value, jnp.float32))


@flax.struct.dataclass
class Gradients:
    """What differentiating one microbatch hands the transaction.

    grads are summed (not averaged) over the microbatch and already divided
    by the loss scale; loss is the objective's statistic and aux what else
    its loss returned. The two halves of a step meet here, so a CPU-owned
    state can run the first on the accelerators and the second on the CPU.
    """

    grads: Variables
    loss: Mean
    aux: Aux


def differentiate(objective: Objective) -> Callable[[TrainState, Mapping[str, jax.Array]], Gradients]:
    """The first half of a step: the gradients of the trainable leaves for one microbatch.

    It reads the state's variables, counters, key, EMA and loss scale, never
    its optimizer state or accumulation window, so it can run against a
    snapshot that holds only those. Under a 1F1B pipeline schedule the
    schedule differentiates, one microbatch at a time (dew.nn.pipeline_step).
    """
    trainable_filter = trains(objective.frozen)

    def forward(state: TrainState, batch: Mapping[str, jax.Array]) -> Gradients:
        variables = state.params
        trainable = select(variables, trainable_filter)
        info = Step(
            step=state.step, microstep=state.microstep, updates=state.updates,
            key=state.key_for(state.step), ema=state.averaged,
        )
        scaler = state.scaler

        schedule = current_schedule()

        def per(count: ArrayLike) -> ArrayLike:  # what the scaled sum is divided by (see total)
            return 1.0 if schedule.interleaves else _power_of_two_at_most(count)

        def total(p: Variables, rows: Mapping[str, jax.Array] = batch) -> tuple[jax.Array, tuple[Mean, Aux]]:
            loss, aux = _loss_pair(objective, _loss_of(objective, overlay(variables, p), rows, info))
            scaled = loss.total.astype(jnp.float32)
            if scaler is None:
                return scaled, (loss, aux)
            # The sum over the microbatch's count is scaled as its mean is (per-token gradients summed over
            # 16384 tokens overflow float16 at any scale above 1/16384), by a power of two, so dividing
            # it back out below is exact. A 1F1B schedule sums microbatches inside one gradient: its
            # sum is scaled as it is.
            return scaled * (scaler.scale / per(loss.count)), (loss, aux)

        if schedule.interleaves:
            grads, (_, (loss, aux)) = pipelined_gradients(total, trainable, batch, schedule)
            aux = _microbatch_mean(aux, schedule.count)
        else:
            grads, (loss, aux) = jax.grad(total, has_aux=True)(trainable)
        if scaler is not None:
            unscale = per(loss.count) / scaler.scale
            grads = jax.tree.map(lambda g: g * unscale, grads)
        return Gradients(grads=grads, loss=loss, aux=aux)

    return forward


def _power_of_two_at_most(count: ArrayLike) -> jax.Array:
    """The largest power of two not above count (1 for a count below 2), held out of differentiation."""
    count = jax.lax.stop_gradient(jnp.maximum(jnp.asarray(count, jnp.float32), 1.0))
    return jnp.exp2(jnp.floor(jnp.log2(count)))


def _loss_of(objective: Objective, variables: Variables, rows: Mapping[str, jax.Array], info: Step) -> object:
    """objective.loss on rows. An objective that names no required_keys() (which the feed checks)
    met a bare KeyError deep in the trace for a key the batch lacks: a KeyError of a key the batch
    does not hold is a BatchKeyError naming the batch's keys (the loss's own error is its cause)."""
    try:
        return objective.loss(variables, rows, info)
    except TypeError as error:
        check_signature(objective, "loss", error, variables, rows, info)
        raise
    except KeyError as error:
        key = error.args[0] if len(error.args) == 1 else None
        if isinstance(error, DewError) or not isinstance(key, str) or key in rows or objective.required_keys():
            raise
        raise BatchKeyError(
            f"{type(objective).__name__}.loss raised KeyError {key!r}, a key the batch does not hold (it holds "
            f"{sorted(rows)}): if the loss reads it from the batch, give the data that key or read one it holds, "
            "and name the keys it reads in required_keys(), which the trainer checks before compiling.") from error


def _loss_pair(objective: object, returned: object) -> tuple[Mean, Aux]:
    """returned, checked to be the (Mean, Aux) pair Objective.loss promises; LossReturnError names
    what it is instead (a bare mean, a float, a dict of metrics), as the step is traced."""
    if (isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[0], Mean)
            and isinstance(returned[1], Aux)):
        return returned[0], returned[1]
    parts = returned if isinstance(returned, tuple) else (returned,)
    got = ", ".join("an array" if isinstance(part, jax.Array) else type(part).__name__ for part in parts)
    raise LossReturnError(
        f"{type(objective).__name__}.loss returned ({got}); a loss returns a (Mean, Aux) pair: the total "
        "and the count it averages over, and the metrics beside it, e.g. `return Mean.of(per_example), "
        "Aux(metrics={...})` (dew.objectives.base).")


def _microbatch_mean(aux: Aux, count: int) -> Aux:
    """aux summed over count microbatches, as one batch's: a Mean's totals add up, a plain metric
    is averaged. Written-back collections have no sum, and are refused."""
    if aux.updates:
        raise ValueError(
            "A 1F1B pipeline schedule scores a loss one microbatch at a time, but this objective's loss "
            f"writes back the collections {sorted(aux.updates)}, which cannot be summed over microbatches. "
            "Use MeshSpec(schedule='gpipe').")
    metrics = {name: value if isinstance(value, Mean) else jax.tree.map(lambda a: a / count, value)
               for name, value in aux.metrics.items()}
    return Aux(metrics=metrics, updates=aux.updates)


def transaction(
    optimizer: optax.GradientTransformation,
    *,
    accumulation: int = 1,
    ema: EMASpec | None = None,
    frozen: LeafFilter | None = None,
) -> Callable[[TrainState, Gradients], tuple[TrainState, dict[str, jax.Array]]]:
    """The second half of a step: accept or reject one microbatch's gradients, and update.

    A non-finite loss or gradient leaves the state as it was (only the step
    counter and the loss scaler move); a finite one is added to the
    accumulation window, and a full window (or no window) drives the
    optimizer and then the EMA.
    """
    trainable_filter = trains(frozen)

    def apply(state: TrainState, computed: Gradients) -> tuple[TrainState, dict[str, jax.Array]]:
        grads, loss, aux = computed.grads, computed.loss, computed.aux
        count = jnp.asarray(loss.count, jnp.float32)
        # One reduction tells both: the norm is finite only when every gradient entry is. It is
        # summed in float32: float16 gradients' squares overflow it while every entry is finite.
        norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        finite = jnp.isfinite(norm) & jnp.isfinite(loss.total)

        def accept(state: TrainState) -> TrainState:
            return _accumulate(state, grads, count, aux, optimizer, accumulation, ema, trainable_filter)

        def reject(state: TrainState) -> TrainState:
            return state

        new = jax.lax.cond(finite, accept, reject, state)
        if new.scaler is not None:
            new = new.replace(scaler=new.scaler.update(finite))
        new = new.replace(step=state.step + 1)
        metrics = {
            "loss": _scalar(loss), "finite": finite, "updates": new.updates,
            "grad_norm": norm / jnp.maximum(count, 1),
        }
        for name, value in aux.metrics.items():
            metrics[name] = _scalar(value)
        if new.scaler is not None:
            metrics["loss_scale"] = new.scaler.scale
        return new, metrics

    return apply


def build_train_step(
    objective: Objective,
    optimizer: optax.GradientTransformation,
    *,
    accumulation: int = 1,
    ema: EMASpec | None = None,
) -> StepFn:
    """Return the pure step function: (state, batch) -> (state, metrics).

    Only the leaves ``trees.trains(objective.frozen)`` accepts are
    differentiated and updated; the frozen ones are read from the state as
    they are. The EMA follows the leaves of ``state.ema``. The step is
    ``transaction`` applied to what ``differentiate`` returns, in one program.
    """
    forward = differentiate(objective)
    apply = transaction(optimizer, accumulation=accumulation, ema=ema,
                        frozen=objective.frozen)

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
        return apply(state, forward(state, batch))

    return train_step


def _accumulate(
    state: TrainState,
    grads: Variables,
    count: jax.Array,
    aux: Aux,
    optimizer: optax.GradientTransformation,
    accumulation: int,
    ema: EMASpec | None,
    trainable_filter: LeafFilter,
) -> TrainState:
    variables = write_back(state.params, aux.updates)
    state = state.replace(params=variables, microstep=state.microstep + 1)
    if accumulation == 1:
        mean_grads = jax.tree.map(lambda g: _per(g, count), grads)
        return _optimize(state, mean_grads, optimizer, ema, trainable_filter)
    window = state.window
    assert window is not None
    window = Window(
        # in the window's dtype: gradients unscaled from a loss scale come back in float32
        grads=jax.tree.map(lambda held, g: (held + g).astype(held.dtype), window.grads, grads),
        count=window.count + count,
        filled=window.filled + 1,
    )

    def full(state: TrainState) -> TrainState:
        mean_grads = jax.tree.map(lambda g: _per(g, window.count), window.grads)
        state = _optimize(state, mean_grads, optimizer, ema, trainable_filter)
        empty = Window(
            grads=jax.tree.map(jnp.zeros_like, window.grads),
            count=jnp.zeros_like(window.count),
            filled=jnp.zeros_like(window.filled),
        )
        return state.replace(window=empty)

    def partial(state: TrainState) -> TrainState:
        return state.replace(window=window)

    return jax.lax.cond(window.filled >= accumulation, full, partial, state)


def _per(total: jax.Array, count: jax.Array) -> jax.Array:
    """A gradient summed over count examples, as their mean in the gradient's own dtype (a float32
    count would promote bfloat16 gradients, and with them the optimizer state they update)."""
    return (total / jnp.maximum(count, 1)).astype(total.dtype)


def _optimize(
    state: TrainState,
    grads: Variables,
    optimizer: optax.GradientTransformation,
    ema: EMASpec | None,
    trainable_filter: LeafFilter,
) -> TrainState:
    trainable = select(state.params, trainable_filter)
    updates, opt_state = optimizer.update(float16_widened(grads), state.opt_state, trainable)
    # The state keeps the dtypes it was created with (a schedule's float32 step size times a
    # bfloat16 moment is float32): a step must not change its own signature.
    opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype) if hasattr(old, "dtype") else new,
                             opt_state, state.opt_state)
    trainable = optax.apply_updates(trainable, updates)
    params = overlay(state.params, trainable)
    state = state.replace(params=params, opt_state=opt_state, updates=state.updates + 1)
    return follow_ema(state, ema, previous_updates=state.updates - 1)


def float16_widened(tree: Variables) -> Variables:
    """tree with its float16 leaves as float32: what the optimizer state of float16 weights is made
    from and updated with. In float16 an Adam second moment underflows (a gradient below 2e-4
    squares to zero) and the update divides by eps alone; bfloat16, with float32's exponent,
    stays as it is."""
    return jax.tree.map(lambda leaf: leaf.astype(jnp.float32) if leaf.dtype == jnp.float16 else leaf, tree)


def follow_ema(state: TrainState, ema: EMASpec | None, *, previous_updates: jax.Array) -> TrainState:
    """Move the EMA's leaves towards the live ones after an optimizer update."""
    if ema is None or state.ema is None:
        return state
    live = leaves_at(state.ema, state.params)
    return state.replace(ema=ema_update(state.ema, live, ema.rate(previous_updates)))
