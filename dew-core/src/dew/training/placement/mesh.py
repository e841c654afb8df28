"""The six-axis device mesh, and how a global batch splits over it.

Parameters shard over 'fsdp', 'expert' and 'tensor'; a batch's rows split
over 'data', 'fsdp' and 'expert' (BATCH_AXES), its positions over 'sequence',
and 'stage' would split pipeline stages. Axes of size 1 cost nothing, so one
code path serves every topology.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from numpy.typing import ArrayLike

from dew.data.base import DataPartition
from dew.errors import BatchKeyError, DewError

__all__ = [
    "BATCH_AXES",
    "BATCH_SPEC",
    "MESH_AXES",
    "BatchMismatchError",
    "BatchSplitError",
    "CPUDeviceCountError",
    "MeshSizeError",
    "MeshSpec",
    "ReplicaError",
    "batch_shardings",
    "build_mesh",
    "companion_mesh",
    "data_partition",
    "shard_batch",
]

MESH_AXES = ("data", "expert", "fsdp", "tensor", "sequence", "stage")
# A batch's rows split over these and no others: a tensor group's devices compute different
# widths of the same rows, so each holds them whole (docs/distributed.md, "What each axis splits").
BATCH_AXES = ("data", "fsdp", "expert")
BATCH_SPEC = PartitionSpec(BATCH_AXES)
SEQUENCE_AXIS = "sequence"


def _doc(text: str) -> dict[str, str]:
    """A field's description, for ``dew train --help`` and ``dew describe``."""
    return {"description": text}


class MeshSizeError(DewError, ValueError):
    """The mesh's axis sizes do not divide the devices there are."""


class BatchSplitError(DewError, ValueError):
    """A batch's rows do not divide over the devices the mesh splits every batch across."""


# A batch lacks a key, or a leaf's shape or dtype differs from the compiled step's: dew's one
# batch-key error, under the name this module has always given it.
BatchMismatchError = BatchKeyError


@dataclass(frozen=True)
class MeshSpec:
    """How many devices each sharding axis takes; data parallelism fills the rest."""

    fsdp: int = field(default=1, metadata=_doc("devices the parameters and optimizer state shard over"))
    expert: int = field(default=1, metadata=_doc("devices an MoE layer's experts split over"))
    tensor: int = field(default=1, metadata=_doc("devices the mlp, head and vocabulary widths split over"))
    sequence: int = field(default=1, metadata=_doc("devices the sequence dimension splits over"))
    stage: int = field(default=1, metadata=_doc("pipeline stages the layer stack splits into"))
    microbatches: int | None = field(
        default=None, metadata=_doc("microbatches per step through the stages (a multiple of stage)"))
    replicas: int = field(default=1, metadata=_doc("host groups the data axis spans (hybrid sharding)"))
    schedule: str = field(default="gpipe", metadata=_doc(
        "how the stages run their microbatches: gpipe (all forwards, then autodiff) or 1f1b (each "
        "backward as soon as its loss is known)"))
    circular_repeats: int = field(default=1, metadata=_doc(
        "chunks of the layer stack per stage device under 1f1b (interleaved 1F1B, virtual stages)"))

    def __post_init__(self) -> None:
        for name in ("fsdp", "expert", "tensor", "sequence", "stage", "replicas", "circular_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MeshSpec.{name} must be a positive integer, got {value!r}.")
        piped = [f"{name}={getattr(self, name)!r}" for name, unset in
                 (("microbatches", None), ("schedule", "gpipe"), ("circular_repeats", 1)) if getattr(self, name) != unset]
        if self.stage == 1 and piped:
            raise ValueError(
                f"MeshSpec {', '.join(piped)} run{'s' if len(piped) == 1 else ''} the pipeline's stages, and "
                "stage=1 has none, so the step would train as without it. Set stage above 1 (the layers "
                "split into that many stages), or drop it; trainer.accumulation cuts a step into "
                "microbatches without a pipeline.")
        if self.microbatches is not None and (self.microbatches < 1 or self.microbatches % self.stage):
            from dew.nn.pipeline import MicrobatchError

            raise MicrobatchError(
                f"MeshSpec.microbatches ({self.microbatches}) must be a positive multiple of stage "
                f"({self.stage}): every stage takes a share of each round; set it to "
                f"{self.stage * max(1, round(self.microbatches / self.stage))} or leave it None."
            )
        from dew.nn.pipeline import SCHEDULES

        if self.schedule not in SCHEDULES:
            raise ValueError(f"MeshSpec.schedule={self.schedule!r} is no pipeline schedule; use one of "
                             f"{', '.join(map(repr, SCHEDULES))}.")
        if self.circular_repeats > 1 and self.schedule != "1f1b":
            raise ValueError(
                f"MeshSpec.circular_repeats={self.circular_repeats} interleaves a 1F1B schedule (each stage "
                "device holds that many chunks of the stack); set schedule='1f1b' too, or "
                "circular_repeats=1.")

    @property
    def model_devices(self) -> int:
        """Devices one data-parallel replica spans."""
        return self.fsdp * self.expert * self.tensor * self.sequence * self.stage


def build_mesh(spec: MeshSpec = MeshSpec(), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the six-axis mesh spec describes.

    devices, when given, are laid out row-major over MESH_AXES in the order
    given, so the last axes hold neighbouring entries. Unset, every device
    is placed by ``jax.make_mesh``, in the order it gives the platform's
    topology: on CPU and GPU the devices' own order, on a TPU slice the
    order of its interconnect's torus, so the axes whose collectives run
    most (the last ones) fall on neighbouring chips. ``spec.replicas``
    above 1 lays out replica groups instead (see _hybrid_grid).
    """
    given = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    inner = spec.model_devices
    if len(devices) % inner:
        raise MeshSizeError(
            f"The mesh axes fsdp={spec.fsdp} x expert={spec.expert} x tensor={spec.tensor} x "
            f"sequence={spec.sequence} x stage={spec.stage} = {inner} devices do not divide the "
            f"{len(devices)} devices available; choose sizes whose product divides {len(devices)} "
            "(a recipe's trainer.mesh.fsdp, .expert, .tensor, .sequence and .stage)."
        )
    shape = {
        "data": len(devices) // inner,
        "expert": spec.expert,
        "fsdp": spec.fsdp,
        "tensor": spec.tensor,
        "sequence": spec.sequence,
        "stage": spec.stage,
    }
    sizes = [shape[a] for a in MESH_AXES]
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if spec.replicas > 1:
        grid = _hybrid_grid(spec, shape, devices)
    elif given:
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    else:
        attribute, count = granules(devices)
        if attribute == "slice_index":
            raise ReplicaError(
                f"These devices span {count} slices, and one mesh laid out over all of them would "
                f"run fsdp's gathers across the slow links between slices. Set "
                f"MeshSpec.replicas={count} (or a divisor of it), so that the data axis crosses "
                "slices and every other axis stays inside one."
            )
        return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


# -- replicas: hybrid sharded data parallelism over granules -----------------------------


class ReplicaError(DewError, ValueError):
    """spec.replicas cannot split the devices' granules (slices or processes) into equal groups."""


def granules(devices: Sequence[jax.Device]) -> tuple[str, int]:
    """How devices fall into granules: by slice_index, or by process when every device shares
    one slice (or the platform has no slices); and how many there are."""
    slices = {getattr(d, "slice_index", 0) for d in devices}  # a JAX device: only TPUs have slices
    if len(slices) > 1:
        return "slice_index", len(slices)
    return "process_index", len({d.process_index for d in devices})


def _hybrid_grid(spec: MeshSpec, shape: dict[str, int], devices: Sequence[jax.Device]) -> np.ndarray:
    """The devices laid out the way MaxText lays out a multislice mesh.

    The data axis takes replicas groups of granules as its outer factor; a
    group of several granules also spans fsdp across them; every other axis
    lies inside one granule.
    """
    from jax.experimental import mesh_utils

    attribute, count = granules(devices)
    if count % spec.replicas:
        raise ReplicaError(
            f"MeshSpec.replicas={spec.replicas} cannot group the {count} granules (devices "
            f"grouped by {attribute}) evenly; choose replicas that divide {count}, or 1."
        )
    per_group = count // spec.replicas
    if shape["data"] % spec.replicas or spec.fsdp % per_group:
        raise ReplicaError(
            f"MeshSpec.replicas={spec.replicas} needs the data axis ({shape['data']} devices) to "
            f"be a multiple of replicas and fsdp={spec.fsdp} a multiple of the {per_group} "
            f"granules each group spans; choose replicas and fsdp so that both divide."
        )
    outer = {a: 1 for a in MESH_AXES} | {"data": spec.replicas, "fsdp": per_group}
    inner = {a: shape[a] // outer[a] for a in MESH_AXES}
    return mesh_utils.create_hybrid_device_mesh(
        [inner[a] for a in MESH_AXES], [outer[a] for a in MESH_AXES], devices,
        process_is_granule=attribute == "process_index", allow_split_physical_axes=True,
    )


def _row_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def data_partition(mesh: Mesh) -> DataPartition:
    """The share of every global batch this process reads on mesh.

    A device's row shard is its position over BATCH_AXES. Processes holding
    the same row shards form one group that reads one share; groups must
    hold disjoint, contiguous, equally many row shards. The sequence axis is
    not among them: devices that split one row's positions hold the same
    rows, so their processes read the same whole rows, and shard_batch puts
    each device's positions in place.
    """
    names = mesh.axis_names
    batch_dims = [names.index(a) for a in BATCH_AXES]
    sizes = [mesh.shape[a] for a in BATCH_AXES]
    holdings: dict[int, set[int]] = {}
    for index in np.ndindex(mesh.devices.shape):
        device: jax.Device = mesh.devices[index]
        row = int(np.ravel_multi_index([index[d] for d in batch_dims], sizes))
        holdings.setdefault(device.process_index, set()).add(row)
    groups = sorted({frozenset(rows) for rows in holdings.values()}, key=min)
    total = _row_shards(mesh)
    per = len(groups[0])
    covered = sorted(r for g in groups for r in g)
    if covered != list(range(total)) or any(
        len(g) != per or sorted(g) != list(range(min(g), min(g) + per)) for g in groups
    ):
        raise ValueError(
            "The processes' devices hold overlapping or scattered rows of the batch, so no "
            f"process could read a whole share: {sorted(map(sorted, groups))}. Lay the devices "
            "out so each process holds a contiguous block of the data, fsdp and expert axes."
        )
    mine = frozenset(holdings[jax.process_index()])
    share = groups.index(mine)
    readers = sorted(p for p, rows in holdings.items() if frozenset(rows) == mine)
    return DataPartition(
        share=share, shares=len(groups), reader=readers.index(jax.process_index()),
        readers=len(readers),
    )


def batch_shardings(mesh: Mesh, batch: Mapping[str, ArrayLike]) -> dict[str, NamedSharding]:
    """The sharding of every leaf of a global batch: rows over BATCH_AXES, positions over
    'sequence'.

    A leaf's second dimension is its positions. It splits over the sequence
    axis when that axis divides it, and is kept whole on each device
    otherwise: an LM's windows hold seq_len + 1 ids, and the model splits the
    seq_len it reads where it constrains its activations (a length the axis
    does not divide is refused there, by dew.nn.sharding.constrain).
    """
    ways = mesh.shape.get(SEQUENCE_AXIS, 1)

    def one(x: ArrayLike) -> NamedSharding:
        shape = np.shape(x)
        if not shape:
            return _sharding(mesh, PartitionSpec())
        if ways > 1 and len(shape) > 1 and shape[1] % ways == 0:
            return _sharding(mesh, PartitionSpec(BATCH_AXES, SEQUENCE_AXIS))
        return _sharding(mesh, BATCH_SPEC)

    return jax.tree.map(one, dict(batch))


@functools.lru_cache(maxsize=64)
def _sharding(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    """One NamedSharding per mesh and spec, made once: a batch placed every step with the
    sharding objects of the step before is put a third faster than with new ones."""
    return NamedSharding(mesh, spec)


def shard_batch(
    batch: Mapping[str, ArrayLike], mesh: Mesh, partition: DataPartition,
    expected: Mapping[str, jax.ShapeDtypeStruct] | None = None,
) -> dict[str, jax.Array]:
    """Put this process's share of a global batch onto the mesh as global arrays.

    expected, when given, is the abstract global batch the compiled step
    takes; a missing key or a differing shape or dtype is refused by name.
    """
    if expected is not None:
        check_batch(batch, expected, partition)
    _check_split(batch, mesh, partition)
    shardings = batch_shardings(mesh, batch)
    if jax.process_count() == 1:
        return jax.device_put(dict(batch), shardings)

    def put(local: ArrayLike, sharding: NamedSharding) -> jax.Array:
        local = np.asarray(local)
        global_shape = (local.shape[0] * partition.shares, *local.shape[1:]) if local.ndim else ()
        return jax.make_array_from_process_local_data(sharding, local, global_shape)

    return jax.tree.map(put, dict(batch), shardings)


def _check_split(batch: Mapping[str, ArrayLike], mesh: Mesh, partition: DataPartition) -> None:
    """Refuse, by its sizes, a batch whose rows the batch axes cannot split evenly."""
    ways = math.prod(mesh.shape.get(axis, 1) for axis in BATCH_AXES)
    if ways == 1:
        return
    for key, x in batch.items():
        shape = np.shape(x)
        if shape and (rows := shape[0] * partition.shares) % ways:
            sizes = " x ".join(f"{axis} {mesh.shape.get(axis, 1)}" for axis in BATCH_AXES)
            raise BatchSplitError(
                f"The batch's {key!r} has {rows} rows, which do not divide over the {ways} devices "
                f"a batch is split across ({sizes}). Make the batch a multiple of {ways} (a "
                f"recipe's data.batch), or choose mesh sizes whose product divides {rows}."
            )


def global_shape(batch: Mapping[str, ArrayLike], partition: DataPartition) -> dict[str, jax.ShapeDtypeStruct]:
    """The abstract global batch that a process-local share stands for."""

    def one(x: ArrayLike) -> jax.ShapeDtypeStruct:
        x = x if isinstance(x, jax.Array | np.ndarray) else np.asarray(x)
        shape = (x.shape[0] * partition.shares, *x.shape[1:]) if len(x.shape) else ()
        return jax.ShapeDtypeStruct(shape, x.dtype)

    return jax.tree.map(one, dict(batch))


def check_batch(batch: Mapping[str, ArrayLike], expected: Mapping[str, jax.ShapeDtypeStruct],
                partition: DataPartition) -> None:
    """Refuse a batch whose keys, shapes or dtypes differ from the compiled step's."""
    if not isinstance(batch, Mapping):
        raise BatchMismatchError(f"A batch must be a mapping of arrays, got {type(batch).__name__}.")
    missing = [k for k in expected if k not in batch]
    if missing:
        raise BatchMismatchError(
            f"The batch has no key {', '.join(map(repr, missing))}; the compiled step reads "
            f"{sorted(expected)} and the batch holds {sorted(batch)}."
        )
    actual = global_shape({k: batch[k] for k in expected}, partition)
    for key, want in expected.items():
        leaves_got = jax.tree.leaves(actual[key])
        leaves_want = jax.tree.leaves(want)
        for got, exp in zip(leaves_got, leaves_want, strict=False):
            if got.shape != exp.shape or got.dtype != exp.dtype:
                raise BatchMismatchError(
                    f"Batch key {key!r} has shape {tuple(got.shape)} and dtype {got.dtype} "
                    f"(global), but the compiled step expects shape {tuple(exp.shape)} and "
                    f"dtype {exp.dtype}. Every batch of a run must have the same shapes."
                )


class CPUDeviceCountError(DewError, RuntimeError):
    """A process has not as many CPU devices as accelerators, so the CPU companion mesh cannot mirror the mesh."""


def companion_mesh(mesh: Mesh, cpus: Sequence[jax.Device] | None = None) -> Mesh:
    """The CPU mesh that mirrors mesh: same shape and axis names, each device's CPU twin.

    A device's twin is the CPU device of the same process at the same local
    index, so every process owns the state shards its accelerators compute
    with. Each process needs exactly as many CPU devices as accelerators;
    the count is fixed when JAX starts, so this only checks it. On a CPU
    mesh every device is its own twin. cpus defaults to ``jax.devices("cpu")``.

    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> companion_mesh(mesh).devices.tolist() == mesh.devices.tolist()
    True
    """
    platform = mesh.devices.flat[0].platform
    accelerators = _by_process(jax.devices(platform))
    twins = _by_process(jax.devices("cpu") if cpus is None else cpus)
    wrong = {p: (len(twins.get(p, [])), len(devices)) for p, devices in accelerators.items()
             if len(twins.get(p, [])) != len(devices)}
    if wrong:
        described = "; ".join(f"process {p}: {cpu} CPU devices for {acc} {platform} devices"
                              for p, (cpu, acc) in sorted(wrong.items()))
        count = next(iter(wrong.values()))[1]
        raise CPUDeviceCountError(
            f"Layout.host=('params',) keeps the train state on a CPU companion with one CPU device per "
            f"accelerator, but {described}. Start each process with as many CPU devices as accelerators, "
            f"before JAX initializes: XLA_FLAGS=--xla_force_host_platform_device_count={count} (or "
            f"jax.config.update('jax_num_cpu_devices', {count})); or keep the parameters on the devices "
            "and offload the other fields with Layout.host=('opt_state', 'ema')."
        )
    twin = {device: twins[p][i] for p, devices in accelerators.items() for i, device in enumerate(devices)}
    grid = np.vectorize(twin.__getitem__, otypes=[object])(mesh.devices)
    return Mesh(grid, mesh.axis_names, axis_types=mesh.axis_types)


def _by_process(devices: Sequence[jax.Device]) -> dict[int, list[jax.Device]]:
    grouped: dict[int, list[jax.Device]] = defaultdict(list)
    for device in sorted(devices, key=lambda d: d.id):
        grouped[device.process_index].append(device)
    return dict(grouped)
