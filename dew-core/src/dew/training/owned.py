"""A CPU-owned train state: what Layout.host=("params",) builds.

The one true copy of the state (variables, optimizer state, EMA,
accumulation window, counters) lives on a CPU companion of the accelerator
mesh: the same shape and axis names, each accelerator replaced by the CPU
device of its own process at the same local index, so every leaf keeps the
split the layout gives it. The optimizer transaction runs there, whole:
clipping, accumulation, the update, the EMA.

A step sends the accelerators what the forward and backward read (the
parameter bank, with the counters, key, EMA and loss scale): a snapshot
copied from the CPU master for this step and dropped after it, so the
accelerators never hold a second master that could drift. The gradients
come back to the CPU and the transaction consumes them there. Frozen
parameters are the exception: nothing updates them, so they are placed on
the accelerators once (``Execution.resident``) and stay there.

On a machine without accelerators the two meshes are the same CPU devices;
the code path and the numbers are the same, only the copies are free.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import jax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import KeyPath

from dew.nn.pipeline import pipeline
from dew.objectives.base import LeafFilter, Variables
from dew.training.execution import run_once_options, state_placement
from dew.training.placement.layout import Layout, Placement
from dew.training.placement.mesh import MeshSpec, companion_mesh
from dew.training.placement.stages import schedule_of, with_bubble
from dew.training.state import TrainState, shardings_state
from dew.training.step import Gradients
from dew.training.trees import overlay, paths, select
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.training.program import Program

__all__ = ["OwnedExecution"]

@dataclass(frozen=True)
class OwnedExecution:
    """Where a CPU-owned run keeps its state and where it computes (an ``Execution``).

    mesh is the accelerator mesh (forward and backward), companion its CPU
    twin (the state and the transaction). bank is every variable's
    placement on the accelerators, as the layout's rules give it; frozen
    lists the paths ('params/encoder/kernel') of the parameters that never
    train, which stay on the accelerators.
    """

    spec: MeshSpec
    mesh: Mesh
    companion: Mesh
    layout: Layout
    boxed: Variables  # the fresh variables as shapes, with their logical axes
    bank: Placement
    frozen: frozenset[str]
    compiles_from_shapes: ClassVar[bool] = False  # its compile reads the state's bank view

    @classmethod
    def of(cls, spec: MeshSpec, mesh: Mesh, layout: Layout, boxed: Variables, variables: Variables,
           trains: LeafFilter) -> OwnedExecution:
        """The execution of a run on mesh whose variables the layout places there.

        The frozen parameters are those of the params collection that trains
        does not accept; the companion is checked and built here.
        """
        trainable = set(paths(select(variables, trains)))
        frozen = frozenset(p for p in paths(variables) if p.startswith("params/") and p not in trainable)
        return cls(spec, mesh, companion_mesh(mesh), layout, boxed, layout.shardings(mesh, boxed), frozen)

    def placement(self, state: TrainState) -> TrainState:
        """The whole state on the companion, less its frozen parameters (on the accelerators)."""
        return self.owned(state_placement(self.companion, self.layout, self.boxed, state))

    def weights_placement(self, placement: TrainState) -> TrainState:
        """The starting weights wait on the companion, where the initializer runs."""
        return self.on_companion(placement)

    @property
    def resident(self) -> Placement:
        """The frozen parameters' placement: on the accelerators, for the whole run."""
        return _pick(self.bank, self.frozen)

    # -- placements -------------------------------------------------------------
    def owned(self, placement: TrainState) -> TrainState:
        """A companion placement of the whole state, with the frozen parameters moved to the bank's."""
        bank = _by_path(self.bank)
        params = jax.tree_util.tree_map_with_path(
            lambda path, sharding: bank[_path(path)] if _path(path) in self.frozen else sharding,
            placement.params)
        return placement.replace(params=params)

    def on_companion(self, placement: TrainState) -> TrainState:
        """placement with every leaf on the companion, the frozen parameters included."""
        return jax.tree.map(lambda s: NamedSharding(self.companion, s.spec), placement)

    def view(self, state: TrainState) -> TrainState:
        """What the forward and backward read: the state less its optimizer state and window."""
        return state.replace(opt_state=None, window=None)

    def view_placement(self, state: TrainState) -> TrainState:
        """The view's placement on the accelerators: variables and EMA as the bank, scalars replicated."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return shardings_state(
            params=self.bank, opt_state=None,
            key=replicated, step=replicated, microstep=replicated, updates=replicated,
            ema=None if state.ema is None else _pick(self.bank, paths(state.ema)),
            scaler=None if state.scaler is None else jax.tree.map(lambda _: replicated, state.scaler),
            window=None,
        )

    # -- moving values ----------------------------------------------------------
    def snapshot(self, state: TrainState) -> TrainState:
        """This step's bank: the view copied from the CPU master onto the accelerators."""
        view = self.view(state)
        return jax.device_put(view, self.view_placement(view))

    def readable(self, state: TrainState) -> tuple[Variables, Variables | None]:
        """The variables and EMA-averaged variables an evaluation reads, on the accelerators."""
        bank = self.snapshot(state)
        return bank.params, bank.averaged

    def initialize(self, build: Callable[..., TrainState], placement: TrainState, *args: object) -> TrainState:
        """Build the fresh state on the companion, then move the frozen parameters to the accelerators."""
        options = run_once_options(self.companion, self.boxed)
        state = jax.jit(build, out_shardings=self.on_companion(placement), compiler_options=options)(*args)
        return jax.device_put(state, placement)

    # -- the step ---------------------------------------------------------------
    def compile(self, program: Program, state: TrainState, batch: Mapping[str, jax.Array]) -> Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, dict]]:
        """Compile the two halves of a step, each on its mesh, and return the step that joins them.

        forward runs on the accelerators against the bank; its gradients are
        copied to the companion, where apply (the optimizer transaction)
        consumes the CPU state in place. The frozen parameters never enter
        apply: they are no part of what it updates.
        """
        forward, apply = program.halves()
        placement = self.placement(state)
        rules, schedule = self.layout.axis_rules, schedule_of(self.spec)
        view = self.view(state)
        view_sh = self.view_placement(view)
        batch_sh = {k: v.sharding for k, v in batch.items()}
        batch_shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(rules), pipeline(schedule):
            differentiating = jax.jit(forward, in_shardings=(view_sh, batch_sh)).lower(
                _abstract(view, view_sh), batch_shapes).compile()
        owned_sh = self._without_frozen(placement)
        computed = jax.eval_shape(forward, view, batch_shapes)
        grads_sh = _pick(owned_sh.params, paths(computed.grads))
        replicated = NamedSharding(self.companion, PartitionSpec())
        gradients_sh = Gradients(grads=grads_sh, loss=jax.tree.map(lambda _: replicated, computed.loss),
                                 aux=jax.tree.map(lambda _: replicated, computed.aux))
        owned = self._without_frozen(state)
        with jax.set_mesh(self.companion):
            transacting = jax.jit(apply, in_shardings=(owned_sh, gradients_sh),
                                  out_shardings=(owned_sh, replicated), donate_argnums=(0,)).lower(
                _abstract(owned, owned_sh), _abstract(computed, gradients_sh)).compile()

        def step(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
            gradients = differentiating(self.snapshot(state), batch)
            gradients = jax.device_put(gradients, gradients_sh)  # back to the CPU master
            frozen = _pick(state.params, self.frozen)
            new, metrics = transacting(self._without_frozen(state), gradients)
            return new.replace(params=overlay(new.params, frozen)), metrics

        return with_bubble(step, schedule)

    def _without_frozen(self, tree: TrainState) -> TrainState:
        return tree.replace(params=select(tree.params, lambda path, _: "/".join(path) not in self.frozen))


def _path(path: KeyPath) -> str:
    return "/".join(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def _by_path(tree: PyTree) -> dict[str, PyTree]:
    return {_path(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _pick(tree: Variables, chosen: Collection[str]) -> dict[str, PyTree]:
    """The leaves of a variables-shaped tree at the chosen paths, in its nesting."""
    chosen = set(chosen)
    return select(tree, lambda path, _: "/".join(path) in chosen)


def _abstract(tree: PyTree, placement: Placement) -> PyTree:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, placement)
