"""A scanned decoder stack, and the schedules that run it over pipeline stages.

A scanned stack stores every layer's parameters stacked on a leading
``layers`` axis (one array per weight instead of one per layer), which the
Layout's ``layers`` rule splits over the ``stage`` mesh axis. The stored tree
is the same whatever the mesh: only how a step runs it changes.

Outside a pipeline schedule (or at init) the stack is one ``scan`` over the
layers. Inside ``pipeline(PipelineSchedule(stages, microbatches))``, which the trainer
opens while it compiles its step, the layers are viewed as ``[stages,
layers_per_stage]`` and the batch as ``microbatches`` slices; every iteration
each stage runs its layers on the slice it holds, then hands its output to
the next stage (a shift along the stage-sharded dimension, a collective
permute under GSPMD). A stage is idle (runs on zeros) for ``stages - 1`` of
the ``microbatches + stages - 1`` iterations: that share is the bubble.

>>> import jax, jax.numpy as jnp
>>> from dew.nn.backbones import CausalTransformer
>>> model = CausalTransformer(vocab_size=16, emb_features=8, num_layers=4, num_heads=2,
...                           mlp_features=16, max_seq_len=8, scan_layers=True)
>>> tokens = jnp.ones((4, 8), jnp.int32)
>>> variables = model.init(jax.random.key(0), tokens)
>>> variables["params"]["layers"]["mlp"]["wi"].value.shape  # layers stacked in front
(4, 8, 16)
>>> with pipeline(PipelineSchedule(stages=2, microbatches=4)):
...     piped = model.apply(variables, tokens)
>>> bool(jnp.allclose(piped, model.apply(variables, tokens), atol=1e-5))
True
>>> PipelineSchedule(stages=2, microbatches=4).bubble  # (2 - 1) / (4 + 2 - 1)
0.2

That is GPipe: the backward is JAX's autodiff of the loop, so it starts once
every microbatch is through, and every iteration's activations stay alive
until then. The 1F1B family (``kind="1f1b"``, and interleaved with
``repeats`` chunks per device) needs the loss inside the schedule instead: a
microbatch's backward starts as soon as its loss is known. That is the
step's business (dew.nn.pipeline_step); a model takes part through
``stack_session``, which lets the step run the model's stack in pieces.
Outside a step (evaluation, generation) a 1F1B schedule runs forward as
GPipe does, which computes the same function.

>>> PipelineSchedule(stages=4, microbatches=8, kind="1f1b", repeats=2).bubble  # 3 / (2 * 8 + 3)
0.15789473684210525
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.errors import DewError
from dew.nn import sharding as axes
from dew.nn.sharding import constrain
from dew.typing import PyTree

__all__ = [
    "SCHEDULES",
    "MicrobatchError",
    "PipelineSchedule",
    "StackSession",
    "StageDivisionError",
    "StackSessionError",
    "StagedRoutingError",
    "current_schedule",
    "join_microbatches",
    "pipeline",
    "run_stack",
    "split_microbatches",
    "stack_layers",
    "stack_session",
    "unstack_layers",
]

SCHEDULES = ("gpipe", "1f1b")


class StageDivisionError(DewError, ValueError):
    """The pipeline stages do not divide a scanned stack's layers."""


class StagedRoutingError(DewError, ValueError):
    """Mixture-of-experts layers were asked for their routing statistics inside pipeline stages."""


class MicrobatchError(DewError, ValueError):
    """The microbatches do not divide a batch, or are not a multiple of the stages."""


class StackSessionError(DewError, ValueError):
    """A step asked to run a model's stack in pieces (1F1B), but the model's call cannot be cut so."""


@dataclass(frozen=True)
class PipelineSchedule:
    """How a scanned stack is pipelined: stages (the mesh's stage axis), microbatches, and the kind.

    microbatches None means one per stage, the smallest schedule. kind
    "gpipe" runs every forward, then JAX's autodiff of them; "1f1b"
    interleaves each microbatch's backward with later forwards, and with
    repeats above 1 each device holds that many chunks of the stack (virtual
    stages), which a microbatch visits lap by lap around the stage ring.
    """

    stages: int = 1
    microbatches: int | None = None
    kind: Literal["gpipe", "1f1b"] = "gpipe"
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"PipelineSchedule.stages must be at least 1, got {self.stages}.")
        if self.microbatches is not None and (self.microbatches < 1
                                              or self.microbatches % self.stages):
            raise MicrobatchError(
                f"microbatches={self.microbatches} is not a positive multiple of stage="
                f"{self.stages}; set MeshSpec.microbatches to {self.stages}, "
                f"{2 * self.stages}, {4 * self.stages}, ... or leave it None (one per stage)."
            )
        if self.kind not in SCHEDULES:
            raise ValueError(f"Unknown pipeline schedule {self.kind!r}; use one of "
                             f"{', '.join(map(repr, SCHEDULES))}.")
        if self.repeats < 1 or (self.repeats > 1 and self.kind != "1f1b"):
            raise ValueError(
                f"repeats={self.repeats} chunks per device interleave a 1F1B schedule; use "
                f"kind='1f1b' with repeats above 1, or repeats=1 (got kind={self.kind!r}).")

    @property
    def interleaves(self) -> bool:
        """Whether backwards interleave with forwards: the step, not autodiff, runs the schedule."""
        return self.kind == "1f1b" and self.stages > 1

    @property
    def chunks(self) -> int:
        """How many pieces the stack is cut into: stages times repeats."""
        return self.stages * self.repeats

    @property
    def held(self) -> int:
        """Microbatch activations a device holds at the peak, in units of one microbatch's.

        GPipe's autodiff keeps every loop iteration's activations inside the
        layers; 1F1B keeps only each in-flight chunk's input (and recomputes
        the chunk in its backward), this many at most.
        """
        if not self.interleaves:
            return self.iterations if self.stages > 1 else 1
        from dew.nn.timetable import timetable

        return timetable(self.stages, self.count, self.repeats).slots

    @property
    def count(self) -> int:
        """The number of microbatches a step is cut into."""
        return self.microbatches or self.stages

    @property
    def iterations(self) -> int:
        """Forward iterations: every microbatch passes every chunk once, the ring filling and emptying."""
        return self.repeats * self.count + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of stage-iterations spent idle: (stages - 1) / (repeats * microbatches + stages - 1)."""
        return (self.stages - 1) / self.iterations


_CURRENT: contextvars.ContextVar[PipelineSchedule | None] = contextvars.ContextVar("dew_pipeline",
                                                                           default=None)


@contextlib.contextmanager
def pipeline(schedule: PipelineSchedule) -> Iterator[PipelineSchedule]:
    """Run scanned stacks traced inside this block under schedule."""
    token = _CURRENT.set(schedule)
    try:
        yield schedule
    finally:
        _CURRENT.reset(token)


def current_schedule() -> PipelineSchedule:
    """The schedule a scanned stack traced now runs under (one stage outside ``pipeline``)."""
    return _CURRENT.get() or PipelineSchedule()


@dataclass
class StackSession:
    """How the one stack a model call runs is cut out of it, for a step that schedules it itself.

    mode "capture": the stack does nothing (returns its input) and records
    what it was given, ``found = (x, positions, segment_ids, stack_params)``;
    "inject": the stack returns ``value`` instead of computing; "stage": the
    stack runs a chunk of its layers, ``value = (chunk_params, x, positions,
    segment_ids)``, on those inputs instead of its own, and leaves the output
    in ``result``. In every mode the rest of the call runs as usual, which
    the step then ignores where it does not need it.
    """

    mode: Literal["capture", "inject", "stage"]
    value: PyTree = None
    found: tuple[PyTree, ...] | None = None
    result: PyTree = None
    calls: int = 0


_SESSION: contextvars.ContextVar[StackSession | None] = contextvars.ContextVar("dew_stack_session",
                                                                              default=None)


@contextlib.contextmanager
def stack_session(mode: Literal["capture", "inject", "stage"], value: PyTree = None) -> Iterator[StackSession]:
    """Run the scanned stacks traced inside this block as session says (see StackSession)."""
    session = StackSession(mode, value)
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)


def _body(layer_class: type[nn.Module], decode: bool) -> type[nn.Module]:
    """layer_class as a scan body: (x, positions, segment_ids) -> (x, None)."""

    class Scanned(layer_class):
        @nn.compact
        def __call__(self, x: jax.Array, positions: jax.Array,
                     segment_ids: jax.Array | None) -> tuple[jax.Array, None]:
            if decode:
                return layer_class.__call__(self, x, positions, decode=True), None
            return layer_class.__call__(self, x, positions, segment_ids=segment_ids), None

    Scanned.__name__ = f"Scanned{layer_class.__name__}"
    return Scanned


def run_stack(
    parent: nn.Module,
    layer_class: type[nn.Module],
    num_layers: int,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    *,
    name: str = "layers",
    decode: bool = False,
    wrap: Callable[[type[nn.Module]], type[nn.Module]] = lambda c: c,
    **layer_kwargs: Any,
) -> jax.Array:
    """Apply num_layers layers of layer_class to x as one stack stored under name.

    Call from parent's compact method. wrap (rematerialization, say) is applied
    to the scan body. Under a pipeline schedule with more than one stage the
    stack runs as a GPipe pipeline; at init, with one stage, and when decoding
    (each layer's key/value cache stacked like its parameters), as a plain scan.
    """
    schedule = current_schedule()
    body = _body(layer_class, decode)
    body = body if decode else wrap(body)
    # An MoE layer's routing statistics ("moe") are sown once per layer: stacked like the weights.
    scan = {"variable_axes": {"params": 0, "cache": 0, "moe": 0}, "split_rngs": {"params": True},
            "in_axes": (nn.broadcast, nn.broadcast),
            "metadata_params": {nn.PARTITION_NAME: axes.LAYERS}}
    session = _SESSION.get()
    if session is not None and not decode and not parent.is_initializing():
        chunk_scan = {**scan, "variable_axes": {"params": 0}, "metadata_params": {}}
        return _in_session(session, parent, body, chunk_scan, name, layer_kwargs, x, positions,
                           segment_ids)
    if schedule.stages == 1 or decode or parent.is_initializing():
        stack = nn.scan(body, length=num_layers, **scan)(name=name, **layer_kwargs)
        return stack(x, positions, segment_ids)[0]

    stages, count = schedule.stages, schedule.count
    if parent.is_mutable_collection("moe"):
        raise StagedRoutingError(
            "A stack of mixture-of-experts layers cannot report its routing statistics (the "
            "balance loss an objective trains on) from inside pipeline stages: the stages' idle "
            "iterations would count too. Run the experts without the stage axis (MeshSpec.stage=1).")
    if num_layers % stages:
        raise StageDivisionError(
            f"A stack of {num_layers} layers cannot be split into stage={stages} pipeline "
            f"stages; choose a stage count that divides {num_layers} (or a layer count that "
            f"{stages} divides)."
        )
    batch = x.shape[0]
    if batch % count:
        raise MicrobatchError(
            f"A batch of {batch} rows cannot be cut into microbatches={count}; choose a batch "
            f"size that {count} divides, or set MeshSpec.microbatches to a divisor of {batch} "
            f"that is a multiple of stage={stages}."
        )
    per_stage = num_layers // stages

    def to_stages(tree: PyTree) -> PyTree:  # boxes dropped: the stages read plain arrays
        return jax.tree.map(lambda a: a.reshape(stages, per_stage, *a.shape[1:]),
                            nn.meta.unbox(tree))

    def from_stages(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda a: a.reshape(num_layers, *a.shape[2:]), tree)

    stage_scan = nn.scan(body, length=per_stage,
                         **{**scan, "variable_axes": {"params": 0}, "metadata_params": {}})
    stage_map = nn.vmap(stage_scan, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(0, 0, 0), out_axes=0, spmd_axis_name="stage")
    stack = nn.map_variables(stage_map, "params", trans_in_fn=to_stages,
                             trans_out_fn=from_stages)(name=name, **layer_kwargs)
    return _gpipe(stack, stages, count, x, positions, segment_ids)


def _in_session(session: StackSession, parent: nn.Module, body: type[nn.Module], scan: dict[str, Any],
                name: str, layer_kwargs: dict[str, Any], x: jax.Array, positions: jax.Array,
                segment_ids: jax.Array | None) -> jax.Array:
    """run_stack's part in a StackSession: record, stand in, or run one chunk of the layers."""
    session.calls += 1
    if session.calls > 1:
        raise StackSessionError(
            "A 1F1B pipeline schedule cuts one layer stack per loss into stages, but this loss runs "
            f"{session.calls} stacks (several models, or one model called several times). Use "
            "MeshSpec(schedule='gpipe'), which pipelines each call on its own.")
    if session.mode == "capture":
        mutable = parent.scope.mutable if parent.scope is not None else False
        if mutable not in (False, None, (), []):
            raise StackSessionError(
                f"A 1F1B pipeline schedule runs the layer stack as a function of its parameters alone, "
                f"but this model is called with the collections {mutable!r} mutable (a mixture of "
                "experts' balance statistics, say), which the stack's layers would write. Use "
                "MeshSpec(schedule='gpipe') for this model.")
        session.found = (x, positions, segment_ids, nn.meta.unbox(parent.variables["params"][name]))
        return x
    if session.mode == "inject":
        return session.value
    chunk, inputs, where, segments = session.value
    length = jax.tree.leaves(chunk)[0].shape[0]
    runner = nn.map_variables(nn.scan(body, length=length, **scan), "params",
                              trans_in_fn=lambda _: {"params": chunk})(name=name, **layer_kwargs)
    session.result = runner(inputs, where, segments)[0]
    return x


def split_microbatches(a: jax.Array, count: int) -> jax.Array:
    """[B, ...] as [count, B // count, ...], microbatch m holding rows m, m + count, ...

    Rows interleave so that every microbatch keeps the batch sharding's row
    blocks, and cutting the batch moves no data between devices.
    """
    return a.reshape(a.shape[0] // count, count, *a.shape[1:]).swapaxes(0, 1)


def join_microbatches(a: jax.Array) -> jax.Array:
    """The inverse of split_microbatches."""
    return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _gpipe(stack: nn.Module, stages: int, count: int, x: jax.Array, positions: jax.Array,
           segment_ids: jax.Array | None) -> jax.Array:
    """Run every microbatch through every stage: iteration t feeds microbatch t to stage 0,
    and stage s works on microbatch t - s (on zeros where there is none).

    The iterations are one scan (the stack's parameters broadcast to each), so the step
    compiles one iteration whatever the number of microbatches.
    """
    state_axes = (axes.LAYERS, axes.BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED)
    iterations = count + stages - 1

    def fed(a: jax.Array) -> jax.Array:
        """The microbatch stage 0 takes at each iteration (past the last it idles on a copy)."""
        cut = split_microbatches(a, count)
        return cut[jnp.minimum(jnp.arange(iterations), count - 1)]

    feeds = (fed(x), fed(positions), None if segment_ids is None else fed(segment_ids))
    rows = feeds[0].shape[1]
    carry = (
        jnp.zeros((stages, rows, *x.shape[1:]), x.dtype),
        jnp.zeros((stages, rows, positions.shape[1]), positions.dtype),
        None if segment_ids is None else jnp.zeros((stages, rows, segment_ids.shape[1]),
                                                   segment_ids.dtype),
    )

    def shifted(carried: jax.Array | None, fresh: jax.Array | None) -> jax.Array | None:
        if carried is None or fresh is None:
            return None
        return jnp.roll(carried, 1, axis=0).at[0].set(fresh)

    # n: the stages (in the carried state) or the iterations (in the scan's outputs)
    def iteration(module: nn.Module, carry: tuple, feed: tuple) -> tuple[tuple, jax.Array]:
        state_nbtd, where_nbt, segments_nbt = (shifted(c, f) for c, f in zip(carry, feed, strict=True))
        assert state_nbtd is not None  # the carried state always has both halves
        state_nbtd = constrain(state_nbtd, state_axes)
        state_nbtd = constrain(module(state_nbtd, where_nbt, segments_nbt)[0], state_axes)
        return (state_nbtd, where_nbt, segments_nbt), state_nbtd[stages - 1]

    loop = nn.scan(iteration, variable_broadcast="params", split_rngs={"params": False},
                   length=iterations)
    _, finished_nbtd = loop(stack, carry, feeds)
    return join_microbatches(finished_nbtd[stages - 1:])


def unstack_layers(params: Mapping[str, PyTree], num_layers: int, name: str = "layers") -> dict[str, PyTree]:
    """params with the stack under name split into num_layers entries name_0, name_1, ...

    The tree an unscanned model of the same configuration holds, which is
    what formats that number their layers (Hugging Face's) are written from.

    >>> import numpy as np
    >>> flat = unstack_layers({"layers": {"w": np.arange(6).reshape(3, 2)}, "head": 1}, 3)
    >>> sorted(flat), flat["layers_2"]["w"].tolist()
    (['head', 'layers_0', 'layers_1', 'layers_2'], [4, 5])
    """
    out = {key: value for key, value in params.items() if key != name}
    stack = params[name]
    for i in range(num_layers):
        out[f"{name}_{i}"] = jax.tree.map(lambda a, i=i: a[i], stack)
    return out


def stack_layers(params: Mapping[str, PyTree], num_layers: int, name: str = "layers") -> dict[str, PyTree]:
    """The inverse of unstack_layers: name_0 ... name_{n-1} stacked into one entry name.

    >>> import numpy as np
    >>> flat = {"layers_0": {"w": np.zeros(2)}, "layers_1": {"w": np.ones(2)}}
    >>> stack_layers(flat, 2)["layers"]["w"].tolist()
    [[0.0, 0.0], [1.0, 1.0]]
    """
    names = [f"{name}_{i}" for i in range(num_layers)]
    out = {key: value for key, value in params.items() if key not in names}
    out[name] = jax.tree.map(lambda *layers: jnp.stack(layers), *(params[n] for n in names))
    return out
