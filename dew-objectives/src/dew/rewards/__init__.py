"""Rewards for preference and reinforcement learning, found by name in ``dew.rewards``.

A reward scores a batch of completions (text) against what the records
carry beside their prompts (an answer, a target length): it is called as
``reward(completions, context)`` where ``context`` maps each batch key the
rollout kept to one value per completion, and returns one number per
completion. dew's own rewards register under the entry-point group
``dew.rewards`` exactly as a third party's do, so a recipe names any of
them the same way; ``score`` runs one and refuses a value that is not a
finite number, naming the reward and the record. Besides the batch's keys,
the GRPO and PPO rollouts put each completion's prompt, as text, in the
context under ``prompt_text``.

``weighted`` sums other rewards with weights; ``format`` (also registered as
``regex_format``) checks completions against a regular expression; ``model``
(``dew.rewards.model``) scores them with a trained reward-model run.

>>> from dew.rewards import ExactMatch, score
>>> score(ExactMatch(), ["12\\nrest", "13"], {"answer": ["12", "12"]}).tolist()
[1.0, 0.0]
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dew.errors import DewError, DewKeyError

__all__ = [
    "Brightness",
    "ExactMatch",
    "Length",
    "NamedReward",
    "NonFiniteRewardError",
    "RegexFormat",
    "Reward",
    "RewardContextError",
    "RewardFailedError",
    "RewardShapeError",
    "Weighted",
    "describe",
    "resolve",
    "score",
]


class NonFiniteRewardError(DewError, ValueError):
    """A reward returned NaN or an infinity for a completion."""


class RewardShapeError(DewError, ValueError):
    """A reward returned something other than one number per completion: another count, another
    shape, or values that are no numbers (a mapping, text)."""


class RewardFailedError(DewError, RuntimeError):
    """A reward's own code raised an error dew does not name (a plugin's bug, say) while scoring."""


class RewardContextError(DewKeyError):
    """A reward reads a key of the records (or the prompts' text) that the rollout's context lacks."""


@runtime_checkable
class Reward(Protocol):
    """Score completions: one number per completion, higher is better."""

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> Sequence[float]: ...


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":  # token ids of one byte each
        return bytes(int(v) % 256 for v in value.reshape(-1) if v >= 0).decode("utf-8", errors="replace")
    return str(value)


def _cut(completion: str, stop: str | None) -> str:
    return completion.split(stop, 1)[0] if stop else completion


@dataclass(frozen=True)
class ExactMatch:
    """1 where the completion, up to ``stop`` and stripped, equals the record's ``key`` value; else 0."""

    key: str = "answer"
    stop: str | None = "\n"
    strip: bool = True

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> np.ndarray:
        if self.key not in context:
            raise RewardContextError(
                f"ExactMatch compares completions with the batch key {self.key!r}, but the "
                f"records carry {sorted(context)}; set ExactMatch(key=...) (a recipe's objective.reward.key) "
                "to the key holding the answers."
            )
        out = []
        for completion, answer in zip(completions, context[self.key], strict=True):
            got, want = _cut(completion, self.stop), _text(answer)
            if self.strip:
                got, want = got.strip(), want.strip()
            out.append(float(got == want))
        return np.asarray(out, np.float32)


@dataclass(frozen=True)
class RegexFormat:
    """``match`` where the completion (up to ``stop``) matches ``pattern`` (wholly, or anywhere with
    full=False), else ``miss``; registered as ``format`` and ``regex_format``."""

    pattern: str
    full: bool = True
    stop: str | None = None
    match: float = 1.0
    miss: float = 0.0

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as error:
            raise ValueError(f"RegexFormat.pattern {self.pattern!r} is not a regular expression: {error}.") from None

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> np.ndarray:
        compiled = re.compile(self.pattern)
        found = compiled.fullmatch if self.full else compiled.search
        return np.asarray([self.match if found(_cut(c, self.stop)) is not None else self.miss
                           for c in completions], np.float32)


@dataclass(frozen=True)
class Length:
    """Minus scale times the distance, in characters, of the completion (up to ``stop``) from target."""

    target: int
    scale: float = 1.0
    stop: str | None = None

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> np.ndarray:
        return np.asarray([0.0 - self.scale * abs(len(_cut(c, self.stop)) - self.target) for c in completions],
                          np.float32)


@dataclass(frozen=True)
class Brightness:
    """The mean value of each completion's pixels (an image as an array), times scale."""

    scale: float = 1.0

    def __call__(self, completions: Sequence[Any], context: Mapping[str, Sequence[Any]]) -> np.ndarray:
        return np.asarray([self.scale * float(np.mean(np.asarray(c, np.float32))) for c in completions],
                          np.float32)


@dataclass(frozen=True)
class Weighted:
    """The weighted sum of other rewards: ``rewards`` lists each as ``{"name": ..., "weight": w, **fields}``.

    A term without a weight counts once. Each term is scored (and checked)
    on its own, so a failing term is named in the error.

    >>> Weighted([{"name": "length", "target": 2}, {"name": "format", "pattern": "a+", "weight": 0.5}])(
    ...     ["aa", "abc"], {}).tolist()
    [0.5, -1.0]
    """

    rewards: Sequence[Mapping[str, Any]]
    terms: tuple[tuple[float, Reward], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError("Weighted.rewards lists no reward; give at least one {name: ..., weight: ...}.")
        terms = []
        for i, term in enumerate(self.rewards):
            if not isinstance(term, Mapping) or not isinstance(term.get("name"), str):
                raise ValueError(f"Weighted.rewards[{i}] must be a mapping with a 'name' (a registered reward) "
                                 f"and optionally a 'weight', got {term!r}.")
            fields = dict(term)
            weight = fields.pop("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
                raise ValueError(f"Weighted.rewards[{i}].weight (the {term['name']!r} term) must be a number, "
                                 f"got {weight!r}.")
            terms.append((float(weight), resolve(fields)))
        object.__setattr__(self, "terms", tuple(terms))

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> np.ndarray:
        total = np.zeros(len(completions), np.float32)
        for i, (weight, reward) in enumerate(self.terms):
            name = f"{describe(reward)} (term {i} of weighted)"
            total += weight * score(reward, completions, context, name=name)
        return total


@dataclass(frozen=True)
class NamedReward:
    """A reward built from its registered name, which errors call it by (a plugin's reward object
    has no repr a person would recognise from the recipe)."""

    name: str
    reward: Reward

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> Sequence[float]:
        return self.reward(completions, context)

    def __getattr__(self, attribute: str) -> Any:  # the reward's own settings (a model reward's scoring)
        if attribute.startswith("__") or attribute in ("name", "reward"):  # not set yet (unpickling)
            raise AttributeError(attribute)
        return getattr(self.reward, attribute)


def describe(reward: Any) -> str:
    """How errors name a reward: by its registered name when built from one, a function by its
    qualified name, anything else by its repr."""
    if isinstance(reward, NamedReward):
        return repr(reward.name)
    name = getattr(reward, "__qualname__", None)  # any callable: a function has one
    return name if isinstance(name, str) else repr(reward)


def resolve(reward: str | Mapping[str, Any] | Reward) -> Reward:
    """A reward object from a registered name, ``{"name": ..., **fields}``, or the object itself.

    >>> resolve({"name": "length", "target": 3})(["abc", "abcdef"], {}).tolist()
    [0.0, -3.0]
    """
    from dew import registry

    if isinstance(reward, str):
        return NamedReward(reward, registry.rewards.build(reward))
    if isinstance(reward, Mapping):
        fields = dict(reward)
        name = fields.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"A reward given as a mapping needs a 'name' (a registered reward), got {reward!r}.")
        return NamedReward(name, registry.rewards.build(name, **fields))
    if callable(reward):
        return reward
    raise TypeError(f"A reward is a registered name, a mapping with a name, or a callable; got {reward!r}.")


def _numbers(returned: object, name: str, count: int) -> np.ndarray:
    """What a reward returned as float32, refused (RewardShapeError) when it holds no numbers: a mapping,
    text (even text of a number), or rows of unequal length."""
    advice = "return one number per completion, as a sequence of shape (completions,)"
    if isinstance(returned, Mapping | str | bytes):
        raise RewardShapeError(f"The reward {name} returned a {type(returned).__name__} for {count} completions; "
                               f"{advice}.")
    try:
        values = np.asarray(returned)
    except ValueError as error:  # rows of unequal length
        raise RewardShapeError(f"The reward {name} returned values numpy cannot lay out ({error}); {advice}.") from None
    if values.dtype.kind not in "biuf":  # bool, int, unsigned, float
        first = values.reshape(-1)[0] if values.size else None
        raise RewardShapeError(f"The reward {name} returned values of dtype {values.dtype} (the first: {first!r}), "
                               f"which are no numbers; {advice}.")
    return values.astype(np.float32)


def score(reward: Reward, completions: Sequence[str], context: Mapping[str, Sequence[Any]], *,
          name: str | None = None) -> np.ndarray:
    """The reward's values as float32 [len(completions)], refused when any is not finite.

    name is how errors call the reward (``describe(reward)`` by default).
    """
    name = name or describe(reward)
    try:
        returned = reward(completions, context)
    except DewError as error:
        if not any(note.startswith("Raised by the reward ") for note in getattr(error, "__notes__", ())):
            error.add_note(f"Raised by the reward {name}.")  # the innermost: a weighted sum's failing term
        raise
    except Exception as error:  # noqa: BLE001 - the reward's own code: name it rather than print its traceback
        raise RewardFailedError(
            f"The reward {name} raised {type(error).__name__}: {error} while scoring {len(completions)} "
            "completions. Fix the reward (or the distribution that ships it), or choose another.") from error
    values = _numbers(returned, name, len(completions))
    if values.ndim != 1 or values.shape[0] != len(completions):
        raise RewardShapeError(
            f"The reward {name} returned {values.size} values for {len(completions)} completions "
            f"(an array of shape {values.shape}, for records 0 to {len(completions) - 1}); return one "
            "number per completion, as a sequence of shape (completions,)."
        )
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        i = int(bad[0])
        raise NonFiniteRewardError(
            f"The reward {name} returned {values[i]} for record {i} (completion "
            f"{completions[i]!r}); {bad.size} of {len(completions)} values are not finite. A reward "
            "must return a finite number for every completion (score a failure as 0 or a penalty)."
        )
    return values
