"""Layout: how a train state is placed on a mesh, from the logical axes modules declare.

A rule maps a logical axis name (dew.nn.sharding) to mesh axes; rules are
tried in precedence order, and a rule whose mesh axes another dimension of
the same array already took is skipped. Axes that do not divide a dimension
are dropped, so a single table serves every topology.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias, TypeVar

import jax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import KeyPath

from dew.errors import DewError
from dew.nn.sharding import LAYERS
from dew.training.placement.mesh import MESH_AXES, companion_mesh
from dew.tree_paths import path_name
from dew.typing import PyTree

__all__ = [
    "DEFAULT_RULES",
    "HOST_MEMORY",
    "HOST_RESIDENT",
    "Layout",
    "LayoutError",
    "LogicalAxisRules",
    "MeshAxes",
    "Placement",
    "STAGE_RULE",
    "logical_names",
]

MeshAxes = str | tuple[str, ...] | None
LogicalAxisRules = tuple[tuple[str, MeshAxes], ...]
TreeT = TypeVar("TreeT")
Placement: TypeAlias = PyTree  # a tree of NamedSharding shaped like the placed tree

DEFAULT_RULES: LogicalAxisRules = (
    # activations. An MoE layer's dispatched tokens put their experts on the expert
    # axis first, so the rows of those tokens fall back to the data and fsdp axes.
    ("activation_expert", "expert"),
    ("batch", ("data", "fsdp", "expert")),
    ("batch", ("data", "fsdp")),
    ("activation_length", "sequence"),
    ("activation_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("activation_embed", None),
    # parameters
    ("vocab", ("tensor", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", ("tensor", "fsdp")),
    ("mlp", "tensor"),
    ("heads", ("tensor", "fsdp")),
    ("heads", "tensor"),
    ("kv", None),
    ("expert", "expert"),
)
# The stage axis is not a rule's to give: it holds the layer stack's pipeline stages, which the
# layout places from the stored tree's layers axis itself (Layout.axis_rules ends with it).
STAGE_RULE = (LAYERS, "stage")

HOST_RESIDENT = ("opt_state", "ema")  # TrainState fields Layout.host may keep in host memory
HOST_MEMORY = "pinned_host"  # the memory kind they, and offloaded parameters, sit in

_PARAMETER_AXES = ("fsdp", "expert", "tensor")
_FORBIDDEN_FOR_PARAMETERS = ("data", "sequence")
_SPLIT_WHERE_DECLARED = ("expert", "stage")
"""Axes only some parameters have a dimension for (an MoE layer's experts, a pipeline's layer stack):
a parameter without one is perfectly sharded over the other parameter axes alone."""


class LayoutError(DewError, ValueError):
    """A layout would place a parameter badly, or leaves too much of the model replicated."""


def _is_box(x: object) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def logical_names(tree: PyTree) -> PyTree:
    """The logical axis names of every leaf (None where no module declared any)."""
    return jax.tree.map(
        lambda x: tuple(x.names) if isinstance(x, nn.LogicallyPartitioned) else None,
        tree, is_leaf=_is_box,
    )


@dataclass(frozen=True)
class Layout:
    """Says how a train state is placed on a mesh.

    rules map logical axes onto mesh axes in precedence order. A parameter
    below min_shard elements stays replicated (the collectives would cost
    more than the memory saved); tolerance is the parameter memory per device
    above perfect sharding, as a fraction of perfect sharding, that check()
    accepts (MaxText's sharding_tolerance). It has no upper bound: a layout
    that replicates everything on N devices holds N - 1 more, and the refusal
    names the value that accepts it.

    host lists TrainState fields (of HOST_RESIDENT) that live in pinned host
    memory between steps: the compiled step copies them to the devices,
    updates them there and copies the result back, so only their address
    changes, never their values. host naming "params" goes further: the
    CPU owns the whole state and runs the optimizer there, and the
    accelerators compute with a per-step copy of the parameters
    (dew.training.owned); the other names are then implied. host_parameters are globs over parameter
    paths (``params/layers_*``) that an inference placement (offloaded())
    keeps in pinned host memory, each with the split the rules give it.
    """

    rules: LogicalAxisRules | Mapping[str, MeshAxes] = field(default=DEFAULT_RULES, metadata={
        "description": "[logical axis, mesh axes] pairs in precedence order (default DEFAULT_RULES)"})
    min_shard: int = field(default=2**16, metadata={
        "description": "parameters smaller than this stay replicated"})
    tolerance: float = field(default=0.02, metadata={
        "description": "parameter memory per device above perfect sharding, as a fraction of it, "
                       "that a layout may keep (2.0: three times the perfect share)"})
    host: tuple[str, ...] = field(default=(), metadata={
        "description": "state fields kept in host memory between steps"})
    host_parameters: tuple[str, ...] = field(default=(), metadata={
        "description": "parameter patterns placed in host memory for inference"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "host", tuple(self.host))
        object.__setattr__(self, "host_parameters", tuple(self.host_parameters))
        unknown = [name for name in self.host if name not in (*HOST_RESIDENT, "params")]
        if unknown:
            raise LayoutError(
                f"Layout.host names {unknown}, which are not host-resident fields of the train "
                f"state; choose among {list(HOST_RESIDENT)}, or 'params' for a train state the "
                "CPU owns whole."
            )
        for name, axes in self._pairs():
            named = (axes,) if isinstance(axes, str) else tuple(axes or ())
            strangers = [axis for axis in named if axis not in MESH_AXES]
            if strangers:
                close = [difflib.get_close_matches(str(axis), MESH_AXES, n=1) for axis in strangers]
                hint = ", ".join(f"{found[0]!r} for {axis!r}" for axis, found in
                                 zip(strangers, close, strict=True) if found)
                raise LayoutError(
                    f"The rule {name!r} -> {axes!r} names {', '.join(map(repr, strangers))}, which is no mesh "
                    f"axis (the mesh's are {', '.join(MESH_AXES)}{f'; did you mean {hint}?' if hint else ''}); "
                    "a parameter would be left whole on every device, an activation would stop the step.")
            if "stage" in named:
                raise LayoutError(
                    f"The rule {name!r} -> {axes!r} places {name} on the stage axis, which holds "
                    "the layer stack's pipeline stages: the layout puts the stored tree's layers "
                    "axis there itself, and nothing else belongs there. Drop the rule (map "
                    f"{name} to fsdp, tensor or expert)."
                )
        if self.min_shard < 0 or not self.tolerance >= 0:
            raise LayoutError(
                f"Layout needs min_shard >= 0 and tolerance >= 0, got {self.min_shard} "
                f"and {self.tolerance}."
            )

    @property
    def owns_state(self) -> bool:
        """Whether the CPU owns the whole train state (host names params): see dew.training.owned."""
        return "params" in self.host

    @property
    def resident_fields(self) -> tuple[str, ...]:
        """The fields kept in pinned host memory between steps: none when the CPU owns the state."""
        return () if self.owns_state else self.host

    def _pairs(self) -> LogicalAxisRules:
        if isinstance(self.rules, Mapping):
            return tuple(self.rules.items())
        return tuple((name, axes) for name, axes in self.rules)

    @property
    def axis_rules(self) -> LogicalAxisRules:
        """The rules as flax reads them, (logical, mesh axes) pairs in precedence order, and
        last the layout's own: the stored tree's layers axis on the stage axis."""
        return (*self._pairs(), STAGE_RULE)

    # -- one leaf -------------------------------------------------------------
    def spec(self, shape: Sequence[int], names: Sequence[str | None] | None, mesh: Mesh) -> PartitionSpec:
        """The PartitionSpec of one parameter of shape with logical names on mesh."""
        if not shape:
            return PartitionSpec()
        if math.prod(shape) < self.min_shard:
            # Small leaves stay replicated, except that a stacked layer keeps its pipeline
            # stage: each stage's devices hold that stage's layers and no others.
            if names and names[0] == "layers" and len(names) == len(shape):
                return PartitionSpec(*self._resolve(tuple(shape), ("layers",) + (None,) * (len(shape) - 1), mesh))
            return PartitionSpec()
        if names is None:
            return self._heuristic(shape, mesh)
        if len(names) != len(shape):
            raise LayoutError(f"Logical names {tuple(names)} do not match a parameter of shape {tuple(shape)}.")
        return PartitionSpec(*self._resolve(tuple(shape), tuple(names), mesh))

    def _resolve(self, shape: tuple[int, ...], names: tuple[str | None, ...], mesh: Mesh) -> list[MeshAxes]:
        """Assign mesh axes to dimensions, rule by rule in precedence order (as flax does).

        A rule applies to the first unassigned dimension of its name when none
        of its mesh axes is taken yet; of its axes, those of size above 1 that
        divide the dimension are used. A rule that can use none of them leaves
        the dimension to the next rule of that name.
        """
        result: list[MeshAxes | None] = [None] * len(shape)
        assigned = [False] * len(shape)
        used: set[str] = set()
        for rule_name, axes in self.axis_rules:
            if rule_name not in names:
                continue
            position = names.index(rule_name)
            if assigned[position]:
                continue
            wanted = (axes,) if isinstance(axes, str) else tuple(axes or ())
            bad = [a for a in wanted if a in _FORBIDDEN_FOR_PARAMETERS]
            if bad:
                raise LayoutError(
                    f"The rule {rule_name!r} -> {axes!r} places a parameter on {bad}, which split "
                    "the batch; a parameter there would be gathered on every use. Map it to fsdp, "
                    "tensor or expert."
                )
            if any(a in used for a in wanted):
                continue
            chosen: list[str] = []
            for axis in wanted:
                if axis not in mesh.shape or mesh.shape[axis] == 1:
                    continue
                if shape[position] % (math.prod(mesh.shape[a] for a in chosen) * mesh.shape[axis]) == 0:
                    chosen.append(axis)
            if not chosen:
                continue
            used.update(chosen)
            assigned[position] = True
            result[position] = chosen[0] if len(chosen) == 1 else tuple(chosen)
        return result

    def _heuristic(self, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
        """Split a leaf no module declared over the parameter axes, the largest axis first.

        Each axis of size above 1 (fsdp, expert, tensor; equal sizes in that
        order) takes the dimension with the most left to split that it
        divides, so under tensor=4 alone a (1024, 1024) matrix splits four
        ways, and under fsdp=2, tensor=4 eight ways. An axis that divides no
        dimension leaves the leaf whole along it.
        """
        sizes = {axis: mesh.shape.get(axis, 1) for axis in _PARAMETER_AXES}
        axes = sorted((a for a in _PARAMETER_AXES if sizes[a] > 1), key=lambda a: -sizes[a])
        left = list(shape)
        placed: list[list[str]] = [[] for _ in shape]
        for axis in axes:
            fits = [i for i in range(len(shape)) if left[i] % sizes[axis] == 0]
            if not fits:
                continue
            dimension = max(fits, key=lambda i: left[i])  # the first of equals, as before
            placed[dimension].append(axis)
            left[dimension] //= sizes[axis]
        return PartitionSpec(*(None if not p else p[0] if len(p) == 1 else tuple(p) for p in placed))

    # -- whole trees ------------------------------------------------------------
    def shardings(self, mesh: Mesh, tree: TreeT) -> Placement:
        """A NamedSharding per leaf of tree, from its declared axes (boxes are removed).

        A leaf no module declares axes for takes the largest-divisible-axis
        heuristic (the largest parameter axis first, see _heuristic), so a
        model family can be declared a module at a time.
        """

        def one(path: KeyPath, x: PyTree) -> NamedSharding:
            names = tuple(x.names) if isinstance(x, nn.LogicallyPartitioned) else None
            value = x.unbox() if _is_box(x) else x
            _check_experts(jax.tree_util.keystr(path), tuple(value.shape), names, mesh)
            return NamedSharding(mesh, self.spec(tuple(value.shape), names, mesh))

        return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_box)

    def offloaded(self, mesh: Mesh, tree: TreeT) -> Placement:
        """shardings with each leaf's memory kind: pinned host memory where host_parameters match.

        A selected leaf keeps the spec the rules give it, so it is the same
        shard, in another memory. Each pattern must match at least one
        path, or LayoutError names it (a typo would otherwise keep the
        weights on the devices, silently).
        """
        placement = self.shardings(mesh, tree)
        if not self.host_parameters:
            return placement
        chosen = self._selected(tree)
        return jax.tree_util.tree_map_with_path(
            lambda path, sharding: sharding.with_memory_kind(HOST_MEMORY)
            if parameter_path(path) in chosen else sharding,
            placement,
        )

    def _selected(self, tree: PyTree) -> set[str]:
        """The paths host_parameters match in tree; LayoutError for a pattern matching none."""
        paths = [parameter_path(path) for path, _ in
                 jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)[0]]
        chosen: set[str] = set()
        for pattern in self.host_parameters:
            hits = fnmatch.filter(paths, pattern)
            if not hits:
                sample = ", ".join(paths[:4]) + (", ..." if len(paths) > 4 else "")
                raise LayoutError(
                    f"Layout.host_parameters pattern {pattern!r} matches no parameter; paths look like "
                    f"{sample}. Fix or drop the pattern."
                )
            chosen.update(hits)
        return chosen

    def check(self, params: PyTree, shardings: Placement, mesh: Mesh) -> None:
        """Refuse a layout that leaves more than tolerance of the shardable memory replicated,
        or that names host_parameters for a placement that does not keep them in host memory.

        Per device, a perfectly sharded parameter holds size / devices
        elements, where devices is the product of the parameter axes. Only
        parameters of at least min_shard elements count: the smaller ones are
        replicated on purpose. host_parameters belong to offloaded(): a
        training placement (shardings()) has nothing that fetches them. A
        CPU-owned layout (host names params) needs a CPU device per
        accelerator in every process, or CPUDeviceCountError says so.
        """
        if self.owns_state:
            companion_mesh(mesh)  # CPUDeviceCountError unless every process has a CPU twin per device
        leaves = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]
        placements = jax.tree.leaves(shardings)
        if self.host_parameters:
            chosen = self._selected(params)
            kept = {parameter_path(path) for (path, _), s in zip(leaves, placements, strict=True)
                    if s.memory_kind == HOST_MEMORY}
            if not chosen <= kept:
                raise LayoutError(
                    f"Layout.host_parameters {list(self.host_parameters)} is for an inference "
                    "placement (Layout.offloaded), which fetches each layer's weights as it "
                    "reaches them; this placement keeps them on the devices, and a step would "
                    "find nothing bringing host weights back. Drop host_parameters here (to "
                    f"offload training state use Layout.host={HOST_RESIDENT})."
                )
        # Only an MoE layer's expert weights have an expert dimension to split, and only a
        # pipeline's layer stacks a stage dimension: every other parameter is replicated over
        # those axes as over the data axis, so its perfect sharding spans the other parameter
        # axes alone. (Counting a stage split in the held share and not in the perfect one
        # hid a layout's replication over fsdp behind its stages.)
        dense = math.prod(mesh.shape.get(a, 1) for a in _PARAMETER_AXES if a not in _SPLIT_WHERE_DECLARED)
        devices = dense * math.prod(max((mesh.shape.get(axis, 1) for s in placements if axis in _axes(s.spec)),
                                        default=1) for axis in _SPLIT_WHERE_DECLARED)
        if devices == 1:
            return
        held = ideal = 0.0
        worst: list[tuple[float, str, tuple[int, ...]]] = []
        for (path, leaf), sharding in zip(leaves, placements, strict=True):
            size = math.prod(leaf.shape)
            if size < self.min_shard:
                continue
            split = _axes(sharding.spec)
            perfect = size / (dense * math.prod(mesh.shape.get(axis, 1) for axis in _SPLIT_WHERE_DECLARED
                                                if axis in split))
            per_device = size / _shard_factor(sharding.spec, mesh)
            held += per_device
            ideal += perfect
            worst.append((per_device - perfect, jax.tree_util.keystr(path), tuple(leaf.shape)))
        if ideal == 0:
            return
        excess = round(held / ideal - 1, 9)  # whole on N devices is N - 1 exactly, not past it by a rounding
        if excess > self.tolerance:
            worst.sort(reverse=True)
            # only leaves held beyond their perfect share: one at it is not what to fix
            names = ", ".join(f"{p} {s}" for over, p, s in worst[:3] if over > 1e-9 * ideal)
            accepting = math.ceil(excess * 1000) / 1000  # rounded up: the value accepts it
            raise LayoutError(
                f"This layout keeps {excess:.1%} more parameter memory per device than perfect "
                f"sharding over {devices} devices (tolerance {self.tolerance:.1%}); the mesh axes "
                f"divide too few of the model's dimensions. Most replicated: {names}. Choose mesh "
                f"sizes that divide the model's widths, or accept it with Layout(tolerance={accepting:g}) "
                f"(in a recipe, trainer.layout.tolerance={accepting:g})."
            )


parameter_path = path_name  # a leaf's path as host_parameters patterns read it


def _check_experts(path: str, shape: tuple[int, ...], names: tuple[str | None, ...] | None,
                   mesh: Mesh) -> None:
    """Refuse experts the expert axis cannot split evenly, whatever the parameter's size.

    Left to the rules, such a dimension would quietly stay whole, and every
    device would hold (and compute) every expert.
    """
    ways = mesh.shape.get("expert", 1)
    if ways == 1 or not names or "expert" not in names:
        return
    experts = shape[names.index("expert")]
    if experts % ways:
        raise LayoutError(
            f"{path} has {experts} experts, which do not divide over MeshSpec.expert={ways} "
            f"devices; use a number of experts that is a multiple of {ways}, or an expert axis "
            f"that divides {experts}."
        )


def _axes(spec: PartitionSpec) -> set[str]:
    out: set[str] = set()
    for axes in spec:
        if axes is not None:
            out.update((axes,) if isinstance(axes, str) else axes)
    return out


def _shard_factor(spec: PartitionSpec, mesh: Mesh) -> int:
    factor = 1
    for axes in spec:
        if axes is None:
            continue
        for axis in (axes,) if isinstance(axes, str) else axes:
            factor *= mesh.shape[axis]
    return factor
