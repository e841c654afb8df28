"""A plan of one training step: what each device holds, exchanges and computes, before any run.

``make_plan`` runs in an interpreter that sees the target's number of
devices (fake CPU devices: ``dew plan`` starts one). It builds the recipe's
parts and its Trainer, takes the trainer's own abstract placement (the
state as shapes with their shardings, checked by the layout's tolerance as
``place`` checks it; nothing is materialized), feeds one batch through the
trainer's own Feed (the rollout too, when the objective has one, which needs
the real fresh state), and compiles the trainer's own step for the mesh
with ``Trainer.compile``. From the compiled program it reads:

* the bytes per device of every state leaf, from its sharding (parameters,
  frozen copies, other variables, optimizer state, EMA, accumulation window,
  counters) and of the batch; these sum to XLA's own argument size;
* XLA's memory analysis: temporaries (activations and scratch), the output
  not aliased to a donated input, and the peak they make;
* the collectives one step runs, by kind, and the bytes they move, and the
  matmul FLOPs per device, both over every loop's trip count (``hlo``);
* the involuntary full rematerializations the SPMD partitioner reported,
  with the parameter each concerns (``remat``);
* with pipeline stages, the schedule's figures (``pipeline_figures``): its
  bubble and how many microbatches' activations a stage holds at the peak,
  beside which XLA's temporaries above are the measured peak.

Everything is returned as plain data (``Plan.as_json``) for the command to
print; the device kinds' step times and headroom are derived there.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dew.errors import DewError

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec, Sharding
    from jax.tree_util import KeyPath
    from jax.typing import DTypeLike

    from dew.objectives.base import LeafFilter
    from dew.recipes.config import RunConfig
    from dew.recipes.run import Parts
    from dew.training.placement.mesh import MeshSpec as _MeshSpec
    from dew.training.state import TrainState
    from dew.training.trainer import Trainer as _Trainer
    from dew.typing import PyTree

__all__ = ["CATEGORIES", "LeafBytes", "Plan", "PlanRefusedError", "PlanUnreadableError", "make_plan", "per_device_bytes",
           "pipeline_figures"]

# The state's parts, in the order a plan lists them.
CATEGORIES = ("parameters", "frozen", "variables", "optimizer", "ema", "accumulation", "counters", "batch")
DUMP = "DEW_PLAN_DUMP"  # where the child finds XLA's dump of the module before partitioning


class PlanRefusedError(DewError, ValueError):
    """The layout replicates more of the model than its tolerance allows; the plan names the leaves."""

    def __init__(self, message: str, leaves: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.leaves = leaves


class PlanUnreadableError(DewError, RuntimeError):
    """The compiled step says nothing a plan can read: a CPU-owned state's step joins two programs
    (Layout.host naming params), or XLA gave no memory analysis or text for it."""


@dataclass(frozen=True)
class LeafBytes:
    """One leaf of the step's inputs: its part of the state, shape, split and bytes on each device."""

    path: str
    category: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[tuple[str, ...] | None, ...]
    bytes: int
    memory: str = "device"


@dataclass(frozen=True)
class Plan:
    """What one step of a recipe holds, moves and computes on each device of a mesh."""

    recipe: str
    devices: int
    mesh: dict[str, int]
    leaves: tuple[LeafBytes, ...]
    memory: dict[str, int]
    collectives: dict[str, dict[str, int]]
    flops_per_device: int
    model_flops: float | None
    rematerializations: tuple[dict[str, Any], ...]
    batch_rows: int
    notes: tuple[str, ...] = field(default=())
    pipeline: dict[str, Any] | None = None

    def totals(self, memory: str = "device") -> dict[str, int]:
        """Bytes per device of each category, in that memory."""
        out = dict.fromkeys(CATEGORIES, 0)
        for leaf in self.leaves:
            if leaf.memory == memory:
                out[leaf.category] += leaf.bytes
        return out

    @property
    def peak(self) -> int:
        """XLA's figure for the step's peak on one device: inputs, output not aliased, temporaries."""
        m = self.memory
        return m["argument"] + m["output"] - m["alias"] + m["temporaries"]

    def as_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["totals"] = self.totals()
        body["host_totals"] = self.totals("pinned_host")
        body["peak"] = self.peak
        return body


def pipeline_figures(spec: _MeshSpec) -> dict[str, Any] | None:
    """A mesh spec's pipeline schedule in figures (None without stages): its kind, stages,
    microbatches and chunks per stage, the bubble, and the microbatch activations a stage holds at the
    peak, against GPipe's on the same stages and microbatches.

    >>> from dew.training.placement.mesh import MeshSpec
    >>> figures = pipeline_figures(MeshSpec(stage=4, microbatches=8, schedule="1f1b"))
    >>> figures["held"], figures["gpipe_held"], round(figures["bubble"], 3)
    (7, 11, 0.273)
    """
    from dew.training.placement.stages import schedule_of

    schedule = schedule_of(spec)
    if schedule.stages == 1:
        return None
    return {"schedule": schedule.kind, "stages": schedule.stages, "microbatches": schedule.count,
            "repeats": schedule.repeats, "bubble": schedule.bubble, "held": schedule.held,
            "gpipe_held": schedule.count + schedule.stages - 1}


def per_device_bytes(shape: tuple[int, ...], dtype: DTypeLike, sharding: Sharding) -> int:
    """Bytes one device holds of an array of shape and dtype under sharding."""
    import numpy as np

    return math.prod(sharding.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


@contextlib.contextmanager
def _stderr_into(path: Path) -> Iterator[None]:
    """Send this process's file descriptor 2 (where XLA's C++ warnings go) into path meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("wb") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _category(field_name: str, names: tuple[str, ...], leaf: PyTree, frozen: LeafFilter | None) -> str:
    """A state leaf's part: trainable parameters, what the objective declares frozen (a LoRA base, a
    reference, a teacher, whatever collection it sits in), other variables, or a field's own."""
    if field_name == "params":
        if frozen is not None and frozen(names, leaf):
            return "frozen"
        return "parameters" if names[:1] == ("params",) else "variables"
    return {"opt_state": "optimizer", "ema": "ema", "window": "accumulation"}.get(field_name, "counters")


def _spec(spec: PartitionSpec) -> tuple[tuple[str, ...] | None, ...]:
    """A PartitionSpec as plain data: per dimension, the mesh axes it is split over (None: whole)."""
    return tuple(None if axes is None else (axes,) if isinstance(axes, str) else tuple(axes) for axes in spec)


def _keys(path: KeyPath) -> tuple[str, ...]:
    import jax

    return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def _leaf_table(state: TrainState, batch: Mapping[str, Any], frozen: LeafFilter | None) -> list[LeafBytes]:
    import jax

    table = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        field_name = str(getattr(path[0], "name", path[0]))  # a JAX key entry: attribute ones have names
        category = _category(field_name, _keys(path[1:]), leaf, frozen)
        sharding = leaf.sharding
        table.append(LeafBytes(jax.tree_util.keystr(path), category, tuple(leaf.shape), str(leaf.dtype),
                               _spec(sharding.spec), per_device_bytes(leaf.shape, leaf.dtype, sharding),
                               sharding.memory_kind or "device"))
    for key, value in batch.items():
        table.append(LeafBytes(f"batch[{key!r}]", "batch", tuple(value.shape), str(value.dtype),
                               _spec(value.sharding.spec), per_device_bytes(value.shape, value.dtype, value.sharding)))
    return table


def _replicated(trainer: _Trainer) -> list[dict[str, Any]]:
    """The leaves the layout's tolerance counts, each with its bytes per device above perfect sharding."""
    import jax
    from flax import linen as nn

    mesh = trainer.device_mesh
    abstract = nn.meta.unbox(trainer.start.boxed)
    shardings = trainer.layout.shardings(mesh, trainer.start.boxed)
    axes = math.prod(mesh.shape.get(a, 1) for a in ("fsdp", "tensor"))
    rows = []
    for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                                      jax.tree.leaves(shardings), strict=True):
        size = math.prod(leaf.shape)
        if size < trainer.layout.min_shard:
            continue
        held = per_device_bytes(leaf.shape, leaf.dtype, sharding)
        perfect = size * leaf.dtype.itemsize // (axes * (mesh.shape.get("expert", 1) if "expert" in str(sharding.spec) else 1))
        if held > perfect:
            rows.append({"path": jax.tree_util.keystr(path), "shape": list(leaf.shape), "spec": str(sharding.spec),
                         "bytes": held, "perfect": perfect})
    return sorted(rows, key=lambda row: row["perfect"] - row["bytes"])


def _trainer(config: RunConfig, parts: Parts) -> _Trainer:
    import jax

    from dew.recipes.run import run_optimizer
    from dew.training.trainer import Trainer

    assert parts.dataset is not None  # build_parts loads the data unless asked not to
    steps = config.trainer.fit_arguments(parts.dataset.steps_per_epoch)["steps"]
    # The rollout an objective declares (Objective.rollout), as a recipe's run builds it; weights are not read.
    return Trainer.from_config(config.trainer, parts.objective, run_optimizer(config, steps),
                               key=jax.random.key(config.seed), rollout=parts.objective.rollout())


@contextlib.contextmanager
def _always_compiling() -> Iterator[None]:
    """Compile afresh even where a persistent compilation cache is set.

    The partitioner reports rematerializations on stderr only while it compiles; a program
    loaded from the cache would report nothing. JAX decides once per process whether it uses
    the cache, so the decision is reset on the way in and on the way out.
    """
    import jax
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    enabled = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]  # a flag read as JAX documents
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        reset_cache()


def make_plan(config: RunConfig, recipe: str) -> Plan:
    """Plan one step of config on this interpreter's devices (see the module docstring)."""
    import jax

    from dew.planning.hlo import Module
    from dew.planning.remat import attribute, before_partitioning, rematerializations
    from dew.recipes.run import build_parts
    from dew.training.feed import Feed
    from dew.training.placement.layout import LayoutError
    from dew.training.placement.mesh import data_partition

    notes = []
    if config.trainer.batch_ramp is not None:
        notes.append("the plan is for the full batch; the batch ramp's smaller batches need less")
        config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"batch_ramp": None})})
    if config.init is not None:
        notes.append("the starting weights (init) are not read; the plan's shapes are a fresh init's")
    if config.model is not None and config.model.fields.get("attention") == "cudnn":
        from dew.nn.layers import check_fused_attention

        check_fused_attention(("sequence",) if config.trainer.mesh.sequence > 1 else (), "gpu")  # as the GPU runs it
        notes.append("cuDNN attention needs a GPU, and the plan compiles on CPU devices: it planned XLA's "
                     "attention (the same weights); cuDNN's fused kernel holds less activation memory")
        model = type(config.model).model_validate({**config.model.model_dump(), "attention": "xla"})
        config = config.model_copy(update={"model": model})
    parts = build_parts(config)
    computes = getattr(parts.model, "dtype", None)  # any flax Module; dew's decoders name their compute dtype
    import numpy as np

    if computes is not None and np.dtype(computes) == np.float32:
        notes.append("the model computes in float32, and a device kind's compute-bound step uses its bf16 peak: "
                     "float32 matmuls run at TF32 rates or below on a GPU (half the bf16 peak or less), a "
                     "fraction of it on a TPU; set model.dtype=bfloat16 to plan the step those peaks describe")
    if config.lora is not None:
        notes.append("with lora, the objective's own count of the model's FLOPs is a full fine-tune's (6 per "
                     "weight per token, as MFU is usually reported); the step computes no gradient of the frozen "
                     "base's weights, so its matmuls are nearer 4 per weight per token, as XLA's count shows")
    trainer = _trainer(config, parts)
    mesh = trainer.device_mesh
    try:
        state, _ = trainer.abstract_placement()
    except LayoutError as error:
        raise PlanRefusedError(str(error), _replicated(trainer)) from error
    objective = parts.objective
    assert parts.dataset is not None  # build_parts loads it (with_data defaults to True)
    feed = Feed(parts.dataset, mesh, data_partition(mesh), required=tuple(objective.required_keys()),
                rollout=trainer.rollout, check=objective.check_batch)
    feed.open(None, resuming=False)
    try:
        live = trainer.place()[0] if trainer.rollout is not None else state  # a rollout samples with weights
        from dew.training.state import TrainState

        assert isinstance(live, TrainState)  # place() outside fit builds a fresh state here and now
        fed = feed.next(live, 0)
    finally:
        feed.close()
    if trainer.rollout is not None:
        notes.append("the batch is the rollout's, sampled once from the fresh state")
    log = Path(tempfile.mkstemp(prefix="dew-plan-", suffix=".log")[1])
    try:
        with _stderr_into(log), _always_compiling():
            compiled = trainer.compile(state, fed.batch).executable
        warnings = log.read_text(errors="replace")
    finally:
        log.unlink(missing_ok=True)
    if not isinstance(compiled, jax.stages.Compiled):
        raise PlanUnreadableError(
            "The plan reads one compiled program's memory analysis, but this layout keeps params on the "
            "host (Layout.host), whose step joins two programs. Plan the run without Layout.host.")
    analysis, text = compiled.memory_analysis(), compiled.as_text()
    if analysis is None or text is None:
        raise PlanUnreadableError(f"XLA gave no memory analysis or text for the compiled step on "
                                  f"{jax.default_backend()}; the plan cannot size it.")
    memory = {
        "argument": analysis.argument_size_in_bytes, "output": analysis.output_size_in_bytes,
        "alias": analysis.alias_size_in_bytes, "temporaries": analysis.temp_size_in_bytes,
        "code": analysis.generated_code_size_in_bytes,
        "host_argument": analysis.host_argument_size_in_bytes, "host_temporaries": analysis.host_temp_size_in_bytes,
    }
    module = Module.parse(text)
    leaves = _leaf_table(state, fed.batch, objective.frozen)
    found = rematerializations(warnings)
    dump = os.environ.get(DUMP)
    if found:
        names = [leaf.path for leaf in leaves]
        found = attribute(found, before_partitioning(Path(dump)) if dump else None, names)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in fed.batch.items()}
    model_flops = objective.flops(shapes)
    return Plan(
        recipe=recipe, devices=len(jax.devices()), mesh=dict(mesh.shape), leaves=tuple(leaves), memory=memory,
        collectives={kind: {"count": c.count, "bytes": c.bytes} for kind, c in module.collectives().items()},
        flops_per_device=module.matmul_flops(), model_flops=None if model_flops is None else float(model_flops),
        rematerializations=tuple({**asdict(r), "describe": r.describe()} for r in found),
        batch_rows=fed.rows, notes=tuple(notes), pipeline=pipeline_figures(config.trainer.mesh),
    )
