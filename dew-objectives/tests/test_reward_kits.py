"""dew's own rewards pass the reward kit, as their registered kits give it (dew.rewards.conformance):
the classes ``dew check-plugin dew-objectives`` runs are collected here too."""

from dew.rewards.conformance import (
    TestBrightness,
    TestExactMatch,
    TestLength,
    TestRegexFormat,
    TestWeighted,
)

__all__ = ["TestBrightness", "TestExactMatch", "TestLength", "TestRegexFormat", "TestWeighted"]
