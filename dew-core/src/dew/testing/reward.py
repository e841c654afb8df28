"""RewardKit: a reward gives one finite number per completion, the same for the same inputs.

A reward (``dew.rewards``, entry-point group ``dew.rewards``) is called as
``reward(completions, context)``, where context maps each batch key the
rollout kept to one value per completion. Subclass and supply the reward,
and completions and context it can score::

    class TestMyReward(RewardKit):
        def reward(self):
            return MyReward(...)

        def context(self, completions):
            return {"answer": ["42"] * len(completions)}

The defaults score a handful of completions (empty, short, long, non-ASCII,
with a newline) with an empty context.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["RewardKit"]


class RewardKit:
    """Conformance tests for a reward (see the module docstring)."""

    def reward(self) -> Any:
        """The reward under test, freshly built."""
        raise NotImplementedError(f"{type(self).__name__} must define reward().")

    def completions(self) -> list[str]:
        """Completions to score."""
        return ["", "42", "The answer is 42.\nDone", "ÜNÏCÖDÉ text", "SHOUT", "x" * 300]

    def context(self, completions: Sequence[str]) -> Mapping[str, Sequence[Any]]:
        """What the records carry beside their prompts, one value per completion per key."""
        return {}

    def _scores(self) -> list[float]:
        completions = self.completions()
        scores = self.reward()(list(completions), self.context(completions))
        assert not isinstance(scores, Mapping | str | bytes), (
            f"The reward returned a {type(scores).__name__}; it must return one number per completion.")
        values = np.asarray(scores)
        assert values.dtype.kind in "biuf", (  # bool, int, unsigned, float: text is no score, even "0.5"
            f"The reward returned values of dtype {values.dtype}; it must return numbers.")
        assert values.shape == (len(completions),), (
            f"The reward returned an array of shape {values.shape} for {len(completions)} completions; it must "
            "return one number per completion, of shape (completions,).")
        return values.astype(np.float64).tolist()

    def test_one_finite_value_per_completion(self) -> None:
        scores = self._scores()
        bad = [(i, s) for i, s in enumerate(scores) if not math.isfinite(s)]
        assert not bad, f"The reward gave non-finite values {bad[:5]} (completion index, value)."

    def test_the_same_inputs_score_the_same(self) -> None:
        first, second = np.asarray(self._scores()), np.asarray(self._scores())
        assert np.array_equal(first, second, equal_nan=True), (  # a NaN scored twice is the same score
            "The reward scored the same completions differently twice: a reward must not depend on hidden "
            "state or unseeded randomness, or rollouts cannot be replayed.")
