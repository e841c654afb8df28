"""The Trainer: runs an Objective over a Dataset on a device mesh.

Read it top to bottom: ``fit`` places the state (``place``), compiles one
step (``compile``), then loops. The host reads a step's metrics only at log
steps, and then one step late, so it never waits on the device otherwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.data.base import DataPartition, Dataset, Resumable
from dew.objectives.base import Effects, Loss, Metric, Objective, Variables
from dew.training.ema import ema_mask
from dew.training.layout import Layout, Placement
from dew.training.mesh import (
    BatchMismatchError,
    MeshSpec,
    build_mesh,
    check_batch,
    data_partition,
    shard_batch,
)
from dew.training.state import Scaler, TrainState, Window
from dew.training.step import StepFn, build_train_step

__all__ = ["CompiledStep", "NonFiniteLossError", "ResumeMismatchError", "Rollout", "Trainer"]

Initializer = Variables | None
_INIT_SALT = 0x1D17  # folds the run key into the initialization key
_NONFINITE_LIMIT = 5  # consecutive rejected steps (without a loss scaler) that stop a run
_NONFINITE_LIMIT_SCALED = 50


class NonFiniteLossError(FloatingPointError):
    """Too many consecutive steps had a non-finite loss or gradient."""


class ResumeMismatchError(ValueError):
    """A checkpoint was written with another accumulation length or loss-scaler configuration."""


class Rollout(Protocol):
    """Produce a batch on the host, before the compiled step reads it."""

    def __call__(self, state: TrainState, batch: Mapping[str, Any], key: jax.Array) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class CompiledStep:
    """One compiled transaction: ``new = step(old, batch)``; the old state is consumed."""

    executable: Any
    batch_shapes: dict[str, jax.ShapeDtypeStruct]

    def __call__(self, state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
        return self.executable(state, batch)


class Trainer(Generic[Loss, Effects]):
    """Runs an Objective: gradients, sharding, EMA, checkpoints, logging.

    Configure it; do not subclass it to change the loop. ``step`` replaces
    the compiled transaction (a factory of (state, batch) -> (state,
    metrics)), ``rollout`` produces each batch on the host first.
    """

    def __init__(
        self,
        objective: Objective[Loss, Effects],
        optimizer: optax.GradientTransformation,
        *,
        key: jax.Array,
        mesh: MeshSpec = MeshSpec(),
        layout: Layout = Layout(),
        accumulation: int = 1,
        dynamic_scale: bool = False,
        checkpoints: Any = None,
        tracker: Any = None,
        step: Callable[[Objective[Loss, Effects], optax.GradientTransformation], StepFn] | None = None,
        rollout: Rollout | None = None,
        profile: Any = None,
    ) -> None:
        if accumulation < 1:
            raise ValueError(f"accumulation must be at least 1, got {accumulation}.")
        if isinstance(key, jax.Array) and not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)
        self.objective = objective
        self.optimizer = optimizer
        self.key = key
        self.mesh = mesh
        self.layout = layout
        self.accumulation = accumulation
        self.dynamic_scale = dynamic_scale
        self.checkpoints = checkpoints
        self.tracker = tracker
        self.step_factory = step
        self.rollout = rollout
        self.profile = profile

    @classmethod
    def from_config(
        cls,
        config: Any,
        objective: Objective,
        optimizer: optax.GradientTransformation,
        *,
        key: jax.Array,
        checkpoints: Any = None,
        tracker: Any = None,
        step: Callable[[Objective, optax.GradientTransformation], StepFn] | None = None,
        rollout: Rollout | None = None,
    ) -> Trainer:
        """Build the trainer a TrainerConfig describes; the field mapping lives in config.py."""
        from dew.training.config import trainer_kwargs

        return Trainer(
            objective, optimizer, key=key, checkpoints=checkpoints, tracker=tracker,
            step=step, rollout=rollout, **trainer_kwargs(config),
        )

    # -- placement --------------------------------------------------------------
    @cached_property
    def device_mesh(self) -> Mesh:
        """The mesh MeshSpec describes over this process pool's devices, built on first use."""
        return build_mesh(self.mesh)

    def _init_key(self, key: jax.Array) -> jax.Array:
        return jax.random.fold_in(key, _INIT_SALT)

    def initial_state(self, initializer: Initializer = None, key: jax.Array | None = None) -> TrainState:
        """The state a fresh run starts from: pure, so it traces for shapes and for values."""
        key = self.key if key is None else key
        variables = nn.meta.unbox(self.objective.init(self._init_key(key), initializer))
        variables = dict(variables)
        if "params" not in variables:
            raise ValueError(
                f"{type(self.objective).__name__}.init returned collections {sorted(variables)}; "
                "it must return Flax variables with a 'params' collection."
            )
        trainable = {"params": variables["params"]}
        zero = jnp.asarray(0, jnp.int32)
        window = None
        if self.accumulation > 1:
            window = Window(
                grads=jax.tree.map(jnp.zeros_like, trainable),
                count=jnp.asarray(0.0, jnp.float32), filled=zero,
            )
        return TrainState(
            params=variables,
            opt_state=self.optimizer.init(trainable),
            key=jax.random.key_data(key),
            step=zero, microstep=zero, updates=zero,
            averaged=jax.tree.map(jnp.copy, variables) if self.objective.ema is not None else None,
            scaler=Scaler.create() if self.dynamic_scale else None,
            window=window,
        )

    @cached_property
    def _boxed_variables(self) -> Any:
        """The objective's variables as shapes, with the logical axes its modules declare."""
        return jax.eval_shape(lambda k: self.objective.init(self._init_key(k)), self.key)

    @cached_property
    def _abstract_state(self) -> TrainState:
        return jax.eval_shape(self.initial_state)

    def shardings(self, state: TrainState) -> Placement:
        """Place every field of state: parameter-shaped trees follow the parameters."""
        mesh = self.device_mesh
        replicated = NamedSharding(mesh, PartitionSpec())
        params = self.layout.shardings(mesh, self._boxed_variables)
        by_path = {
            _names(path): sharding
            for path, sharding in jax.tree_util.tree_flatten_with_path(params)[0]
        }
        shapes = {
            _names(path): leaf.shape
            for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]
        }

        def follow(path: Any, leaf: Any) -> NamedSharding:
            names = _names(path)
            for start in range(len(names)):
                tail = names[start:]
                if tail in by_path and shapes[tail] == getattr(leaf, "shape", None):
                    return by_path[tail]
            return replicated

        def place(tree: Any) -> Any:
            return jax.tree_util.tree_map_with_path(follow, tree)

        return TrainState(
            params=params,
            opt_state=place(state.opt_state),
            key=replicated, step=replicated, microstep=replicated, updates=replicated,
            averaged=params if state.averaged is not None else None,
            scaler=jax.tree.map(lambda _: replicated, state.scaler) if state.scaler is not None else None,
            window=place(state.window) if state.window is not None else None,
        )

    def _meta(self) -> dict[str, Any]:
        scaler = None
        if self.dynamic_scale:
            s = Scaler.create()
            scaler = {"growth_interval": s.growth_interval, "factor": s.factor, "minimum": s.minimum}
        return {"accumulation": self.accumulation, "scaler": scaler, "ema": self.objective.ema is not None}

    def place(self) -> tuple[TrainState, Placement, bytes | None]:
        """Put the state on the mesh, fresh or restored from the latest checkpoint.

        Returns the state, its shardings and the data position a resume continues from.
        """
        abstract = self._abstract_state
        shardings = self.shardings(abstract)
        self.layout.check(abstract.params, shardings.params, self.device_mesh)
        if self.checkpoints is not None and self.checkpoints.latest is not None:
            template = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
            )
            restored = self.checkpoints.restore(template, partition=data_partition(self.device_mesh))
            self._check_resume(restored.meta, restored.step)
            return restored.state, shardings, restored.position
        state = jax.jit(self.initial_state, out_shardings=shardings)()
        return state, shardings, None

    def _check_resume(self, meta: Mapping[str, Any], step: int) -> None:
        mine = self._meta()
        differing = [k for k in ("accumulation", "scaler") if k in meta and meta[k] != mine[k]]
        if differing:
            details = "; ".join(f"{k}: checkpoint {meta[k]!r}, this trainer {mine[k]!r}" for k in differing)
            raise ResumeMismatchError(
                f"The checkpoint at step {step} was written by a trainer configured differently "
                f"({details}). Resume with the configuration it was trained with, or start a new "
                "checkpoint directory."
            )

    # -- compilation ----------------------------------------------------------------
    def _step_function(self) -> StepFn:
        if self.step_factory is not None:
            return self.step_factory(self.objective, self.optimizer)
        ema = self.objective.ema
        selected = None
        if ema is not None:
            selected = ema_mask(ema, self._abstract_state.params)
        return build_train_step(
            self.objective, self.optimizer, accumulation=self.accumulation, ema=ema,
            ema_selected=selected,
        )

    def compile(self, state: TrainState, batch: Mapping[str, jax.Array]) -> CompiledStep:
        """Compile the transaction over state and one global batch; the state is donated."""
        mesh = self.device_mesh
        shardings = self.shardings(state)
        batch_sh = jax.tree.map(lambda x: x.sharding, dict(batch))
        jitted = jax.jit(
            self._step_function(), in_shardings=(shardings, batch_sh),
            out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
            donate_argnums=(0,),
        )
        shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), mesh, nn.logical_axis_rules(self.layout.axis_rules):
            executable = jitted.lower(state, shapes).compile()
        return CompiledStep(executable, {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()})

    # -- the loop ---------------------------------------------------------------------
    def fit(
        self,
        dataset: Dataset,
        *,
        steps: int,
        log_every: int = 100,
        eval_every: int | None = None,
        checkpoint_every: int | None = None,
        metrics: Sequence[Metric] = (),
        preview: bool = False,
    ) -> TrainState:
        """Train until the step counter reaches steps, resuming from the latest checkpoint."""
        from dew.training.loop import Loop

        return Loop(self, dataset, steps=steps, log_every=log_every, eval_every=eval_every,
                    checkpoint_every=checkpoint_every, metrics=tuple(metrics), preview=preview).run()

    # -- used by the loop -----------------------------------------------------------------
    def open_stream(self, dataset: Dataset, partition: DataPartition, position: bytes | None) -> Iterator:
        """Open this process's training stream, continued from position when one was saved."""
        iterator = iter(dataset.train(partition))
        if position is not None:
            if isinstance(iterator, Resumable):
                iterator.set_state(position)
            else:
                warnings.warn(
                    "The checkpoint holds a data position but the training iterator has no "
                    "set_state; the stream restarts from its beginning and may replay records.",
                    stacklevel=3,
                )
        return iterator

    def prepare_batch(self, state: TrainState, batch: Mapping[str, Any], step: int) -> Mapping[str, Any]:
        """Run the rollout, if any, on a host batch, and check the keys the objective reads."""
        if self.rollout is not None:
            batch = self.rollout(state, batch, jax.random.fold_in(state.rng, step))
        required = tuple(self.objective.required_keys())
        missing = [k for k in required if k not in batch]
        if missing:
            raise BatchMismatchError(
                f"The batch has no key {', '.join(map(repr, missing))}, which "
                f"{type(self.objective).__name__} reads; the batch holds {sorted(batch)}."
            )
        return batch

    def shard(self, batch: Mapping[str, Any], partition: DataPartition,
              expected: Mapping[str, Any] | None = None) -> dict[str, jax.Array]:
        """Put this process's share of a batch on the mesh, checked against expected if given."""
        batch = {k: v if isinstance(v, jax.Array) else np.asarray(v) for k, v in batch.items()}
        if expected is not None:
            check_batch(batch, expected, partition)
            batch = {k: batch[k] for k in expected}
        return shard_batch(batch, self.device_mesh, partition)

def _names(path: Sequence[Any]) -> tuple[str, ...]:
    """The dictionary keys along a pytree path (sequence and attribute steps dropped)."""
    return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def nonfinite_limit(dynamic_scale: bool) -> int:
    return _NONFINITE_LIMIT_SCALED if dynamic_scale else _NONFINITE_LIMIT

