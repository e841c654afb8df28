"""Lifecycle hooks: record each logged step's loss to the file named by an environment variable.

Set DEW_EXAMPLE_PLUGIN_LOG to a path to switch the recording on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from dew.plugins import hookimpl

__all__ = ["LOG_VARIABLE", "dew_run_end", "dew_step_end"]

LOG_VARIABLE = "DEW_EXAMPLE_PLUGIN_LOG"


def _write(record: dict) -> None:
    path = os.environ.get(LOG_VARIABLE)
    if path:
        with open(path, "a") as file:
            file.write(json.dumps(record) + "\n")


@hookimpl
def dew_step_end(step: int, metrics: Mapping[str, float]) -> None:
    _write({"hook": "dew_step_end", "step": int(step), "loss": float(metrics["train/loss"])})


@hookimpl
def dew_run_end(step: int) -> None:
    _write({"hook": "dew_run_end", "step": int(step)})
