"""A third party's reward: the share of a completion's letters that are upper case."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ShoutReward"]


class ShoutReward:
    """scale times the fraction of upper-case letters in each completion (0 without letters)."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> list[float]:
        out = []
        for text in completions:
            letters = [c for c in text if c.isalpha()]
            out.append(self.scale * sum(c.isupper() for c in letters) / len(letters) if letters else 0.0)
        return out
