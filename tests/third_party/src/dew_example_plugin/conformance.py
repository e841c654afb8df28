"""The plugin's conformance kits: dew.testing's checks, given this plugin's components and inputs.

Registered under the entry-point group ``dew.conformance`` (pyproject.toml), so
``dew check-plugin dew-example-plugin`` finds and runs them; tests/ collects the
same classes with pytest.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dew.testing import ModelKit, ObjectiveKit, TrackerKit
from dew.training.placement.layout import Layout
from dew_example_plugin.model import Regressor
from dew_example_plugin.objective import RegressionObjective
from dew_example_plugin.tracker import JsonLinesTracker

__all__ = ["TestJsonLinesTracker", "TestRegressionObjective", "TestRegressor"]


class TestRegressor(ModelKit):
    # 8 x 8 kernels: the default mesh (fsdp 4 x tensor 2) divides both axes.
    layout = Layout(min_shard=64)

    def model(self):
        return Regressor(features=8)

    def inputs(self):
        return (jnp.zeros((2, 8)),)


class TestRegressionObjective(ObjectiveKit):
    def objective(self):
        return RegressionObjective(inputs=4, features=1)

    def batch(self):
        x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
        return {"x": x, "y": (x @ np.arange(1, 5, dtype=np.float32)[:, None] + 1)}


class TestJsonLinesTracker(TrackerKit):
    def tracker(self, directory: Path):
        return JsonLinesTracker(str(directory / "scalars.jsonl"))

    def read_back(self, directory: Path):
        series: dict[str, list[tuple[int, float]]] = {}
        path = directory / "scalars.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)  # Python's json reads back the NaN and Infinity it wrote
            for name, value in row["scalars"].items():
                series.setdefault(name, []).append((row["step"], value))
        return series
