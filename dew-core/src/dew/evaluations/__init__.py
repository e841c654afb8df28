"""Evaluation tasks: scores a trained model earns on a task's own records (multiple choice,
exact-match generation), run on a cadence during training and by ``dew eval --task``.

The protocol and the scheduling live here (dew-core); the tasks are registered in the
``dew.evaluations`` entry-point group (dew's own in dew-objectives), exactly as a third
party registers one.
"""

from __future__ import annotations

__path__ = __import__("pkgutil").extend_path(__path__, __name__)  # noqa: F821

from typing import TYPE_CHECKING

from dew._surface import surface

if TYPE_CHECKING:
    from dew.evaluations.base import EvaluationTask as EvaluationTask
    from dew.evaluations.base import Periodic as Periodic
    from dew.evaluations.base import Subject as Subject
    from dew.evaluations.base import TaskFileError as TaskFileError
    from dew.evaluations.base import scheduled as scheduled
    from dew.evaluations.config import EvaluateConfig as EvaluateConfig

__getattr__, __dir__, __all__ = surface(__name__, __file__)
