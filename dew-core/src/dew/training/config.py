"""TrainerConfig: the trainer's part of a recipe, as typed, validated fields.

A recipe's ``trainer`` section is one flat table, but every group of its
fields is defined, validated and read by its owner, and TrainerConfig is
their union:

- ``TrainerSettings`` (here): mesh, layout, accumulation, dynamic_scale and
  profile, the fields ``Trainer.from_config`` maps onto the constructor;
  mesh, layout and profile are the Trainer's own ``MeshSpec``, ``Layout``
  and ``ProfileWindow``, validated as they are;
- ``CheckpointSettings`` (dew.checkpoints.settings): checkpoint_dir,
  keep and the local checkpoints, which build the ``Checkpoints``
  (``build_checkpoints``);
- ``ProcessSettings`` (dew.training.runtime.process): xla_flags, multi_host,
  compilation_cache_dir and core_dumps, read by ``prepare_process``;
- ``Cadence`` (dew.training.cadence): steps or epochs and the intervals,
  the arguments of ``Trainer.fit``;
- wandb, the W&B tracker a recipe adds (``WandbSettings.build``), and
  batch_ramp, which wraps the dataset with ``dew.data.ramped``;
- evaluate, the evaluation tasks scored on a cadence
  (``dew.evaluations.EvaluateConfig``), which the recipe builds into the
  Trainer's ``evaluations``.

>>> config = TrainerConfig(steps=10, mesh={"fsdp": 2})
>>> config.mesh, config.log_every
(MeshSpec(fsdp=2, expert=1, tensor=1, sequence=1, stage=1, microbatches=None, replicas=1, schedule='gpipe', circular_repeats=1), 100)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pydantic
from pydantic import Field

from dew.checkpoints.settings import CheckpointSettings
from dew.evaluations.config import EvaluateConfig
from dew.settings import Settings
from dew.training.cadence import Cadence
from dew.training.placement.layout import STAGE_RULE, Layout
from dew.training.placement.mesh import MeshSpec
from dew.training.profiling import ProfileWindow
from dew.training.runtime.process import ProcessSettings

if TYPE_CHECKING:
    from dew.tracking.protocol import Tracker

__all__ = ["RUN_FILE", "BatchRamp", "TrainerConfig", "TrainerSettings", "WandbSettings"]

RUN_FILE = "run.json"  # a run's recipe, beside its checkpoints (RunConfig.save, Trainer(recipe=))

_STRICT = pydantic.ConfigDict(extra="forbid", frozen=True)


class TrainerSettings(Settings):
    """The fields a Trainer holds: where the state lives, how a step is taken, what is traced."""

    model_config = _STRICT

    mesh: MeshSpec = Field(default_factory=MeshSpec, description="devices per sharding axis")
    layout: Layout = Field(default_factory=Layout, description="state placement")
    accumulation: int = Field(1, ge=1, description="microbatches accumulated per optimizer update")
    dynamic_scale: bool = Field(False, description="dynamic loss scaling for low-precision runs")
    profile: ProfileWindow | None = Field(None, description="one profiler window per fit")

    @pydantic.field_validator("layout", mode="before")
    @classmethod
    def _unset_rules_are_the_defaults(cls, value: object) -> object:
        """A run.json written before Layout was the recipe's type says ``rules: null``; one
        written while the defaults listed the layout's own stage rule (layers -> stage) lists
        it, and it is left to the layout."""
        if isinstance(value, dict) and "rules" in value and value["rules"] is None:
            return {k: v for k, v in value.items() if k != "rules"}
        if isinstance(value, dict) and isinstance(value.get("rules"), list | tuple):
            rules = [rule for rule in value["rules"] if list(rule) != list(STAGE_RULE)]
            return {**value, "rules": rules}
        return value


class WandbSettings(Settings):
    """A Weights & Biases run the trainer reports to as well."""

    model_config = _STRICT

    project: str
    name: str | None = None
    entity: str | None = None
    offline: bool = False

    def build(self) -> Tracker:
        """The registered ``wandb`` tracker (dew-trackers[wandb]) these settings describe."""
        from dew import registry

        return registry.trackers.build("wandb", project=self.project, name=self.name,
                                       entity=self.entity, offline=self.offline)


class BatchRamp(Settings):
    """Grow the global batch from start to the dataset's batch over steps."""

    model_config = _STRICT

    start: int = Field(ge=1, description="global batch at step 0")
    steps: int = Field(ge=1, description="steps over which the batch grows to its full size")


class TrainerConfig(TrainerSettings, CheckpointSettings, ProcessSettings, Cadence):
    """Everything the trainer, its capabilities and its loop are configured with (see the module)."""

    model_config = _STRICT

    wandb: WandbSettings | None = Field(None, description="also report to Weights & Biases")
    batch_ramp: BatchRamp | None = Field(None, description="grow the batch at the start")
    evaluate: list[EvaluateConfig] = Field(
        default_factory=list, description="evaluation tasks scored every few steps ({task, every, and the task's own fields})")
