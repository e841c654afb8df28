"""How a tracker writes values down: journal rows, and a recipe as flat fields."""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["locates_the_run", "recipe_fields", "scalar_row"]


def _finite_or_name(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


def scalar_row(scalars: Mapping[str, float], step: int) -> dict[str, object]:
    """The journal row of one log call: the step, then each value as a float or its name."""
    row: dict[str, object] = {"step": int(step)}
    for name, value in scalars.items():
        row[name] = _finite_or_name(float(value))
    return row


def locates_the_run(field: str) -> bool:
    """Whether a recipe field (dotted, as recipe_fields names it) says where the run lives, not how it
    trains: its folders, which a resume of a moved run rewrites.

    >>> [locates_the_run(f) for f in ("trainer.checkpoint_dir", "trackers.0.directory", "data.files")]
    [True, True, False]
    """
    return field in ("trainer.checkpoint_dir", "trainer.local_checkpoint_dir") or (
        field.startswith("trackers.") and field.endswith(".directory"))


def recipe_fields(config: Mapping[str, object], prefix: str = "") -> dict[str, str | int | float | bool]:
    """A recipe as flat, searchable fields: nested names joined by dots, list items by
    their index (the override syntax), None as ``"null"``, anything else as text.

    >>> recipe_fields({"trainer": {"steps": 10, "wandb": None}, "trackers": [{"name": "local"}]})
    {'trainer.steps': 10, 'trainer.wandb': 'null', 'trackers.0.name': 'local'}
    """
    fields: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            fields.update(recipe_fields(value, f"{name}."))
        elif isinstance(value, list | tuple) and value:
            fields.update(recipe_fields({str(i): v for i, v in enumerate(value)}, f"{name}."))
        elif value is None:
            fields[name] = "null"
        elif isinstance(value, bool | int | str) or (isinstance(value, float)
                                                    and math.isfinite(value)):
            fields[name] = value
        else:
            fields[name] = str(value)
    return fields
