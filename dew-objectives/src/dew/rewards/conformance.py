"""dew's own rewards, each with the conformance kit ``dew check-plugin dew-objectives`` runs.

Registered under the entry-point group ``dew.conformance`` (the distribution's
pyproject.toml), as a third party registers its kits: each supplies the fields
and the context its reward needs, which the default kit cannot guess.
``model`` has none: it scores with a trained reward-model run, which a kit
cannot make without training one. The test suite collects these classes too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew.rewards import Brightness, ExactMatch, Length, RegexFormat, Weighted
from dew.testing.reward import RewardKit

__all__ = ["TestBrightness", "TestExactMatch", "TestLength", "TestRegexFormat", "TestWeighted"]


class TestExactMatch(RewardKit):
    def reward(self) -> ExactMatch:
        return ExactMatch()

    def context(self, completions: Sequence[str]) -> Mapping[str, Sequence[Any]]:
        return {"answer": ["42"] * len(completions)}


class TestRegexFormat(RewardKit):
    """Registered twice, as ``format`` and ``regex_format``."""

    def reward(self) -> RegexFormat:
        return RegexFormat(r".*\d+.*", full=False)


class TestLength(RewardKit):
    def reward(self) -> Length:
        return Length(target=12, stop="\n")


class TestBrightness(RewardKit):
    """It scores images (arrays of pixels), the completions FlowGRPO's rollout samples."""

    def reward(self) -> Brightness:
        return Brightness(scale=2.0)

    def completions(self) -> list[Any]:
        rng = np.random.default_rng(0)
        return [np.zeros((8, 8, 1), np.float32), rng.uniform(-1, 1, (8, 8, 3)).astype(np.float32),
                np.ones((4, 4, 3), np.float32)]


class TestWeighted(RewardKit):
    def reward(self) -> Weighted:
        return Weighted([{"name": "length", "target": 12}, {"name": "exact_match", "weight": 0.5}])

    def context(self, completions: Sequence[str]) -> Mapping[str, Sequence[Any]]:
        return {"answer": ["42"] * len(completions)}
