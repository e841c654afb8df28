"""A tracker that appends every scalar report to a JSON-lines file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["JsonLinesTracker"]


class JsonLinesTracker:
    """One line per log call: {"step": ..., "scalars": {...}}; other reports are counted."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.artifacts = 0

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        line = json.dumps({"step": int(step), "scalars": {k: float(v) for k, v in scalars.items()}})
        with self.path.open("a") as file:
            file.write(line + "\n")

    def artifact(self, value: Any, step: int) -> None:
        self.artifacts += 1

    def close(self) -> None:
        pass
