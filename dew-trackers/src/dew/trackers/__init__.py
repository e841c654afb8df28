"""TensorBoard, MLflow and Weights & Biases trackers for dew, each behind an extra.

``pip install 'dew-trackers[tensorboard]'`` (or ``[mlflow]``, ``[wandb]``,
``[all]``). Importing this package imports no backend; a tracker imports its
backend when it first logs, and a tracker whose backend is missing says which
extra to install as soon as it is built.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from dew._surface import MissingDistributionError, install_hint, surface

if TYPE_CHECKING:
    from dew.trackers.mlflow import MLflowTracker as MLflowTracker
    from dew.trackers.tensorboard import TensorBoardTracker as TensorBoardTracker
    from dew.trackers.wandb import WandbTracker as WandbTracker

__getattr__, __dir__, __all__ = surface(__name__, __file__, eager=("require",))


def require(module: str, tracker: str) -> None:
    """Raise MissingDistributionError unless module can be imported (without importing it)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise MissingDistributionError(
            f"{tracker} needs {module!r}, which is not installed. {install_hint('dew-trackers', module)}"
        )
