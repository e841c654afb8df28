"""The Trainer: runs an Objective over a Dataset on a device mesh.

Read ``fit`` top to bottom: it places the state (``place``), opens the feed
(stream -> rollout -> check -> shard, ``dew.training.feed``), then steps:
each batch goes through the step compiled for its shape, ``Progress``
reports what is due (reading metrics one step late, so the host never
waits on the device otherwise), and evaluation, checkpoints, a preemption
notice and a plugin's stop request are handled between steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.data.base import Dataset
from dew.errors import DewError
from dew.nn.pipeline import pipeline
from dew.objectives.base import Effects, LeafFilter, Loss, Metric, Objective, Variables
from dew.telemetry.hardware import peak_flops
from dew.tracking.progress import NonFiniteLossError, Progress
from dew.tracking.protocol import Located, Tracker
from dew.training.cadence import log_interval
from dew.training.config import RUN_FILE, TrainerSettings
from dew.training.ema import ema_leaves
from dew.training.evaluation import Evaluation, Evaluator, OutputMeans
from dew.training.feed import Feed, Signature
from dew.training.initializers import Initializer, WeightSource, compare_trees, place_weights
from dew.training.ledger import RecordLedger
from dew.training.optim import ConfiguredOptimizer, Optimizer, ParamGroup
from dew.training.owned import Execution
from dew.training.placement.layout import Layout, Placement
from dew.training.placement.mesh import MeshSpec, build_mesh, data_partition
from dew.training.placement.offload import fetching, in_host_memory
from dew.training.placement.stages import bank_sites, check_stages, schedule_of, with_bubble
from dew.training.protocols import Rollout
from dew.training.runtime.preemption import (
    Preempted,
    PreemptionWatch,
    UnsavedStopError,
)
from dew.training.state import Scaler, TrainState, Window, shardings_state, stream
from dew.training.step import StepFn, build_train_step, differentiate, follow_ema, transaction
from dew.training.trees import paths, select, trains

if TYPE_CHECKING:  # named in signatures; the trainer imports none before a run uses it
    from dew.checkpoints.manager import Checkpoints
    from dew.evaluations.base import Periodic
    from dew.training.profiling import ProfileWindow

__all__ = [
    "CompiledStep",
    "FrozenTrainedError",
    "NonFiniteLossError",
    "ResumeMismatchError",
    "Rollout",
    "StepCompositionError",
    "Trainer",
]


class ResumeMismatchError(DewError, ValueError):
    """A checkpoint was written with another accumulation length or loss-scaler configuration."""


class StepCompositionError(DewError, ValueError):
    """A custom step was combined with a capability it cannot compose with."""


class FrozenTrainedError(DewError, ValueError):
    """The optimizer was configured to train a variable the objective declares frozen."""


@dataclass(frozen=True)
class CompiledStep:
    """One compiled transaction: ``new = step(old, batch)``; the old state is consumed."""

    executable: StepFn  # a compiled executable, or the two programs of a CPU-owned state
    batch_shapes: dict[str, jax.ShapeDtypeStruct]

    def __call__(self, state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
        return self.executable(state, batch)


class Trainer(Generic[Loss, Effects]):
    """Runs an Objective: gradients, sharding, EMA, checkpoints, logging.

    Configure it; do not subclass it to change the loop. ``step`` replaces
    the compiled transaction (a factory of (state, batch) -> (state,
    metrics)), ``rollout`` produces each batch on the host first, and
    ``initializer`` gives the weights a fresh run starts from (a variables
    tree, or a source such as ``ParamsFrom``); a run that finds its own
    checkpoint resumes from it instead. ``recipe`` is the configuration the
    run was built from, as recorded (``RunConfig.recorded``, secrets
    redacted): once the trainer holds the checkpoint directory it writes it
    there (run.json), and the run's RunStarted record carries it to the
    trackers.
    """

    def __init__(
        self,
        objective: Objective[Loss, Effects],
        optimizer: Optimizer,
        *,
        key: jax.Array,
        mesh: MeshSpec = MeshSpec(),
        layout: Layout = Layout(),
        accumulation: int = 1,
        dynamic_scale: bool = False,
        checkpoints: Checkpoints | None = None,
        tracker: Tracker | None = None,
        step: Callable[[Objective[Loss, Effects], Optimizer], StepFn] | None = None,
        rollout: Rollout | None = None,
        profile: ProfileWindow | None = None,
        initializer: Initializer = None,
        evaluations: Sequence[Periodic] = (),
        recipe: Mapping[str, Any] | None = None,
    ) -> None:
        if accumulation < 1:
            raise ValueError(f"accumulation must be at least 1, got {accumulation}.")
        if step is not None:
            _check_composition(accumulation, dynamic_scale, layout.owns_state)
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
        self.initializer = initializer
        self.evaluations = tuple(evaluations)  # tasks scored on a cadence (dew.evaluations.Periodic)
        self.recipe = recipe
        self._source_weights: Variables | None = None

    @classmethod
    def from_config(
        cls,
        config: TrainerSettings,
        objective: Objective,
        optimizer: Optimizer,
        *,
        key: jax.Array,
        checkpoints: Checkpoints | None = None,
        tracker: Tracker | None = None,
        step: Callable[[Objective, Optimizer], StepFn] | None = None,
        rollout: Rollout | None = None,
        initializer: Initializer = None,
        evaluations: Sequence[Periodic] = (),
        recipe: Mapping[str, Any] | None = None,
    ) -> Trainer:
        """Build the trainer a TrainerConfig describes: its TrainerSettings fields, mapped here.

        The other fields reach their owners elsewhere (dew.training.config).
        """
        return Trainer(
            objective, optimizer, key=key, checkpoints=checkpoints, tracker=tracker,
            step=step, rollout=rollout, initializer=initializer, evaluations=evaluations, recipe=recipe,
            mesh=config.mesh, layout=config.layout, accumulation=config.accumulation,
            dynamic_scale=config.dynamic_scale, profile=config.profile,
        )

    # -- the state ------------------------------------------------------------------
    @cached_property
    def device_mesh(self) -> Mesh:
        """The mesh MeshSpec describes over this process pool's devices, built on first use."""
        return build_mesh(self.mesh)

    @property
    def bank_sites(self) -> tuple[str, ...]:
        """The objective's scanned layer stacks ('params/model/layers', ...): the banks a host
        layout streams, and what the mesh's stage axis splits into pipeline stages."""
        return bank_sites(self._boxed_variables)

    @cached_property
    def _execution(self) -> Execution | None:
        """Where a CPU-owned state (Layout.host naming params) lives and computes; None otherwise."""
        if not self.layout.owns_state:
            return None
        mesh = self.device_mesh
        return Execution.of(mesh, self.layout.shardings(mesh, self._boxed_variables),
                            nn.meta.unbox(self._boxed_variables), self._trains)

    @property
    def _schedule(self) -> optax.Schedule | None:
        """The learning-rate schedule a configured optimizer follows (None: it does not say)."""
        return self.optimizer.schedule if isinstance(self.optimizer, ConfiguredOptimizer) else None

    @property
    def _groups(self) -> tuple[ParamGroup, ...]:
        """A configured optimizer's parameter groups (a bare optax transformation has none)."""
        return self.optimizer.groups if isinstance(self.optimizer, ConfiguredOptimizer) else ()

    @property
    def _trains(self) -> LeafFilter:
        return trains(self.objective.frozen)

    def initial_state(self, initializer: Initializer = None, key: jax.Array | None = None) -> TrainState:
        """The state a fresh run starts from: pure, so it traces for shapes and for values.

        initializer and key default to the run's own (a source is read here);
        ``place`` passes both explicitly, so the compiled initializer takes
        them as arguments.
        """
        key = self.key if key is None else key
        if initializer is None:
            weights = self._read_weights()
        elif isinstance(initializer, WeightSource):  # a source other than the run's, read here
            weights = nn.meta.unbox(initializer(nn.meta.unbox(self._boxed_variables)))
        else:
            weights = initializer
        return self._state_from(self.objective.init(stream(key, "init"), weights), key)

    def _state_from(self, variables: Variables, key: jax.Array) -> TrainState:
        """The fresh state around the variables an objective's init returned."""
        variables = dict(nn.meta.unbox(variables))
        if "params" not in variables:
            raise ValueError(
                f"{type(self.objective).__name__}.init returned collections {sorted(variables)}; "
                "it must return Flax variables with a 'params' collection."
            )
        trainable = select(variables, self._trains)
        zero = jnp.asarray(0, jnp.int32)
        window = None
        if self.accumulation > 1:
            window = Window(
                grads=jax.tree.map(jnp.zeros_like, trainable),
                count=jnp.asarray(0.0, jnp.float32), filled=zero,
            )
        ema = None
        if self.objective.ema is not None:
            ema = jax.tree.map(jnp.copy, ema_leaves(self.objective.ema, self.objective.frozen, variables))
        return TrainState(
            params=variables,
            opt_state=self.optimizer.init(trainable),
            key=jax.random.key_data(key),
            step=zero, microstep=zero, updates=zero,
            ema=ema,
            scaler=Scaler.create() if self.dynamic_scale else None,
            window=window,
        )

    @cached_property
    def _shapes(self) -> tuple[Variables, TrainState]:
        """The fresh variables with their logical axes, and the abstract state: one trace of init
        when the run starts from a random init."""
        if self.initializer is not None:
            boxed = jax.eval_shape(lambda k: self.objective.init(stream(k, "init")), self.key)
            self.__dict__["_boxed_variables"] = boxed  # a source reads these below
            weights = self._abstract_weights  # read outside the trace: a source does real work
            # The weights are an argument, so init sees tracers it can compute on (a copy, say).
            return boxed, jax.eval_shape(self.initial_state, weights, self.key)

        def both(k: jax.Array) -> tuple[Variables, TrainState]:
            boxed = self.objective.init(stream(k, "init"))
            return boxed, self._state_from(boxed, k)

        return jax.eval_shape(both, self.key)

    @cached_property
    def _boxed_variables(self) -> Variables:
        """The objective's fresh variables as shapes, with the logical axes its modules declare."""
        return self._shapes[0]

    @property
    def _abstract_state(self) -> TrainState:
        return self._shapes[1]

    @cached_property
    def _abstract_weights(self) -> Variables | None:
        """The shapes of the weights a fresh run starts from (None: a random init)."""
        if self.initializer is None:
            return None
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), self._read_weights())

    def _read_weights(self) -> Variables | None:
        """The configured weights as arrays (a source is read once, and kept until placed)."""
        if self.initializer is None or isinstance(self.initializer, Mapping):
            return None if self.initializer is None else nn.meta.unbox(self.initializer)
        if isinstance(self.initializer, WeightSource):
            if self._source_weights is None:
                self._source_weights = nn.meta.unbox(self.initializer(nn.meta.unbox(self._boxed_variables)))
            return self._source_weights
        raise TypeError(
            f"Trainer(initializer=...) takes a variables tree or a callable source, got "
            f"{type(self.initializer).__name__}."
        )

    def shardings(self, state: TrainState) -> Placement:
        """Place every field of state: parameter-shaped trees follow the parameters.

        Layout.host's fields wait in pinned host memory; a CPU-owned state sits
        on the CPU companion mesh, less its frozen parameters.
        """
        if self._execution is not None:
            return self._execution.owned(self._placement(self._execution.companion, state))
        return in_host_memory(self._placement(self.device_mesh, state), self.layout.resident_fields)

    def _placement(self, mesh: Mesh, state: TrainState) -> Placement:
        replicated = NamedSharding(mesh, PartitionSpec())
        params = self.layout.shardings(mesh, self._boxed_variables)
        follow = _follower(params, state.params, replicated)

        def place(tree: Any) -> Any:
            return jax.tree_util.tree_map_with_path(lambda path, leaf: follow(_names(path), leaf), tree)

        return shardings_state(
            params=params,
            opt_state=place(state.opt_state),
            key=replicated, step=replicated, microstep=replicated, updates=replicated,
            ema=place(state.ema) if state.ema is not None else None,
            scaler=jax.tree.map(lambda _: replicated, state.scaler) if state.scaler is not None else None,
            window=place(state.window) if state.window is not None else None,
        )

    def _meta(self) -> dict[str, Any]:
        scaler = None
        if self.dynamic_scale:
            s = Scaler.create()
            scaler = {"growth_interval": s.growth_interval, "factor": s.factor, "minimum": s.minimum}
        return {"accumulation": self.accumulation, "scaler": scaler, "ema": self.objective.ema is not None}

    def abstract_placement(self, *, checkpoint: str | None = None) -> tuple[TrainState, Placement]:
        """The state this run places, as shapes that carry their shardings, and the shardings.

        Checked as ``place`` checks it (the optimizer's groups, the pipeline
        stages, the layout's tolerance), but nothing is materialized: ``dew
        plan`` compiles the step over it for a model of any size.
        """
        self._check_frozen_optimizer()
        check_stages(self._boxed_variables, self.mesh, checkpoint=checkpoint)
        abstract = self._abstract_state
        shardings = self.shardings(abstract)
        self.layout.check(abstract.params, shardings.params, self.device_mesh)
        template = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        return template, shardings

    def place(self) -> tuple[TrainState, Placement, bytes | None]:
        """Put the state on the mesh, fresh or restored from the latest checkpoint.

        Returns the state, its shardings and the data position a resume
        continues from. A fresh state is built by the compiled initializer,
        which takes the starting weights (already sharded) and the key as
        arguments.
        """
        checkpoints = self.checkpoints
        latest = None if checkpoints is None else checkpoints.latest
        saved = None if checkpoints is None or latest is None \
            else f"the checkpoint at step {latest} in {checkpoints.directory}"
        template, shardings = self.abstract_placement(checkpoint=saved)
        if checkpoints is not None and latest is not None:
            # The saved configuration is compared before any array is read, so a changed one is named.
            restored = checkpoints.restore(template, partition=data_partition(self.device_mesh),
                                           check=self._check_resume)
            return restored.state, shardings, restored.position
        if self._execution is not None:
            weights = self._weights_on_mesh(self._execution.on_companion(shardings))
            return self._execution.initialize(self.initial_state, shardings, weights, self.key), shardings, None
        weights = self._weights_on_mesh(shardings)
        state = jax.jit(self.initial_state, out_shardings=shardings)(weights, self.key)
        return state, shardings, None

    def _weights_on_mesh(self, shardings: TrainState) -> Variables | None:
        """The starting weights, checked against a fresh init and placed like the parameters."""
        weights = self._read_weights()
        if weights is None:
            return None
        fresh = jax.eval_shape(lambda k: nn.meta.unbox(self.objective.init(stream(k, "init"))), self.key)
        given = jax.eval_shape(
            lambda w, k: nn.meta.unbox(self.objective.init(stream(k, "init"), w)),
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), weights), self.key,
        )
        compare_trees(fresh, given, what="The weights the run starts from")
        follow = _follower(shardings.params, self._abstract_state.params,
                           NamedSharding(jax.tree.leaves(shardings.params)[0].mesh, PartitionSpec()))
        placed = place_weights(weights, lambda name, leaf: follow(tuple(name.split("/")), leaf))
        self._source_weights = None  # the host copy is not needed once the devices hold it
        return placed

    def _check_frozen_optimizer(self) -> None:
        """Refuse an optimizer whose parameter groups select only frozen leaves to train."""
        if self.objective.frozen is None or not self._groups:
            return
        from dew.training.optim import matches

        every = paths(nn.meta.unbox(self._boxed_variables))
        trainable = set(paths(select(nn.meta.unbox(self._boxed_variables), self._trains)))
        for group in self._groups:
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
        return with_bubble(self._transaction(), schedule_of(self.mesh))

    def _transaction(self) -> StepFn:
        ema = self.objective.ema
        if self.step_factory is None:
            return build_train_step(self.objective, self.optimizer, accumulation=self.accumulation, ema=ema)
        custom = self.step_factory(self.objective, self.optimizer)
        if ema is None:
            return custom

        def with_ema(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
            new, metrics = custom(state, batch)
            moved = jax.lax.cond(
                new.updates != state.updates,
                lambda s: follow_ema(s, ema, previous_updates=state.updates),
                lambda s: s,
                new,
            )
            return moved, metrics

        return with_ema

    def compile(self, state: TrainState, batch: Mapping[str, jax.Array]) -> CompiledStep:
        """Compile the transaction over state and one global batch; the state is donated."""
        mesh = self.device_mesh
        shardings = self.shardings(state)
        if self._execution is not None:  # two programs: forward on the devices, the optimizer on the CPU
            step = self._execution.compile(
                differentiate(self.objective),
                transaction(self.optimizer, accumulation=self.accumulation, ema=self.objective.ema,
                            frozen=self.objective.frozen),
                state, shardings, batch, rules=self.layout.axis_rules, schedule=schedule_of(self.mesh))
            return CompiledStep(with_bubble(step, schedule_of(self.mesh)),
                                {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()})
        batch_sh = jax.tree.map(lambda x: x.sharding, dict(batch))
        jitted = jax.jit(
            fetching(self._step_function(), shardings, self.layout.resident_fields), in_shardings=(shardings, batch_sh),
            out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
            donate_argnums=(0,),
        )
        shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
        with jax.set_mesh(mesh), nn.logical_axis_rules(self.layout.axis_rules), \
                pipeline(schedule_of(self.mesh)):
            executable = jitted.lower(state, shapes).compile()
        return CompiledStep(executable, {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()})

    def _compile_for(self, progress: Progress, state: TrainState, batch: Mapping[str, jax.Array]) -> CompiledStep:
        """Compile the step for a new batch shape, saying so, and measure what a step processes."""
        shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
        rows = next((v.shape[0] for v in shapes.values() if v.shape), 0)
        began = time.perf_counter()
        step = self.compile(state, batch)
        seconds = time.perf_counter() - began
        progress.compiled(seconds)
        progress.note(f"compiling the step for batches of {rows} rows: {seconds:.2f} s")
        devices = self.device_mesh.devices.flat
        progress.measure(records=rows, tokens=self.objective.tokens(shapes),
                         flops=self.objective.flops(shapes),
                         peak_flops=peak_flops(next(iter(devices)).device_kind))
        return step

    def _ledger(self) -> RecordLedger | None:
        """The run's data ledger, beside its checkpoints (process 0 writes it for the pool)."""
        directory = None if self.checkpoints is None else self.checkpoints.directory
        if not isinstance(directory, Path) or jax.process_index() != 0:
            return None  # no run directory, another process's, or a bucket (no appends there)
        return RecordLedger(directory, processes=jax.process_count())

    @cached_property
    def _evaluator(self) -> Evaluator:
        return Evaluator(self.objective, self.device_mesh)

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
        steps = int(steps)
        every = log_interval(steps, log_every)  # a run shorter than log_every still logs
        progress = Progress(tracker=self.tracker, records_per_step=dataset.batch,
                            log_every=every, dynamic_scale=self.dynamic_scale,
                            schedule=self._schedule)
        mesh = self.device_mesh
        if self.checkpoints is not None:
            self.checkpoints.acquire()  # refuse a second writer before training, not at the first save
            if self.recipe is not None and jax.process_index() == 0:
                _write_recipe(self.checkpoints.directory, self.recipe)  # only the writer writes it
        state, _, position = self.place()
        start = int(jax.device_get(state.step))
        if start >= steps:
            return state
        feed = Feed(dataset, mesh, data_partition(mesh), required=tuple(self.objective.required_keys()),
                    rollout=self.rollout, ramp_sizes=frozenset(int(size) for _, size in dataset.ramp),
                    check=self.objective.check_batch, ledger=self._ledger())
        feed.open(position, resuming=start > 0, start=start)
        progress.start(self, start, steps, mesh.shape, recipe=self.recipe)
        if every != log_every:
            progress.note(f"log_every={log_every} is more than the run's {steps} steps: logging "
                          f"every {every} step{'s' if every > 1 else ''} instead (and the last)")
        if self.checkpoints is not None:
            progress.note(f"checkpoints: {self.checkpoints.directory}")
        written: Sequence[str] = self.tracker.directories() if isinstance(self.tracker, Located) else ()
        for where in written:
            progress.note(f"tracking: {where}")
        profile = self.profile.schedule(start) if self.profile is not None else None
        if profile is not None:
            profile.on_step(start)  # a window without warmup opens before the first step
        compiled: dict[Signature, CompiledStep] = {}
        saved: int | None = None
        done = start
        try:
            with PreemptionWatch() as watch:
                for step in range(start, steps):
                    fed = feed.next(state, step)
                    if fed.signature not in compiled:
                        compiled[fed.signature] = self._compile_for(progress, state, fed.batch)
                    state, step_metrics = compiled[fed.signature](state, fed.batch)
                    done = step + 1
                    progress.stepped(done, {**step_metrics, **fed.scalars}, first=step == start)
                    if step == start and self.checkpoints is not None:
                        self.checkpoints.prepare(state)  # compiles the leaf digests off the loop
                    if profile is not None:
                        record = profile.on_step(done, state)
                        if record is not None:
                            progress.record(record, done)
                    stopping = progress.stop_requested is not None
                    last = done == steps or stopping
                    if eval_every and done % eval_every == 0 and not last:
                        self._evaluate(progress, dataset, state, done, metrics, preview)
                    for task in self.evaluations:
                        if task.due(done, last):
                            self._score_task(progress, task, state, done)
                    if self.checkpoints is not None:
                        local_every = self.checkpoints.local_every
                        if last or (checkpoint_every and done % checkpoint_every == 0):
                            saved = self._save(progress, feed, state, done)
                        elif local_every and done % local_every == 0:
                            self._save(progress, feed, state, done, local=True)
                    if watch.reached(done):
                        progress.note(watch.stopping(done, saving=self.checkpoints is not None and saved != done))
                        progress.drain()
                        if self.checkpoints is None:
                            raise UnsavedStopError(done, status=watch.status)
                        if saved != done:
                            saved = self._save(progress, feed, state, done)
                        self._finish_saves(progress)
                        progress.hooks.dew_preempted(step=done)
                        raise Preempted(done, status=watch.status)
                    if stopping:
                        progress.note(f"step {done}: stopping early: {progress.stop_requested}")
                        break
            progress.drain()
            if dataset.val is not None or preview:  # the last step's scores and preview
                self._evaluate(progress, dataset, state, done, metrics, preview)
            self._finish_saves(progress)
        except BaseException as error:
            if not isinstance(error, Preempted):
                self._abandon_saves(error)
            progress.close()
            raise
        finally:
            feed.close()
            if profile is not None:
                profile.close()
        progress.finish(done, state, progress.clock.goodput(feed.clock.data, feed.clock.rollout, feed.clock.reward))
        return state

    def _evaluate(self, progress: Progress, dataset: Dataset, state: TrainState, done: int,
                  metrics: Sequence[Metric], preview: bool) -> Evaluation | None:
        if dataset.val is None and not preview:
            return None
        began = time.perf_counter()
        variables, averaged = (state.params, state.averaged) if self._execution is None \
            else self._execution.readable(state)  # a CPU-owned state is read from an accelerator copy
        result = self._evaluator(
            variables, dataset.val, key=state.rng, metrics=tuple(metrics) or (OutputMeans(),),
            step=done, averaged=averaged, preview=preview and self.tracker is not None,
            schedule_step=int(jax.device_get(state.updates)),
        )
        progress.clock.eval += time.perf_counter() - began
        progress.evaluation(result, done)
        return result

    def _score_task(self, progress: Progress, task: Periodic, state: TrainState, done: int) -> None:
        """Score one scheduled evaluation task on the live parameters and report it."""
        began = time.perf_counter()
        variables = state.params if self._execution is None else self._execution.readable(state)[0]
        result = task(variables, mesh=self.device_mesh, step=done)
        progress.clock.eval += time.perf_counter() - began
        progress.evaluation(result, done)

    def _save(self, progress: Progress, feed: Feed, state: TrainState, done: int, *,
              local: bool = False) -> int:
        # The steps already dispatched finish first: their time is the steps' (the loop runs
        # ahead of the device by up to log_every steps), not the checkpoint's.
        checkpoints = self.checkpoints
        assert checkpoints is not None  # the loop saves only when the trainer has checkpoints
        began = time.perf_counter()
        jax.block_until_ready(state)
        in_flight = time.perf_counter() - began
        began = time.perf_counter()
        checkpoints.save(done, state, position=feed.position(), partition=feed.partition,
                         meta=self._meta(), local=local)
        blocked = time.perf_counter() - began
        progress.clock.checkpoint += blocked
        path = str(checkpoints.path(done))
        progress.note(f"step {done}: checkpoint {'(local) ' if local else ''}handed to the writer, "
                      f"the loop blocked {blocked:.2f} s, after {in_flight:.2f} s finishing the "
                      f"steps in flight ({path})")
        progress.checkpoint(done, path)
        return done

    def _finish_saves(self, progress: Progress) -> None:
        """Wait for the writes under way, so a program that exits after fit loses no step."""
        if self.checkpoints is None:
            return
        began = time.perf_counter()
        self.checkpoints.wait()
        progress.clock.checkpoint += time.perf_counter() - began

    def _abandon_saves(self, error: BaseException) -> None:
        """On a failing fit, finish the checkpoint already handed to the writer, and say so."""
        if self.checkpoints is None:
            return
        try:
            self.checkpoints.wait()
        except Exception as failure:  # noqa: BLE001 - the fit's own error is the one to raise
            error.add_note(f"dew: the checkpoint being written when the fit failed was not completed "
                           f"({failure}); the previous committed step is kept.")
            print(f"dew: fit failed; the checkpoint under way was abandoned ({failure})",
                  file=sys.stderr, flush=True)


def _write_recipe(directory: str | os.PathLike, recipe: Mapping[str, Any]) -> None:
    """The run's recipe beside its checkpoints (run.json), as RunConfig.save writes it."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    (target / RUN_FILE).write_text(json.dumps(recipe, indent=2) + "\n")


def _check_composition(accumulation: int, dynamic_scale: bool, owns_state: bool) -> None:
    """A custom step replaces the transaction in which accumulation and loss scaling happen."""
    if owns_state:
        raise StepCompositionError(
            "Trainer(step=...) is one program over the whole state, but Layout.host=('params',) "
            "splits every step in two (gradients on the accelerators, the optimizer on the CPU), "
            "which a custom step cannot be cut into. Drop step=, or keep the parameters on the "
            "devices with Layout.host=('opt_state', 'ema')."
        )
    refused = []
    if accumulation > 1:
        refused.append(f"accumulation={accumulation}")
    if dynamic_scale:
        refused.append("dynamic_scale=True")
    if refused:
        raise StepCompositionError(
            f"Trainer(step=...) replaces the compiled transaction, which is where "
            f"{' and '.join(refused)} would happen, so the trainer cannot apply "
            f"{'them' if len(refused) > 1 else 'it'} around a custom step. Implement "
            f"{'them' if len(refused) > 1 else 'it'} inside the step factory and drop "
            f"{' and '.join(refused)}, or drop step=. (An objective's EMA does compose: the "
            "trainer moves it after every update the custom step makes.)"
        )


def _names(path: Sequence[Any]) -> tuple[str, ...]:
    """The dictionary keys along a pytree path (sequence and attribute steps dropped)."""
    return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def _follower(params: Any, abstract_params: Any, fallback: NamedSharding) -> Callable[[tuple[str, ...], Any], NamedSharding]:
    """A function giving a leaf the sharding of the parameter at its path's tail (same shape)."""
    by_path = {_names(path): sharding for path, sharding in jax.tree_util.tree_flatten_with_path(params)[0]}
    shapes = {_names(path): leaf.shape for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}

    def follow(names: tuple[str, ...], leaf: Any) -> NamedSharding:
        for start in range(len(names)):
            tail = names[start:]
            if tail in by_path and shapes[tail] == np.shape(leaf):
                return by_path[tail]
        return fallback

    return follow
