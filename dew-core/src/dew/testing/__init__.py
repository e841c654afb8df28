"""Test helpers shipped with dew-core: small real components, fresh-interpreter runners, and
conformance kits.

A kit is a base test class of pytest-style ``test_*`` methods. A plugin's
suite subclasses it under a name pytest collects (``TestMyObjective``),
supplies the component through the kit's factory methods, and inherits the
checks dew relies on; dew's own components pass the same kits in dew's
suite. The kits import no pytest (they skip with ``unittest.SkipTest``), so
they also run when called directly. Nothing here is imported by
``import dew``, and each name is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dew._surface import surface

if TYPE_CHECKING:
    from dew.testing.dataset import DatasetReaderKit as DatasetReaderKit
    from dew.testing.devices import FakeDeviceRunError as FakeDeviceRunError
    from dew.testing.devices import call_on_fake_devices as call_on_fake_devices
    from dew.testing.devices import run_on_fake_devices as run_on_fake_devices
    from dew.testing.environment import EnvironmentKit as EnvironmentKit
    from dew.testing.evaluation import EvaluationTaskKit as EvaluationTaskKit
    from dew.testing.model import ModelKit as ModelKit
    from dew.testing.objective import ObjectiveKit as ObjectiveKit
    from dew.testing.objective import gradient_recorder as gradient_recorder
    from dew.testing.objective import split_rows as split_rows
    from dew.testing.reward import RewardKit as RewardKit
    from dew.testing.rollout import RolloutKit as RolloutKit
    from dew.testing.tracker import TrackerKit as TrackerKit

__getattr__, __dir__, __all__ = surface(__name__, __file__)
