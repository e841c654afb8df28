"""TensorBoard, MLflow and Weights & Biases trackers for dew, each behind an extra.

``pip install 'dew-trackers[tensorboard]'`` (or ``[mlflow]``, ``[wandb]``,
``[all]``). Importing this package imports no backend; a tracker imports its
backend when it first logs, and a tracker whose backend is missing says which
extra to install as soon as it is built.
"""

from __future__ import annotations

import importlib.util

from dew._lazy import Export, MissingDistributionError, exporter

_EXPORTS = {
    "TensorBoardTracker": Export("dew.trackers.tensorboard", "dew-trackers", "tensorboard"),
    "MLflowTracker": Export("dew.trackers.mlflow", "dew-trackers", "mlflow"),
    "WandbTracker": Export("dew.trackers.wandb", "dew-trackers", "wandb"),
}

__getattr__, __dir__ = exporter(__name__, _EXPORTS)
__all__ = sorted([*_EXPORTS, "require"])


def require(module: str, extra: str, tracker: str) -> None:
    """Raise MissingDistributionError unless module can be imported (without importing it)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise MissingDistributionError(
            f"{tracker} needs {module!r}, which is not installed. It ships with the "
            f"{extra!r} extra: pip install 'dew-trackers[{extra}]'"
        )
