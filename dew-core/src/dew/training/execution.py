"""Where a run's state lives and computes: one execution strategy, chosen once per run.

An ``Execution`` places the abstract state, initializes a fresh one,
compiles the step program and reads the state back for an evaluation.
``DeviceExecution`` keeps the state on the accelerator mesh (the fields
Layout.host names wait in pinned host memory and are fetched inside the
step); ``OwnedExecution`` (Layout.host naming params, ``dew.training.owned``)
keeps it on a CPU companion mesh and runs the optimizer there. Nothing
outside the two asks which one a run has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import KeyPath

from dew.nn.pipeline import pipeline
from dew.objectives.base import LeafFilter, Variables
from dew.training.placement.layout import Layout, Placement
from dew.training.placement.offload import fetching, in_host_memory
from dew.training.placement.stages import schedule_of, with_bubble
from dew.training.state import TrainState, shardings_state
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.training.placement.mesh import MeshSpec
    from dew.training.program import Program
    from dew.training.step import StepFn

__all__ = ["QUICK_INIT_PARAMETERS", "CompiledStep", "DeviceExecution", "Execution", "execution_for", "follower",
           "run_once_options", "state_placement"]


@dataclass(frozen=True)
class CompiledStep:
    """One compiled transaction: ``new, metrics = step(old, batch)``; the old state is consumed
    (donated), and the metrics stay on the device until read."""

    executable: jax.stages.Compiled | StepFn  # one compiled program, or the two of a CPU-owned state joined

    def __call__(self, state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
        return self.executable(state, batch)


class Execution(Protocol):
    """Where the state of one run lives and where its step computes.

    ``compiles_from_shapes`` says whether ``compile`` needs only the state's
    shapes and shardings, so a fit may compile the step while a fresh state
    is still being built (dew.training.opening.Pending).
    """

    @property
    def compiles_from_shapes(self) -> bool:
        """Whether compile needs only the state's shapes and shardings, not its arrays."""
        ...

    @property
    def mesh(self) -> Mesh:
        """The accelerator mesh the forward and backward run on."""
        ...

    def placement(self, state: TrainState) -> Placement:
        """Every field of the (abstract) state's sharding."""
        ...

    def weights_placement(self, placement: Placement) -> Placement:
        """Where the starting weights wait before the initializer reads them."""
        ...

    def initialize(self, build: Callable[..., TrainState], placement: Placement, *args: object) -> TrainState:
        """The fresh state build(*args) computes, placed as placement says."""
        ...

    def compile(self, program: Program, state: TrainState,
                batch: Mapping[str, jax.Array]) -> jax.stages.Compiled | StepFn:
        """The step program compiled over state and one global batch; the state is donated."""
        ...

    def readable(self, state: TrainState) -> tuple[Variables, Variables | None]:
        """The variables and EMA-averaged variables an evaluation reads, on the accelerators."""
        ...


def execution_for(spec: MeshSpec, mesh: Mesh, layout: Layout, boxed: Variables, trains: LeafFilter) -> Execution:
    """The execution a layout asks for: CPU-owned when Layout.host names params, else on the devices."""
    if layout.owns_state:
        from dew.training.owned import OwnedExecution

        return OwnedExecution.of(spec, mesh, layout, boxed, nn.meta.unbox(boxed), trains)
    return DeviceExecution(spec, mesh, layout, boxed)


@dataclass(frozen=True)
class DeviceExecution:
    """The state on the accelerator mesh; Layout.host's fields in pinned host memory between steps."""

    spec: MeshSpec
    mesh: Mesh
    layout: Layout
    boxed: Variables  # the fresh variables as shapes, with their logical axes
    compiles_from_shapes: ClassVar[bool] = True

    def placement(self, state: TrainState) -> Placement:
        return in_host_memory(state_placement(self.mesh, self.layout, self.boxed, state),
                              self.layout.resident_fields)

    def weights_placement(self, placement: Placement) -> Placement:
        return placement

    def initialize(self, build: Callable[..., TrainState], placement: Placement, *args: object) -> TrainState:
        options = run_once_options(self.mesh, self.boxed)
        return jax.jit(build, out_shardings=placement, compiler_options=options)(*args)

    def compile(self, program: Program, state: TrainState, batch: Mapping[str, jax.Array]) -> jax.stages.Compiled:
        placement, schedule = self.placement(state), schedule_of(self.spec)
        step = fetching(with_bubble(program.step(), schedule), placement, self.layout.resident_fields)
        jitted = jax.jit(step, in_shardings=(placement, {k: v.sharding for k, v in batch.items()}),
                         out_shardings=(placement, NamedSharding(self.mesh, PartitionSpec())),
                         donate_argnums=(0,))
        shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.layout.axis_rules), pipeline(schedule):
            return jitted.lower(state, shapes).compile()

    def readable(self, state: TrainState) -> tuple[Variables, Variables | None]:
        return state.params, state.averaged


QUICK_INIT_PARAMETERS = 2_000_000  # at most this many parameters: the initializer compiles unoptimized on CPU


def run_once_options(mesh: Mesh, boxed: Variables) -> dict[str, int] | None:
    """XLA options for the initializer, a program that runs once: on CPU, for a model of at most
    QUICK_INIT_PARAMETERS parameters, XLA's lowest optimization level.

    There the initializer's compile is the longest wait before the first step (the key-concepts
    model: 2.1-4.0 s, against 1.1-1.8 s unoptimized, for a run of milliseconds either way). A
    larger model's unoptimized run costs more than its compile saves (58M parameters: compile
    6.5 -> 3.8 s, run 0.8 -> 4.2 s), and accelerators keep their defaults. Unoptimized, a few
    weights differ from a default-compiled init in their last bit (no fused multiply-adds).
    """
    if mesh.devices.flat[0].platform != "cpu":
        return None
    parameters = sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree.leaves(nn.meta.unbox(boxed)))
    return {"xla_backend_optimization_level": 0} if parameters <= QUICK_INIT_PARAMETERS else None


def state_placement(mesh: Mesh, layout: Layout, boxed: Variables, state: TrainState) -> Placement:
    """Place every field of state on mesh: parameter-shaped trees follow the parameters."""
    replicated = NamedSharding(mesh, PartitionSpec())
    params = layout.shardings(mesh, boxed)
    follow = follower(params, state.params, replicated)

    def place(tree: PyTree) -> PyTree:
        return jax.tree_util.tree_map_with_path(lambda path, leaf: follow(_names(path), leaf), tree)

    return shardings_state(
        params=params,
        opt_state=place(state.opt_state),
        key=replicated, step=replicated, microstep=replicated, updates=replicated,
        ema=place(state.ema) if state.ema is not None else None,
        scaler=jax.tree.map(lambda _: replicated, state.scaler) if state.scaler is not None else None,
        window=place(state.window) if state.window is not None else None,
    )


def _names(path: KeyPath) -> tuple[str, ...]:
    """The dictionary keys along a pytree path (sequence and attribute steps dropped)."""
    return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def follower(params: PyTree, abstract_params: PyTree,
             fallback: NamedSharding) -> Callable[[tuple[str, ...], PyTree], NamedSharding]:
    """A function giving a leaf the sharding of the parameter at its path's tail (same shape)."""
    by_path = {_names(path): sharding for path, sharding in jax.tree_util.tree_flatten_with_path(params)[0]}
    shapes = {_names(path): leaf.shape for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}

    def follow(names: tuple[str, ...], leaf: PyTree) -> NamedSharding:
        for start in range(len(names)):
            tail = names[start:]
            if tail in by_path and shapes[tail] == np.shape(leaf):
                return by_path[tail]
        return fallback

    return follow
