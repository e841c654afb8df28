"""The trainer and what it is built from.

dew.training knows no modality: it imports nothing from dew.diffusion,
dew.inputs or dew.sampling, and a tracker backend only when that tracker
logs. Every name below is imported on first use; the tracker classes come
from dew-trackers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dew._surface import surface

if TYPE_CHECKING:
    from dew.adapters.lora import Lora as Lora
    from dew.adapters.lora import adapters_only as adapters_only
    from dew.adapters.lora import apply_lora as apply_lora
    from dew.adapters.lora import merge_lora as merge_lora
    from dew.adapters.quantization import Quantization as Quantization
    from dew.adapters.quantization import apply_quantization as apply_quantization
    from dew.checkpoints.manager import Checkpoints as Checkpoints
    from dew.objectives.base import Aux as Aux
    from dew.objectives.base import EMASpec as EMASpec
    from dew.objectives.base import Metric as Metric
    from dew.objectives.base import Objective as Objective
    from dew.objectives.base import Step as Step
    from dew.objectives.base import cosine_decay as cosine_decay
    from dew.objectives.base import everything as everything
    from dew.objectives.base import under as under
    from dew.trackers.mlflow import MLflowTracker as MLflowTracker
    from dew.trackers.tensorboard import TensorBoardTracker as TensorBoardTracker
    from dew.trackers.wandb import WandbTracker as WandbTracker
    from dew.tracking.composite import Trackers as Trackers
    from dew.tracking.local import LocalTracker as LocalTracker
    from dew.tracking.protocol import Tracker as Tracker
    from dew.training.config import TrainerConfig as TrainerConfig
    from dew.training.ema import ema_update as ema_update
    from dew.training.evaluation import Evaluation as Evaluation
    from dew.training.evaluation import evaluate as evaluate
    from dew.training.initializers import ParamsFrom as ParamsFrom
    from dew.training.optim import build_optimizer as build_optimizer
    from dew.training.placement.layout import DEFAULT_RULES as DEFAULT_RULES
    from dew.training.placement.layout import Layout as Layout
    from dew.training.placement.mesh import MeshSpec as MeshSpec
    from dew.training.placement.mesh import build_mesh as build_mesh
    from dew.training.placement.mesh import data_partition as data_partition
    from dew.training.placement.mesh import shard_batch as shard_batch
    from dew.training.profiling import ProfileWindow as ProfileWindow
    from dew.training.protocols import Rollout as Rollout
    from dew.training.runtime.preemption import Preempted as Preempted
    from dew.training.runtime.preemption import PreemptionNotice as PreemptionNotice
    from dew.training.runtime.process import prepare_process as prepare_process
    from dew.training.runtime.process import run_timestamp as run_timestamp
    from dew.training.state import TrainState as TrainState
    from dew.training.step import write_back as write_back
    from dew.training.trainer import Trainer as Trainer

__getattr__, __dir__, __all__ = surface(__name__, __file__, elsewhere="dew-trackers")
