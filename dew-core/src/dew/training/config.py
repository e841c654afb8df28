"""TrainerConfig: the trainer's part of a recipe, as typed, validated fields.

The config is plain data (pydantic, unknown keys refused). Each group of
fields reaches its owner through one function here: ``trainer_kwargs`` gives
the Trainer constructor its keywords, ``fit_kwargs`` the arguments of
``Trainer.fit``, ``checkpoint_kwargs`` those of ``Checkpoints``; the process
settings (``xla_flags``, ``multi_host``, ``compilation_cache_dir``, ``core_dumps``) are read by
``prepare_process``.

>>> config = TrainerConfig(steps=10, mesh={"fsdp": 2})
>>> config.mesh.fsdp, config.log_every
(2, 100)
"""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import Field

__all__ = [
    "BatchRampConfig",
    "LayoutConfig",
    "MeshConfig",
    "ProfileConfig",
    "TrainerConfig",
    "WandbConfig",
    "checkpoint_kwargs",
    "fit_kwargs",
    "trainer_kwargs",
]

_STRICT = pydantic.ConfigDict(extra="forbid", frozen=True)


class MeshConfig(pydantic.BaseModel):
    """Devices per sharding axis, as MeshSpec takes them; data parallelism fills the rest."""

    model_config = _STRICT

    fsdp: int = Field(1, ge=1, description="devices the parameters and optimizer state shard over")
    expert: int = Field(1, ge=1, description="devices an MoE layer's experts split over")
    tensor: int = Field(1, ge=1, description="devices the mlp, head and vocabulary widths split over")
    sequence: int = Field(1, ge=1, description="devices the sequence dimension splits over")
    stage: int = Field(1, ge=1, description="pipeline stages the layer stack splits into")
    microbatches: int | None = Field(
        None, ge=1, description="microbatches per step through the stages (a multiple of stage)"
    )
    replicas: int = Field(1, ge=1, description="host groups the data axis spans (hybrid sharding)")

    @pydantic.model_validator(mode="after")
    def _microbatches_fill_stages(self) -> MeshConfig:
        if self.microbatches is not None and self.microbatches % self.stage:
            raise ValueError(
                f"microbatches ({self.microbatches}) must be a multiple of stage ({self.stage})"
            )
        return self


Axes = str | list[str] | None


class LayoutConfig(pydantic.BaseModel):
    """How the state is placed: the rule table and the replication thresholds."""

    model_config = _STRICT

    rules: list[tuple[str, Axes]] | None = Field(
        None,
        description="[logical axis, mesh axes] pairs in precedence order; unset keeps DEFAULT_RULES",
    )
    min_shard: int = Field(2**16, ge=0, description="parameters smaller than this stay replicated")
    tolerance: float = Field(
        0.02, ge=0.0, le=1.0, description="share of shardable memory a layout may leave replicated"
    )


class ProfileConfig(pydantic.BaseModel):
    """One profiler window per fit."""

    model_config = _STRICT

    directory: str = Field(description="where the trace is written")
    steps: int = Field(ge=1, description="steps traced")
    warmup: int = Field(2, ge=0, description="steps run before the window opens")


class WandbConfig(pydantic.BaseModel):
    """A Weights & Biases run the trainer reports to as well."""

    model_config = _STRICT

    project: str
    name: str | None = None
    entity: str | None = None
    offline: bool = False


class BatchRampConfig(pydantic.BaseModel):
    """Grow the global batch from start to the dataset's batch over steps."""

    model_config = _STRICT

    start: int = Field(ge=1, description="global batch at step 0")
    steps: int = Field(ge=1, description="steps over which the batch grows to its full size")


class TrainerConfig(pydantic.BaseModel):
    """Everything the trainer, its capabilities and its loop are configured with."""

    model_config = _STRICT

    # held by the Trainer
    mesh: MeshConfig = Field(default_factory=MeshConfig, description="devices per sharding axis")
    layout: LayoutConfig = Field(default_factory=LayoutConfig, description="state placement")
    accumulation: int = Field(1, ge=1, description="microbatches accumulated per optimizer update")
    dynamic_scale: bool = Field(False, description="dynamic loss scaling for low-precision runs")
    profile: ProfileConfig | None = Field(None, description="one profiler window per fit")
    # capabilities
    checkpoint_dir: str | None = Field(None, description="persistent checkpoint directory")
    keep: int | None = Field(3, ge=1, description="checkpoints kept; unset keeps all")
    local_checkpoint_dir: str | None = Field(
        None, description="a per-host directory for frequent local checkpoints"
    )
    local_every: int | None = Field(None, ge=1, description="steps between local checkpoints")
    wandb: WandbConfig | None = Field(None, description="also report to Weights & Biases")
    # the process
    xla_flags: list[str] = Field(default_factory=list, description="appended to XLA_FLAGS")
    multi_host: bool = Field(False, description="join the JAX process pool the environment names")
    compilation_cache_dir: str | None = Field(None, description="persistent compilation cache")
    core_dumps: bool = Field(
        False, description="let a crash write a core file (it holds secrets from the environment)"
    )
    # the data and the loop
    batch_ramp: BatchRampConfig | None = Field(None, description="grow the batch at the start")
    steps: int | None = Field(None, ge=1, description="train until this step")
    epochs: float | None = Field(
        None, gt=0, description="or train this many passes over the data (when steps is unset)"
    )
    log_every: int = Field(100, ge=1, description="steps between logged metrics")
    eval_every: int | None = Field(None, ge=1, description="steps between validations")
    preview: bool = Field(False, description="write the objective's preview at each validation")
    checkpoint_every: int | None = Field(None, ge=1, description="steps between checkpoints")

    @pydantic.model_validator(mode="after")
    def _length_is_given(self) -> TrainerConfig:
        if self.steps is None and self.epochs is None:
            raise ValueError("set trainer.steps (the step to finish at) or trainer.epochs")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("set trainer.steps or trainer.epochs, not both")
        if self.local_every is not None and self.local_checkpoint_dir is None:
            raise ValueError("local_every needs local_checkpoint_dir")
        return self

    def total_steps(self, steps_per_epoch: int | None = None) -> int:
        """The step to finish at: steps, or epochs over a dataset of steps_per_epoch."""
        if self.steps is not None:
            return self.steps
        if steps_per_epoch is None:
            raise ValueError(
                "trainer.epochs needs a dataset that knows its size (records); this one does "
                "not, so set trainer.steps instead."
            )
        assert self.epochs is not None
        return max(1, round(self.epochs * steps_per_epoch))


def trainer_kwargs(config: TrainerConfig) -> dict[str, Any]:
    """The Trainer constructor's keywords for the fields a trainer holds.

    mesh, layout, accumulation, dynamic_scale and profile; everything else
    reaches its owner elsewhere (see the module docstring).
    """
    from dew.training.layout import DEFAULT_RULES, Layout
    from dew.training.mesh import MeshSpec
    from dew.training.profiling import ProfileWindow

    rules = DEFAULT_RULES
    if config.layout.rules is not None:
        rules = tuple(
            (name, tuple(axes) if isinstance(axes, list) else axes)
            for name, axes in config.layout.rules
        )
    profile = None
    if config.profile is not None:
        profile = ProfileWindow(
            config.profile.directory, steps=config.profile.steps, warmup=config.profile.warmup
        )
    return {
        "mesh": MeshSpec(**config.mesh.model_dump()),
        "layout": Layout(
            rules=rules, min_shard=config.layout.min_shard, tolerance=config.layout.tolerance
        ),
        "accumulation": config.accumulation,
        "dynamic_scale": config.dynamic_scale,
        "profile": profile,
    }


def fit_kwargs(config: TrainerConfig, steps_per_epoch: int | None = None) -> dict[str, Any]:
    """Trainer.fit's keywords: the step to finish at and the loop's intervals."""
    return {
        "steps": config.total_steps(steps_per_epoch),
        "log_every": config.log_every,
        "eval_every": config.eval_every,
        "checkpoint_every": config.checkpoint_every,
        "preview": config.preview,
    }


def checkpoint_kwargs(config: TrainerConfig) -> dict[str, Any] | None:
    """Checkpoints' arguments, or None when the config names no checkpoint directory."""
    if config.checkpoint_dir is None:
        return None
    kwargs: dict[str, Any] = {"directory": config.checkpoint_dir, "keep": config.keep}
    if config.local_checkpoint_dir is not None:
        kwargs["local_directory"] = config.local_checkpoint_dir
        kwargs["local_every"] = config.local_every
    return kwargs
