"""The Trainer: runs an Objective over a Dataset on a device mesh.

A facade over the engine's parts: the ``Program`` (what a step computes
and the state it starts from, dew.training.program), the ``Execution``
(where the state lives and the step runs, chosen once,
dew.training.execution), the ``Feed`` (stream -> rollout -> check -> shard)
and the hooks (dew.training.hooks). ``fit`` places the state while the
feed's first batch is read (dew.training.opening), then runs ``steps``
through the hooks (dew.training.loop).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from typing import TYPE_CHECKING, Generic

import jax
from jax.sharding import Mesh

from dew.data.base import Dataset
from dew.objectives.base import Effects, Loss, Metric, Objective
from dew.tracking.directories import check_directories
from dew.tracking.progress import NonFiniteLossError, Progress
from dew.tracking.protocol import Tracker
from dew.training import hooks, loop
from dew.training.arguments import check_parts, checked_key, fit_steps
from dew.training.cadence import log_interval
from dew.training.config import TrainerSettings
from dew.training.evaluation import Evaluator
from dew.training.execution import CompiledStep, Execution, execution_for
from dew.training.feed import Feed
from dew.training.initializers import Initializer
from dew.training.opening import Pending, builds_ahead, ending, start_placed
from dew.training.optim import ConfiguredOptimizer, Optimizer
from dew.training.placement.layout import Layout, Placement
from dew.training.placement.mesh import MeshSpec, build_mesh, data_partition
from dew.training.placement.stages import bank_sites, check_stages
from dew.training.program import Program, ResumeMismatchError, StepCompositionError
from dew.training.protocols import Rollout
from dew.training.rundir import claimed, ledger_beside, recipe_beside, rollout_settings
from dew.training.start import FrozenTrainedError, Start
from dew.training.state import TrainState
from dew.training.step import StepFn
from dew.training.trees import trains
from dew.typing import JSONObject

if TYPE_CHECKING:  # named in signatures; the trainer imports none before a run uses it
    from dew.checkpoints.manager import Checkpoints
    from dew.evaluations.base import Periodic
    from dew.training.profiling import ProfileWindow

__all__ = ["CompiledStep", "FrozenTrainedError", "NonFiniteLossError", "ResumeMismatchError", "Rollout",
           "StepCompositionError", "Trainer"]


class Trainer(Generic[Loss, Effects]):
    """Runs an Objective: gradients, sharding, EMA, checkpoints, logging.

    Configure it; do not subclass it to change the loop. ``step`` replaces
    the compiled transaction (a factory of (state, batch) -> (state,
    metrics)), ``rollout`` produces each batch on the host first, and
    ``initializer`` gives the weights a fresh run starts from (a variables
    tree, or a source such as ``ParamsFrom``); a run that finds its own
    checkpoint resumes from it instead. ``recipe`` is the configuration the
    run was built from, as recorded (``RunConfig.recorded``, secrets
    redacted): the trainer writes it beside its checkpoints (run.json), and
    the run's RunStarted record carries it to the trackers.
    """

    _overlap_start = True  # the stream starts while the state is placed (False: the old order, a baseline)

    def __init__(self, objective: Objective[Loss, Effects], optimizer: Optimizer, *, key: jax.Array,
                 mesh: MeshSpec = MeshSpec(), layout: Layout = Layout(), accumulation: int = 1,
                 dynamic_scale: bool = False, checkpoints: Checkpoints | None = None,
                 tracker: Tracker | None = None, step: Callable[[Objective[Loss, Effects], Optimizer], StepFn] | None = None,
                 rollout: Rollout | None = None, profile: ProfileWindow | None = None,
                 initializer: Initializer = None, evaluations: Sequence[Periodic] = (),
                 recipe: JSONObject | None = None) -> None:
        key = checked_key(key)  # a key of the wrong type, or a part, is named now rather than deep in fit
        check_parts(objective, optimizer, checkpoints, tracker, mesh, layout, accumulation, dynamic_scale, profile)
        self.program = Program(objective, optimizer, accumulation, dynamic_scale, step, layout.owns_state)
        self.start = Start(self.program, key, initializer)
        self.objective, self.optimizer, self.key, self.mesh, self.layout = objective, optimizer, key, mesh, layout
        self.accumulation, self.dynamic_scale = accumulation, dynamic_scale
        self.checkpoints, self.tracker, self.rollout, self.profile = checkpoints, tracker, rollout, profile
        self.initializer, self.recipe, self._ahead = initializer, recipe, False  # _ahead: fit's, for place()
        self.evaluations = tuple(evaluations)  # tasks scored on a cadence (dew.evaluations.Periodic)

    @classmethod
    def from_config(cls, config: TrainerSettings, objective: Objective, optimizer: Optimizer, *, key: jax.Array,
                    checkpoints: Checkpoints | None = None, tracker: Tracker | None = None,
                    step: Callable[[Objective, Optimizer], StepFn] | None = None, rollout: Rollout | None = None,
                    initializer: Initializer = None, evaluations: Sequence[Periodic] = (),
                    recipe: JSONObject | None = None) -> Trainer:
        """Build the trainer a TrainerConfig describes: its TrainerSettings fields, mapped here."""
        return Trainer(objective, optimizer, key=key, checkpoints=checkpoints, tracker=tracker, step=step,
                       rollout=rollout, initializer=initializer, evaluations=evaluations, recipe=recipe,
                       mesh=config.mesh, layout=config.layout, accumulation=config.accumulation,
                       dynamic_scale=config.dynamic_scale, profile=config.profile)

    # -- the parts ------------------------------------------------------------------------
    @cached_property
    def device_mesh(self) -> Mesh:
        """The mesh MeshSpec describes over this process pool's devices, built on first use."""
        return build_mesh(self.mesh)

    @cached_property
    def execution(self) -> Execution:
        """Where the state lives and the step runs: on the devices, or owned by the CPU."""
        return execution_for(self.mesh, self.device_mesh, self.layout, self.start.boxed,
                             trains(self.objective.frozen))

    @property
    def bank_sites(self) -> tuple[str, ...]:
        """The objective's scanned layer stacks ('params/model/layers', ...): the banks a host
        layout streams, and what the mesh's stage axis splits into pipeline stages."""
        return bank_sites(self.start.boxed)

    def initial_state(self, initializer: Initializer = None, key: jax.Array | None = None) -> TrainState:
        """The state a fresh run starts from (pure: it traces for shapes and for values)."""
        return self.start.initial_state(initializer, key)

    def shardings(self, state: TrainState) -> Placement:
        """Every field of state's placement, as the execution keeps it."""
        return self.execution.placement(state)

    def abstract_placement(self, *, checkpoint: str | None = None) -> tuple[TrainState, Placement]:
        """The state as shapes that carry their shardings, and the shardings, checked as ``place``
        checks them (``dew plan`` compiles the step over it for a model of any size)."""
        groups = self.optimizer.groups if isinstance(self.optimizer, ConfiguredOptimizer) else ()
        self.start.check_frozen_optimizer(groups)
        check_stages(self.start.boxed, self.mesh, checkpoint=checkpoint)
        abstract = self.start.abstract_state
        shardings = self.shardings(abstract)
        self.layout.check(abstract.params, shardings.params, self.device_mesh)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                            shardings), shardings

    def place(self) -> tuple[TrainState | Pending, Placement, bytes | None]:
        """The state on the mesh, fresh (built by the compiled initializer, within fit possibly on a thread:
        dew.training.opening.Pending) or restored, its shardings, and the position a resume continues from."""
        ahead, self._ahead = self._ahead, False
        checkpoints = self.checkpoints
        latest = None if checkpoints is None else checkpoints.latest
        saved = None if latest is None else f"the checkpoint at step {latest} in {checkpoints.directory}"  # type: ignore[union-attr]  # latest is set only with checkpoints
        template, shardings = self.abstract_placement(checkpoint=saved)
        if checkpoints is not None and latest is not None:
            # The saved configuration is compared before any array is read, so a changed one is named.
            restored = checkpoints.restore(template, partition=data_partition(self.device_mesh),
                                           check=self.program.check_resume)
            return restored.state, shardings, restored.position
        weights = self.start.weights_on_mesh(self.execution.weights_placement(shardings))
        def build() -> TrainState:
            return self.execution.initialize(self.initial_state, shardings, weights, self.key)
        return (Pending(build, template) if ahead else build()), shardings, None

    def compile(self, state: TrainState, batch: Mapping[str, jax.Array]) -> CompiledStep:
        """The step compiled over state and one global batch; the state is donated."""
        return CompiledStep(self.execution.compile(self.program, state, batch))

    @cached_property
    def _evaluator(self) -> Evaluator:
        return Evaluator(self.objective, self.device_mesh)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self, dataset: Dataset, *, steps: int, log_every: int = 100, eval_every: int | None = None,
            checkpoint_every: int | None = None, metrics: Sequence[Metric] = (), preview: bool = False) -> TrainState:
        """Train until the step counter reaches steps, resuming from the latest checkpoint."""
        steps = fit_steps(dataset, steps, log_every, eval_every, checkpoint_every)
        every = log_interval(steps, log_every)  # a run shorter than log_every still logs
        schedule = self.optimizer.schedule if isinstance(self.optimizer, ConfiguredOptimizer) else None
        progress = Progress(tracker=self.tracker, records_per_step=dataset.batch, log_every=every,
                            dynamic_scale=self.dynamic_scale, schedule=schedule)
        if jax.process_index() == 0:
            check_directories(self.tracker)  # a tracker opens its files at the first value, after steps
        with claimed(self.checkpoints):  # a second writer is refused before training
            feed = Feed(dataset, self.device_mesh, data_partition(self.device_mesh),
                        required=tuple(self.objective.required_keys()), rollout=self.rollout,
                        ramp_sizes=frozenset(int(size) for _, size in dataset.ramp), check=self.objective.check_batch,
                        ledger=ledger_beside(self.checkpoints), maker=rollout_settings(self.recipe))
            self._ahead = self._overlap_start and builds_ahead(self.execution, self.rollout, self.objective)
            state, start = start_placed(self.place, feed, self.checkpoints, steps, overlap=self._overlap_start)
            if start >= steps:  # nothing to train: the recipe the checkpoints were trained with stays
                return hooks.at_target(progress, state, start, steps, said=self.recipe is not None)  # type: ignore[arg-type]  # start_placed returns a built state here
            reporting = hooks.ProgressHook(progress, self, feed, start=start, steps=steps,
                                        notes=hooks.opening_notes(steps, log_every, every, self.checkpoints, self.tracker))
            saving = None if self.checkpoints is None else \
                hooks.Saving(self.checkpoints, feed, self.program.meta(), every=checkpoint_every, settle=progress.settle)
            concerns = [*([hooks.Profiling(self.profile, start)] if self.profile is not None else []),
                        hooks.Evaluating(self._evaluator, self.execution, dataset, every=eval_every, metrics=metrics,
                                         preview=preview, tracked=self.tracker is not None),
                        *([saving] if saving else []), hooks.Scoring(self.evaluations, self.execution),  # saved first
                        hooks.Preemption(reporting, saving)]
            with recipe_beside(self.checkpoints, self.recipe, resumed=start > 0, saving=saving), ending(feed, state):
                compile = partial(self.execution.compile, self.program)
                state = loop.run_hooks(loop.steps(state, feed, compile, self.objective, start, steps), reporting, concerns)
            return state
