"""The trainer and what it is built from.

dew.training knows no modality: it imports nothing from dew.diffusion,
dew.inputs or dew.sampling, and a tracker backend only when that tracker
logs. Every name below resolves on first use.
"""

from dew._lazy import Export, exporter

_BASE = "dew.objectives.base"
_TRACKERS = "dew-trackers"
_EXPORTS = {
    "Aux": Export(_BASE),
    "EMASpec": Export(_BASE),
    "Metric": Export(_BASE),
    "Objective": Export(_BASE),
    "Step": Export(_BASE),
    "everything": Export(_BASE),
    "under": Export(_BASE),
    "TrainState": Export("dew.training.state"),
    "Trainer": Export("dew.training.trainer"),
    "Rollout": Export("dew.training.feed"),
    "MeshSpec": Export("dew.training.mesh"),
    "build_mesh": Export("dew.training.mesh"),
    "data_partition": Export("dew.training.mesh"),
    "shard_batch": Export("dew.training.mesh"),
    "Layout": Export("dew.training.layout"),
    "DEFAULT_RULES": Export("dew.training.layout"),
    "ema_update": Export("dew.training.ema"),
    "write_back": Export("dew.training.step"),
    "evaluate": Export("dew.training.evaluation"),
    "Evaluation": Export("dew.training.evaluation"),
    "Checkpoints": Export("dew.training.checkpoints"),
    "Preempted": Export("dew.training.runtime"),
    "PreemptionNotice": Export("dew.training.runtime"),
    "prepare_process": Export("dew.training.runtime"),
    "run_timestamp": Export("dew.training.runtime"),
    "Tracker": Export("dew.training.trackers"),
    "Trackers": Export("dew.training.trackers"),
    "LocalTracker": Export("dew.training.trackers"),
    "ProfileWindow": Export("dew.training.profiling"),
    "build_optimizer": Export("dew.training.optim"),
    "TrainerConfig": Export("dew.training.config"),
    "Quantization": Export("dew.training.quantization"),
    "apply_quantization": Export("dew.training.quantization"),
    "Lora": Export("dew.training.lora"),
    "apply_lora": Export("dew.training.lora"),
    "adapters_only": Export("dew.training.lora"),
    "merge_lora": Export("dew.training.lora"),
    "TensorBoardTracker": Export("dew.trackers.tensorboard", _TRACKERS, "tensorboard"),
    "MLflowTracker": Export("dew.trackers.mlflow", _TRACKERS, "mlflow"),
    "WandbTracker": Export("dew.trackers.wandb", _TRACKERS, "wandb"),
}

__getattr__, __dir__ = exporter(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
