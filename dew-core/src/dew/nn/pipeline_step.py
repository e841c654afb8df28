"""A step's loss and gradients under a 1F1B pipeline schedule: backwards interleaved with forwards.

GPipe leaves the backward to JAX's autodiff of the forward loop, so it can
only start once every microbatch is through, and every loop iteration's
activations wait for it. 1F1B starts a microbatch's backward as soon as its
loss is known, which needs the loss inside the schedule: this function runs
the whole step's differentiation itself, microbatch by microbatch, in the
rounds of a ``dew.nn.timetable``.

The loss is the objective's own, called per microbatch. A model takes part
through ``dew.nn.pipeline.stack_session``, which cuts its one scanned stack
out of the call, giving three functions of the same loss:

* the embedding (``capture``): the loss up to the stack, whose input it records;
* a chunk (``stage``): a few of the stack's layers, on inputs the step gives;
* the head (``inject``): the loss from the stack's output on, given that output.

Every round each device of the ``stage`` axis runs one chunk forward on one
microbatch and one chunk backward on another (``vmap`` over the stages, as
GPipe's loop is). A forward keeps only its chunk's input in a stash slot;
the backward recomputes the chunk from it under ``jax.vjp``. So a device
holds ``timetable.slots`` chunk inputs (at most ``2 * stages - 1``) and one
microbatch's activations inside a chunk at a time, where GPipe holds every
iteration's activations inside its layers; the price is one more forward of
the stack, as with full rematerialization. Rounds whose forward (or
backward) half no device runs skip it (``lax.cond`` on a per-round flag),
so the bubble is the timetable's.

The loss must be a sum over its rows (dew's objectives return a ``Mean``
total): it is scored one microbatch at a time, and the totals, the
auxiliary outputs and the gradients are summed over the microbatches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import sharding as axes
from dew.nn.pipeline import (
    MicrobatchError,
    PipelineSchedule,
    StackSessionError,
    StageDivisionError,
    split_microbatches,
    stack_session,
)
from dew.nn.sharding import constrain
from dew.nn.timetable import Timetable, timetable
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.nn.pipeline import StackSession

__all__ = ["pipelined_gradients"]

Loss = Callable[[PyTree, PyTree], tuple[jax.Array, PyTree]]
_STATE = (axes.LAYERS, axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED)
_STASH = (axes.LAYERS, None, axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED)


def _add(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(jnp.add, a, b)


def _cut(batch: PyTree, count: int) -> PyTree:
    """Every leaf with rows as [count, rows // count, ...] (scalars stay whole)."""
    def one(a: PyTree) -> PyTree:
        a = jnp.asarray(a)
        if a.ndim == 0:
            return a
        if a.shape[0] % count:
            raise MicrobatchError(
                f"A batch of {a.shape[0]} rows cannot be cut into microbatches={count}; choose a batch "
                f"size that {count} divides, or set MeshSpec.microbatches to a divisor of {a.shape[0]} "
                "that is a multiple of stage.")
        return split_microbatches(a, count)

    return jax.tree.map(one, batch)


def _rows(cut: PyTree, index: PyTree) -> PyTree:
    """Microbatch index (a traced integer) of a cut batch."""
    return jax.tree.map(lambda a: a if a.ndim == 0 else jax.lax.dynamic_index_in_dim(a, index, 0, False), cut)


def _found(session: StackSession) -> tuple[PyTree, ...]:
    if session.found is None:
        raise StackSessionError(
            "A 1F1B pipeline schedule cuts the model's scanned layer stack into stages, but the loss ran "
            "no scanned stack. Build the model with scan_layers=True, or use MeshSpec(schedule='gpipe') (in a "
            "recipe, model.scan_layers=true or trainer.mesh.schedule=gpipe).")
    return session.found


def _pick(tree: PyTree, index: jax.Array) -> PyTree:
    """Per device (leading axis), the entry index[device] of the next axis."""
    return jax.tree.map(lambda a: jax.vmap(lambda row, i: row[i])(a, index), tree)


def _put(tree: PyTree, index: jax.Array, update: PyTree) -> PyTree:
    """Per device, tree[device, index[device]] += update[device]."""
    return jax.tree.map(lambda a, u: jax.vmap(lambda row, i, v: row.at[i].add(v))(a, index, u), tree, update)


def _stash_write(stash: PyTree, slot: jax.Array, value: PyTree) -> PyTree:
    return jax.tree.map(lambda s, v: jax.vmap(lambda row, i, x: row.at[i].set(x))(s, slot, v), stash, value)


def pipelined_gradients(loss: Loss, params: PyTree, batch: PyTree,
                        schedule: PipelineSchedule) -> tuple[PyTree, tuple[jax.Array, PyTree]]:
    """The gradient of the summed loss over params, and (the summed loss, the summed aux).

    loss(params, rows) -> (scalar, aux) scores a batch of rows; schedule is
    a 1F1B one (``schedule.interleaves``). Called inside ``jax.jit``, under
    the mesh and rules the step compiles with.
    """
    stages, count, repeats = schedule.stages, schedule.count, schedule.repeats
    cut = _cut(batch, count)
    first = _rows(cut, 0)

    def embed(p: PyTree, rows: PyTree) -> tuple[jax.Array, tuple[PyTree, PyTree]]:
        with stack_session("capture") as session:
            loss(p, rows)
        x, where, segments, _ = _found(session)
        return x, (where, segments)

    def stack_of(p: PyTree) -> PyTree:
        with stack_session("capture") as session:
            loss(p, first)
        return _found(session)[3]

    def head(p: PyTree, rows: PyTree, y: jax.Array) -> tuple[jax.Array, PyTree]:
        with stack_session("inject", y):
            return loss(p, rows)

    def chunk(weights: PyTree, x: jax.Array, where: jax.Array, segments: PyTree) -> jax.Array:
        with stack_session("stage", (weights, x, where, segments)) as session:
            loss(params, first)
        return session.result

    stack, pull = jax.vjp(stack_of, params)
    depth = jax.tree.leaves(stack)[0].shape[0]
    if depth % schedule.chunks:
        raise StageDivisionError(
            f"A stack of {depth} layers cannot be cut into stage={stages} x circular_repeats={repeats} = "
            f"{schedule.chunks} chunks; choose a stage count and repeats whose product divides {depth}.")
    per = depth // schedule.chunks
    # Layer k*per ... (k+1)*per - 1 is chunk k = lap * stages + device: laid out [device, lap, layer].
    staged = jax.tree.map(
        lambda a: a.reshape(repeats, stages, per, *a.shape[1:]).swapaxes(0, 1), stack)
    table = timetable(stages, count, repeats)

    x0, (where0, segments0) = jax.eval_shape(embed, params, first)
    zero_state = (
        jnp.zeros((stages, *x0.shape), x0.dtype),
        jnp.zeros((stages, *where0.shape), where0.dtype),
        None if segments0 is None else jnp.zeros((stages, *segments0.shape), segments0.dtype),
    )
    stash = jax.tree.map(lambda a: jnp.zeros((a.shape[0], table.slots + 1, *a.shape[1:]), a.dtype),
                         zero_state)
    value0, aux0 = jax.eval_shape(lambda p: head(p, first, jnp.zeros(x0.shape, x0.dtype)), params)
    carry = {
        "state": zero_state,
        "cotangent": jnp.zeros((stages, *x0.shape), x0.dtype),
        "stash": stash,
        "stack_grads": jax.tree.map(jnp.zeros_like, staged),
        "grads": jax.tree.map(jnp.zeros_like, params),
        "value": jnp.zeros(value0.shape, value0.dtype),
        "aux": jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux0),
    }
    stage_forward = jax.vmap(chunk, spmd_axis_name="stage")

    def stage_backward(weights: PyTree, x: jax.Array, where: jax.Array, segments: PyTree,
                       cotangent: jax.Array) -> tuple[PyTree, jax.Array]:
        _, back = jax.vjp(lambda w, h: chunk(w, h, where, segments), weights, x)
        return back(cotangent)

    stage_backward = jax.vmap(stage_backward, spmd_axis_name="stage")
    rows = _round_inputs(table)

    def forward_half(c: dict[str, PyTree], now: dict[str, jax.Array]) -> tuple[dict[str, PyTree], jax.Array]:
        prev_x, prev_where, prev_segments = c["state"]  # only the segments may be absent
        x, where = jnp.roll(prev_x, 1, axis=0), jnp.roll(prev_where, 1, axis=0)
        segments = None if prev_segments is None else jnp.roll(prev_segments, 1, axis=0)

        def fresh() -> tuple[jax.Array, tuple[PyTree, PyTree]]:
            return embed(params, _rows(cut, now["forward_microbatch"][0]))

        def carried() -> tuple[jax.Array, tuple[PyTree, PyTree]]:
            return x[0], (where[0], None if segments is None else segments[0])

        x0, (w0, s0) = jax.lax.cond(now["fresh"], fresh, carried)
        x, where = x.at[0].set(x0), where.at[0].set(w0)
        segments = None if segments is None else segments.at[0].set(s0)
        x = constrain(x, _STATE)
        inputs = (x, where, segments)
        stash = _stash_write(c["stash"], now["forward_slot"], inputs)
        y = constrain(stage_forward(_pick(staged, now["forward_lap"]), x, where, segments), _STATE)
        held, *rest = stash
        c = {**c, "state": (y, where, segments), "stash": (constrain(held, _STASH), *rest)}

        def scored(c: dict[str, PyTree]) -> tuple[dict[str, PyTree], jax.Array]:
            rows_now = _rows(cut, now["forward_microbatch"][-1])
            value, back, aux = jax.vjp(lambda p, h: head(p, rows_now, h), params, y[-1], has_aux=True)
            grads, gy = back(jnp.ones_like(value))
            return {**c, "grads": _add(c["grads"], grads), "value": c["value"] + value,
                    "aux": _add(c["aux"], aux)}, gy

        def unscored(c: dict[str, PyTree]) -> tuple[dict[str, PyTree], jax.Array]:
            return c, jnp.zeros(x0.shape, x0.dtype)

        return jax.lax.cond(now["finished"], scored, unscored, c)

    def backward_half(c: dict[str, PyTree], now: dict[str, jax.Array], gy: jax.Array) -> dict[str, PyTree]:
        cotangent = jnp.roll(c["cotangent"], -1, axis=0)
        cotangent = constrain(cotangent.at[-1].set(jnp.where(now["finished"], gy, cotangent[-1])), _STATE)
        x, where, segments = _pick(c["stash"], now["backward_slot"])
        weights = _pick(staged, now["backward_lap"])
        dweights, dx = stage_backward(weights, x, where, segments, cotangent)
        live = now["backward_microbatch"] >= 0
        dweights = jax.tree.map(lambda g: jnp.where(live.reshape(-1, *[1] * (g.ndim - 1)), g, 0), dweights)
        c = {**c, "cotangent": constrain(dx, _STATE),
             "stack_grads": _put(c["stack_grads"], now["backward_lap"], dweights)}

        def returned(c: dict[str, PyTree]) -> dict[str, PyTree]:
            rows_now = _rows(cut, now["backward_microbatch"][0])
            _, back = jax.vjp(lambda p: embed(p, rows_now)[0], params)
            return {**c, "grads": _add(c["grads"], back(_whole_rows_if_uneven(dx[0]))[0])}

        return jax.lax.cond(now["returned"], returned, lambda c: c, c)

    def one_round(c: dict[str, PyTree], now: dict[str, jax.Array]) -> tuple[dict[str, PyTree], None]:
        zero = jnp.zeros(x0.shape, x0.dtype)
        c, gy = jax.lax.cond(now["forwards"], forward_half, lambda c, now: (c, zero), c, now)
        c = jax.lax.cond(now["backwards"], backward_half, lambda c, now, gy: c, c, now, gy)
        return c, None

    done, _ = jax.lax.scan(one_round, carry, rows)
    stacked = jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(depth, *a.shape[3:]), done["stack_grads"])
    (from_stack,) = pull(stacked)
    return _add(done["grads"], from_stack), (done["value"], done["aux"])


def _whole_rows_if_uneven(cotangent: jax.Array) -> jax.Array:
    """cotangent, its rows gathered onto every device when they do not split evenly over the batch axes.

    A microbatch may have fewer rows than there are batch shards. XLA's CPU
    partitioner then pads the rows, and its backward of the embedding lookup
    (a scatter-add) came out wrong in that case (measured on jax 0.10.2); one
    microbatch's cotangent, whole, is a small gather.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return cotangent
    import flax.linen as nn

    mapped = nn.logical_to_mesh_axes((axes.BATCH,))[0]
    names = (mapped,) if isinstance(mapped, str) else tuple(mapped or ())
    ways = int(np.prod([dict(mesh.shape).get(name, 1) for name in names]))
    if cotangent.shape[0] % ways == 0:
        return cotangent
    return constrain(cotangent, (None, *[None] * (cotangent.ndim - 1)))


def _round_inputs(table: Timetable) -> dict[str, jax.Array]:
    """The timetable as the scan's per-round inputs."""
    columns = {
        "forward_microbatch": table.forward_microbatch, "forward_lap": table.forward_lap,
        "forward_slot": table.forward_slot, "backward_microbatch": table.backward_microbatch,
        "backward_lap": table.backward_lap, "backward_slot": table.backward_slot,
        "fresh": table.fresh, "finished": table.finished, "returned": table.returned,
        "forwards": table.forwards, "backwards": table.backwards,
    }
    return {name: jnp.asarray(np.asarray(column)) for name, column in columns.items()}
