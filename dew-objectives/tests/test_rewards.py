"""Rewards are found by name in the dew.rewards entry-point group and score as documented."""

from __future__ import annotations

import numpy as np
import pytest

from dew import registry
from dew.rewards import (
    Brightness,
    ExactMatch,
    Length,
    NonFiniteRewardError,
    RegexFormat,
    RewardShapeError,
    resolve,
    score,
)


def test_built_in_rewards_are_registered_by_dew_objectives():
    names = registry.rewards.names()
    for name, cls in (("exact_match", ExactMatch), ("regex_format", RegexFormat), ("length", Length),
                      ("brightness", Brightness)):
        assert names[name] == "dew-objectives"
        assert registry.rewards.load(name) is cls
    assert registry.registry("rewards") is registry.rewards


def test_exact_match_compares_up_to_the_stop_with_answers_as_text_or_byte_ids():
    reward = registry.rewards.build("exact_match", key="answer")
    answers = [b"12", "7", np.asarray([49, 48, -1])]  # bytes, text, byte ids padded with -1
    got = reward(["12\n34", " 7 ", "10"], {"answer": answers})
    assert got.tolist() == [1.0, 1.0, 1.0]
    assert reward(["13", "7x", "1"], {"answer": answers}).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(KeyError, match="batch key 'answer'.*carry \\['target'\\]"):
        reward(["1"], {"target": ["1"]})


def test_regex_format_and_length():
    assert RegexFormat(r"\d+")(["12", "1a", ""], {}).tolist() == [1.0, 0.0, 0.0]
    assert RegexFormat(r"\d", full=False)(["a1", "ab"], {}).tolist() == [1.0, 0.0]
    assert resolve({"name": "length", "target": 2, "scale": 0.5})(["ab", "abcd", ""], {}).tolist() == [0.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="not a regular expression"):
        RegexFormat("(")


def test_unknown_reward_names_what_exists():
    with pytest.raises(registry.UnknownNameError) as error:
        resolve("exact_mach")
    text = str(error.value)
    assert "Did you mean 'exact_match'" in text and "length (dew-objectives)" in text


def test_score_refuses_non_finite_values_and_wrong_counts_naming_the_record():
    with pytest.raises(NonFiniteRewardError, match=r"returned inf for record 1 \(completion 'b'\)"):
        score(lambda c, x: [0.0, float("inf")], ["a", "b"], {})
    with pytest.raises(RewardShapeError, match="returned 1 values for 2 completions"):
        score(lambda c, x: [0.0], ["a", "b"], {})
