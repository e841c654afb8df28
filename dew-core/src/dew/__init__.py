"""dew trains JAX models: a Flax model, an Objective, a Dataset and the Trainer.

The names below are imported on first use, so ``import dew`` costs almost
nothing: no JAX, no tracker backend, no Grain, no plugin.
"""

from __future__ import annotations

__path__ = __import__("pkgutil").extend_path(__path__, __name__)  # noqa: F821

from typing import TYPE_CHECKING

from dew._surface import MissingDistributionError as MissingDistributionError
from dew._surface import surface

__version__ = "0.1.0"

if TYPE_CHECKING:
    from dew import models as models
    from dew import plugins as plugins
    from dew import registry as registry
    from dew.checkpoints.manager import Checkpoints as Checkpoints
    from dew.data.base import DataPartition as DataPartition
    from dew.data.base import Dataset as Dataset
    from dew.errors import DewError as DewError
    from dew.objectives.base import Objective as Objective
    from dew.pretrained.model import Pretrained as Pretrained
    from dew.telemetry.profiling import profile as profile
    from dew.training.placement.layout import Layout as Layout
    from dew.training.placement.mesh import MeshSpec as MeshSpec
    from dew.training.state import TrainState as TrainState
    from dew.training.trainer import Trainer as Trainer

__getattr__, __dir__, __all__ = surface(__name__, __file__, eager=("MissingDistributionError",))
