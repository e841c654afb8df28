"""The state a fresh run starts from: the objective's variables as shapes, the starting weights, the init.

``Start`` traces the objective's init once for the shapes (with the logical
axes its modules declare, which the layout places by), reads a configured
weight source once and keeps it until the devices hold it, and gives the
pure ``initial_state`` an execution compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cached_property

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from dew.errors import DewError
from dew.objectives.base import Objective, Variables, check_signature
from dew.training.execution import follower
from dew.training.initializers import Initializer, WeightSource, compare_trees, place_weights
from dew.training.optim import ParamGroup, matches
from dew.training.program import Program
from dew.training.state import TrainState, stream
from dew.training.trees import paths, select, trains

__all__ = ["FrozenTrainedError", "Start"]


class FrozenTrainedError(DewError, ValueError):
    """The optimizer was configured to train a variable the objective declares frozen."""


class Start:
    """Where a run's fresh state comes from: the program's parts around the objective's init."""

    def __init__(self, program: Program, key: jax.Array, initializer: Initializer = None) -> None:
        self.program = program
        self.objective: Objective = program.objective
        self.key = key
        self.initializer = initializer
        self._source_weights: Variables | None = None

    def initial_state(self, initializer: Initializer = None, key: jax.Array | None = None) -> TrainState:
        """The state a fresh run starts from: pure, so it traces for shapes and for values."""
        key = self.key if key is None else key
        if initializer is None and self.initializer is None:
            return self._fresh(key)[1]
        if initializer is None:
            weights = self.read_weights()
        elif isinstance(initializer, WeightSource):  # a source other than the run's, read here
            weights = nn.meta.unbox(initializer(nn.meta.unbox(self.boxed)))
        else:
            weights = initializer
        return self.program.fresh(self._init_from(stream(key, "init"), weights), key)

    def _init_from(self, key: jax.Array, weights: Variables | None) -> Variables:
        """The objective's init given the weights the run starts from, its signature checked."""
        try:
            return self.objective.init(key, weights)
        except TypeError as error:
            check_signature(self.objective, "init", error, key, weights)
            raise

    @cached_property
    def _shapes(self) -> tuple[Variables, TrainState]:
        """The fresh variables with their logical axes, and the abstract state: one trace of init
        when the run starts from a random init."""
        if self.initializer is not None:
            boxed = jax.eval_shape(lambda k: self.objective.init(stream(k, "init")), self.key)
            self.__dict__["boxed"] = boxed  # a source reads these below
            weights = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), self.read_weights())
            # The weights are an argument, so init sees tracers it can compute on (a copy, say).
            return boxed, jax.eval_shape(self.initial_state, weights, self.key)

        return jax.eval_shape(self._fresh, self.key)

    @cached_property
    def _fresh(self) -> Callable[[jax.Array], tuple[Variables, TrainState]]:
        """A random init and the state around it, as one jitted function: JAX keeps the trace
        that gave the shapes, and the compiled initializer (which calls this) reuses it, so a
        fresh run traces the objective's init once, not once more while its step compiles."""

        def both(k: jax.Array) -> tuple[Variables, TrainState]:
            boxed = self.objective.init(stream(k, "init"))
            return boxed, self.program.fresh(boxed, k)

        return jax.jit(both)

    @cached_property
    def boxed(self) -> Variables:
        """The objective's fresh variables as shapes, with the logical axes its modules declare."""
        return self._shapes[0]

    @property
    def abstract_state(self) -> TrainState:
        return self._shapes[1]

    def read_weights(self) -> Variables | None:
        """The configured weights as arrays (a source is read once, and kept until placed)."""
        if self.initializer is None or isinstance(self.initializer, Mapping):
            return None if self.initializer is None else nn.meta.unbox(self.initializer)
        if isinstance(self.initializer, WeightSource):
            if self._source_weights is None:
                self._source_weights = nn.meta.unbox(self.initializer(nn.meta.unbox(self.boxed)))
            return self._source_weights
        raise TypeError(
            f"Trainer(initializer=...) takes a variables tree or a callable source, got "
            f"{type(self.initializer).__name__}."
        )

    def weights_on_mesh(self, shardings: TrainState) -> Variables | None:
        """The starting weights, checked against a fresh init and placed like the parameters."""
        weights = self.read_weights()
        if weights is None:
            return None
        fresh = jax.eval_shape(lambda k: nn.meta.unbox(self.objective.init(stream(k, "init"))), self.key)
        given = jax.eval_shape(
            lambda w, k: nn.meta.unbox(self._init_from(stream(k, "init"), w)),
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), weights), self.key,
        )
        compare_trees(fresh, given, what="The weights the run starts from")
        follow = follower(shardings.params, self.abstract_state.params,
                          NamedSharding(jax.tree.leaves(shardings.params)[0].mesh, PartitionSpec()))
        placed = place_weights(weights, lambda name, leaf: follow(tuple(name.split("/")), leaf))
        self._source_weights = None  # the host copy is not needed once the devices hold it
        return placed

    def check_frozen_optimizer(self, groups: tuple[ParamGroup, ...]) -> None:
        """Refuse an optimizer whose parameter groups select only frozen leaves to train."""
        if self.objective.frozen is None or not groups:
            return
        variables: Variables = nn.meta.unbox(self.boxed)
        every = paths(variables)
        trainable = set(paths(select(variables, trains(self.objective.frozen))))
        for group in groups:
            if group.lr_scale == 0:
                continue
            chosen = [p for p in every if p.startswith("params/") and matches(group.match, p)]
            frozen = [p for p in chosen if p not in trainable]
            if frozen:
                raise FrozenTrainedError(
                    f"The optimizer's parameter group {list(group.match)} trains {frozen[0]}"
                    f"{f' (and {len(frozen) - 1} more frozen leaves)' if len(frozen) > 1 else ''}, "
                    f"which {type(self.objective).__name__} declares frozen. Drop the group, set its "
                    "lr_scale to 0, or change the objective's frozen filter."
                )
