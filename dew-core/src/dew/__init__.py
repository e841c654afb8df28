"""dew trains JAX models: a Flax model, an Objective, a Dataset and the Trainer.

Every public name here is resolved on first use, so ``import dew`` costs
almost nothing and imports no tracker backend, Grain or plugin.
"""

__path__ = __import__("pkgutil").extend_path(__path__, __name__)  # noqa: F821

from dew._lazy import Export, exporter, install_finder
from dew._lazy import MissingDistributionError as MissingDistributionError

install_finder()  # a module of an absent distribution fails naming what to install

__version__ = "0.1.0"

_EXPORTS = {
    "Trainer": Export("dew.training.trainer"),
    "TrainState": Export("dew.training.state"),
    "Checkpoints": Export("dew.training.checkpoints"),
    "MeshSpec": Export("dew.training.mesh"),
    "Layout": Export("dew.training.layout"),
    "Dataset": Export("dew.data.base"),
    "DataPartition": Export("dew.data.base"),
    "Objective": Export("dew.objectives.base"),
    "models": Export("dew.models", attribute=""),
    "registry": Export("dew.registry", attribute=""),
    "plugins": Export("dew.plugins", attribute=""),
    "profile": Export("dew.telemetry.profiling"),
    "Pretrained": Export("dew.pretrained.model"),
}

__getattr__, __dir__ = exporter(__name__, _EXPORTS)
__all__ = sorted([*_EXPORTS, "MissingDistributionError"])
