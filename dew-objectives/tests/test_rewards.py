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
    RewardContextError,
    RewardShapeError,
    Weighted,
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
    with pytest.raises(KeyError, match="batch key 'answer'.*carry \\['target'\\]") as refused:
        reward(["1"], {"target": ["1"]})
    # dew's own error, so a run whose reward.key names no record key says so in one line (it was a
    # plain KeyError: a traceback at the first rollout); its message names the recipe's field.
    from dew.cli import is_dews
    from dew.rewards import RewardContextError

    assert isinstance(refused.value, RewardContextError) and is_dews(refused.value)
    assert "objective.reward.key" in str(refused.value)


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


class _PluginReward:
    """A third party's reward: an object with no repr a person would know from the recipe."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def __call__(self, completions, context):
        if self.fail:
            return context["answer_text"]  # a key the rollout never kept: the plugin's own bug
        return [float("nan")] * len(completions)


def test_a_reward_built_by_name_is_called_by_it_and_its_own_failure_is_named():
    """Errors called a plugin's reward <module.Class object at 0x...>, and a KeyError inside its code
    stopped a run with a traceback that blamed dew."""
    from dew.rewards import RewardFailedError

    with registry.rewards.temporary("shout", _PluginReward):
        with pytest.raises(NonFiniteRewardError, match=r"^The reward 'shout' returned nan for record 0"):
            score(resolve("shout"), ["a"], {})
        with pytest.raises(RewardFailedError, match=r"^The reward 'shout' raised KeyError: 'answer_text' while "
                                                    r"scoring 2 completions\. Fix the reward"):
            score(resolve({"name": "shout", "fail": True}), ["a", "b"], {"answer": ["1", "2"]})


def test_weighted_sums_named_rewards_and_names_a_failing_term():
    assert registry.rewards.load("weighted") is Weighted and registry.rewards.load("format") is RegexFormat
    reward = resolve({"name": "weighted", "rewards": [
        {"name": "exact_match", "key": "answer", "weight": 2.0},
        {"name": "format", "pattern": r"\d+", "match": 0.5, "miss": -1.0},
    ]})
    got = score(reward, ["12", "1x", "7"], {"answer": ["12", "12", "12"]})
    np.testing.assert_allclose(got, [2.0 + 0.5, 0.0 - 1.0, 0.0 + 0.5])

    def broken(completions, context):
        return [0.0] * (len(completions) - 1) + [float("nan")]

    with registry.rewards.temporary("broken", lambda: broken):
        mixed = resolve({"name": "weighted", "rewards": [{"name": "length", "target": 1}, {"name": "broken"}]})
        with pytest.raises(NonFiniteRewardError, match=r"reward 'broken' \(term 1 of weighted\) returned nan for "
                                                       r"record 2 \(completion 'c'\)"):
            score(mixed, ["a", "b", "c"], {})
    with pytest.raises(registry.UnknownNameError, match="exact_mach"):
        resolve({"name": "weighted", "rewards": [{"name": "exact_mach"}]})
    with pytest.raises(ValueError, match=r"Weighted\.rewards\[0\] must be a mapping with a 'name'"):
        Weighted([{"weight": 1.0}])
    # A term's own error (a key the records lack) names the term by its place in the sum, where it
    # named only the class; a weight that is no number named nothing ("could not convert string").
    keyed = resolve({"name": "weighted", "rewards": [{"name": "length", "target": 1},
                                                     {"name": "exact_match", "key": "gold"}]})
    with pytest.raises(RewardContextError, match=r"batch key 'gold'") as refused:
        score(keyed, ["1"], {"answer": ["1"]})
    assert refused.value.__notes__ == ["Raised by the reward 'exact_match' (term 1 of weighted)."]
    with pytest.raises(ValueError, match=r"^Weighted\.rewards\[0\]\.weight \(the 'length' term\) must be a number, "
                                         r"got 'x'\.$"):
        Weighted([{"name": "length", "target": 1, "weight": "x"}])


def test_a_reward_of_the_wrong_shape_is_refused_naming_it():
    def two_columns(completions, context):
        return np.zeros((len(completions), 2))

    with pytest.raises(RewardShapeError, match=r"The reward .*two_columns returned 4 values for 2 completions "
                                               r"\(an array of shape \(2, 2\)"):
        score(two_columns, ["a", "b"], {})
    # A mapping was reported as the reward having raised a TypeError; numbers written as text were
    # parsed and trained on without a word (the kit passed both).
    with pytest.raises(RewardShapeError, match=r"returned a dict for 2 completions; return one number per"):
        score(lambda completions, context: {"scores": [1.0, 2.0]}, ["a", "b"], {})
    with pytest.raises(RewardShapeError, match=r"returned values of dtype <U4 \(the first: np.str_\('0.25'\)\), "
                                               r"which are no numbers"):
        score(lambda completions, context: ["0.25", "0.0"], ["a", "b"], {})
    with pytest.raises(RewardShapeError, match=r"returned values numpy cannot lay out"):
        score(lambda completions, context: [[1.0], [1.0, 2.0]], ["a", "b"], {})
    assert score(lambda completions, context: [True, 0], ["a", "b"], {}).tolist() == [1.0, 0.0]
    with pytest.raises(NonFiniteRewardError, match=r"The reward _NanExact\(key='answer'.*returned nan for record 0"):
        score(_NanExact(), ["a"], {"answer": ["a"]})


class _NanExact(ExactMatch):
    def __call__(self, completions, context):
        return np.full(len(completions), np.nan, np.float32)
