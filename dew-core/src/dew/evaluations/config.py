"""EvaluateConfig: one entry of a recipe's ``trainer.evaluate`` list.

>>> entry = EvaluateConfig(task="multiple_choice", every=100, file="arc.jsonl", label="arc")
>>> entry.name, entry.fields
('arc', {'file': 'arc.jsonl'})
"""

from __future__ import annotations

from typing import Any

import pydantic

from dew.settings import Settings

__all__ = ["EvaluateConfig"]


class EvaluateConfig(Settings):
    """A registered evaluation task (dew.evaluations), how often it runs, and its fields.

    Every key besides task, every and label is one of the task's fields.
    """

    model_config = pydantic.ConfigDict(extra="allow", frozen=True)

    task: str = pydantic.Field(description="a name registered in dew.evaluations")
    every: int | None = pydantic.Field(
        None, ge=1, description="steps between runs (the last step always runs it)")
    label: str | None = pydantic.Field(
        None, description="the name its scores are logged under (eval/<label>/...); default the task's")

    @property
    def name(self) -> str:
        """What the scores are logged under: the label, else the task's registered name."""
        return self.label or self.task

    @property
    def fields(self) -> dict[str, Any]:
        """The task's own fields, as the recipe gives them."""
        return dict(self.model_extra or {})
