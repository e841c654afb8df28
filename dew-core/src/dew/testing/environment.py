"""EnvironmentKit: an environment opens independent episodes that answer every turn the same way again.

An environment (``dew.environments``, entry-point group ``dew.environments``)
opens an episode per sampled rollout with ``start(prompt, record)``; the
episode's ``opening()`` is text, and ``step(action)`` answers each model turn
with a Reply (``observation`` text, ``done``, a finite ``reward``). Rollouts run
many episodes at once and a journal replays them, so episodes must not share
state and must answer the same turns the same way. Subclass and supply the
environment and a few problems it can open::

    class TestMyEnvironment(EnvironmentKit):
        def environment(self):
            return MyEnvironment(...)

        def problems(self):
            return [("3+4=", {"answer": "7"}), ("12+30=", {"answer": "42"})]

        def actions(self, prompt, record):   # optional: the turns to play
            return ["calc(3+4)", "7"]

The default actions are a few odd turns (empty, long, non-ASCII) the
environment must answer without raising.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["EnvironmentKit"]


class EnvironmentKit:
    """Conformance tests for an environment (see the module docstring)."""

    def environment(self) -> Any:
        """The environment under test, freshly built."""
        raise NotImplementedError(f"{type(self).__name__} must define environment().")

    def problems(self) -> Sequence[tuple[str, Mapping[str, Any]]]:
        """(prompt, record) pairs the environment opens episodes for."""
        raise NotImplementedError(f"{type(self).__name__} must define problems().")

    def actions(self, prompt: str, record: Mapping[str, Any]) -> Sequence[str]:
        """The model's turns to play in an episode of prompt (until the episode is done)."""
        return ["", "x" * 200, "ÜNÏCÖDÉ\n", "42"]

    def _play(self, environment: Any, prompt: str, record: Mapping[str, Any]) -> list[tuple[str, bool, float]]:
        episode = environment.start(prompt, record)
        opening = episode.opening()
        assert isinstance(opening, str), f"opening() returned a {type(opening).__name__}, not text."
        replies: list[tuple[str, bool, float]] = [(opening, False, 0.0)]
        for turn, action in enumerate(self.actions(prompt, record)):
            if turn >= environment.max_turns:
                break
            reply = episode.step(action)
            observation, done, reward = reply.observation, reply.done, reply.reward
            assert isinstance(observation, str) and isinstance(done, bool), (
                f"step() returned observation {observation!r} and done {done!r}: text and a bool.")
            assert isinstance(reward, int | float) and math.isfinite(reward), (
                f"step() returned the reward {reward!r}; it must be a finite number.")
            replies.append((observation, done, float(reward)))
            if done:
                break
        return replies

    def test_it_declares_its_turns_and_stop_strings(self) -> None:
        environment = self.environment()
        turns, stops = environment.max_turns, environment.stop_strings
        assert isinstance(turns, int) and not isinstance(turns, bool) and turns >= 1, (
            f"max_turns is {turns!r}; it must be a positive integer.")
        assert isinstance(stops, tuple) and all(isinstance(s, str) and s for s in stops), (
            f"stop_strings is {stops!r}; it must be a tuple of non-empty strings.")

    def test_episodes_answer_every_turn(self) -> None:
        environment = self.environment()
        problems = list(self.problems())
        assert problems, "problems() returned nothing to open."
        for prompt, record in problems:
            self._play(environment, prompt, record)

    def test_the_same_turns_get_the_same_replies(self) -> None:
        problems = list(self.problems())
        first = [self._play(self.environment(), p, r) for p, r in problems]
        again = [self._play(self.environment(), p, r) for p, r in problems]
        assert first == again, (
            "The same turns got other replies from a fresh environment: an environment must not "
            "depend on unseeded randomness or the clock, or rollouts cannot be replayed.")

    def test_episodes_share_no_state(self) -> None:
        environment = self.environment()
        problems = list(self.problems())
        alone = [self._play(environment, p, r) for p, r in problems]
        # every episode open at once, their turns interleaved, as a rollout plays them
        episodes = [environment.start(p, r) for p, r in problems]
        replies: list[list[tuple[str, bool, float]]] = [[(e.opening(), False, 0.0)] for e in episodes]
        plays = [list(self.actions(p, r))[: environment.max_turns] for p, r in problems]
        for turn in range(max(map(len, plays), default=0)):
            for i, episode in enumerate(episodes):
                if turn < len(plays[i]) and not replies[i][-1][1]:
                    reply = episode.step(plays[i][turn])
                    replies[i].append((reply.observation, reply.done, float(reply.reward)))
        assert replies == alone, (
            "Episodes played together answered otherwise than each alone: episodes of one environment "
            "must keep their state apart.")
