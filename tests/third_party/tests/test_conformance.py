"""The plugin's model, objective and tracker pass dew's conformance kits (dew.testing).

Each class below inherits the kit's tests and supplies the component; run
``pytest tests/`` with the plugin installed beside dew-core.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from dew_example_plugin.model import Regressor
from dew_example_plugin.objective import RegressionObjective
from dew_example_plugin.tracker import JsonLinesTracker

from dew.testing import ModelKit, ObjectiveKit, TrackerKit
from dew.training.placement.layout import Layout


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
