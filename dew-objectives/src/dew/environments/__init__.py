"""Environments for multi-turn episodes: the model acts, the environment answers, a reward ends it.

An ``Environment`` opens one ``Episode`` per sampled rollout (``start(prompt,
record)``, where record holds the batch's other values for that prompt, such
as its answer). The episode's ``opening()`` is written after the prompt; then
the model writes a turn (up to the rollout's stop token, one of the
environment's ``stop_strings``, or the turn's token budget), and
``step(turn_text)`` answers with a ``Reply``: an observation written after the
turn (a tool's output, a game state) for the model to continue, or ``done``
with the episode's reward. At most ``max_turns`` model turns; an episode still
open after them, or one that outgrows the model's length, ends with reward 0.

Environments register under the entry-point group ``dew.environments`` (dew's
own: ``calculator``), so a recipe names one as ``objective.environment``;
``resolve_environment`` turns a name, ``{"name": ..., **fields}`` or an instance into one.
An environment that raises, or does not answer within the rollout's
``turn_timeout``, ends that episode with reward 0 and an
``EnvironmentFailedWarning`` (``EnvironmentTimeoutWarning`` for a timeout);
the other episodes and the run go on.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from dew.errors import DewError

__all__ = [
    "Environment",
    "EnvironmentFailedWarning",
    "EnvironmentTimeoutWarning",
    "EnvironmentWarning",
    "Episode",
    "NotAnEnvironmentError",
    "Reply",
    "resolve_environment",
]


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a turn: text for the model to continue from, or the episode's end.

    observation is written after the model's turn (ignored when done); reward
    is the episode's reward when done.
    """

    observation: str = ""
    done: bool = False
    reward: float = 0.0


@runtime_checkable
class Episode(Protocol):
    """One episode's state on the host, between the model's turns."""

    def opening(self) -> str:
        """Text written after the prompt, before the model's first turn ("" for none)."""
        ...

    def step(self, action: str) -> Reply:
        """Answer the model's turn (its text, without the stop token)."""
        ...


@runtime_checkable
class Environment(Protocol):
    """Opens episodes (see the module docstring). max_turns bounds the model's turns; a turn also
    ends at one of stop_strings (kept in its text)."""

    max_turns: int
    stop_strings: tuple[str, ...]

    def start(self, prompt: str, record: Mapping[str, Any]) -> Episode:
        """A new episode for prompt (text), with the record's other values (one per key).

        A record without a key the environment reads is the data's fault, not the episode's:
        raise ``dew.errors.BatchKeyError`` and the rollout stops the run with its message
        (anything else an environment raises ends that one episode with reward 0).
        """
        ...


class NotAnEnvironmentError(DewError, TypeError):
    """What was given as an environment does not have max_turns, stop_strings and start."""


class EnvironmentWarning(UserWarning):
    """An episode ended early because its environment failed; the run goes on."""


class EnvironmentFailedWarning(EnvironmentWarning):
    """The environment raised while opening or answering an episode: it ended with reward 0."""


class EnvironmentTimeoutWarning(EnvironmentFailedWarning):
    """The environment did not answer a turn within the turn timeout: the episode ended with reward 0."""


def resolve_environment(spec: Any) -> Environment:
    """An environment from a registered name, ``{"name": ..., **fields}``, or an instance.

    >>> resolve_environment({"name": "calculator", "max_turns": 2}).max_turns
    2
    """
    if isinstance(spec, str | Mapping):
        from dew import registry

        fields = {"name": spec} if isinstance(spec, str) else dict(spec)
        name = fields.pop("name", None)
        if not isinstance(name, str):
            raise NotAnEnvironmentError(
                f"An environment is named by a string or {{'name': ..., **fields}}; got {spec!r}.")
        spec = registry.environments.build(name, **fields)
    if not isinstance(spec, Environment):
        raise NotAnEnvironmentError(
            f"{type(spec).__name__} is not an environment: it needs max_turns, stop_strings and "
            "start(prompt, record) -> Episode (see dew.environments.Environment).")
    turns = spec.max_turns
    if isinstance(turns, bool) or not isinstance(turns, numbers.Integral) or turns < 1:
        raise NotAnEnvironmentError(
            f"{type(spec).__name__}.max_turns is {turns!r}; an episode allows the model at least one turn, "
            "so give a whole number >= 1.")
    return spec
