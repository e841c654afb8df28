"""Rollouts of multi-turn episodes: the model acts, an environment answers, a reward ends each one.

``EpisodeRollout`` plays ``group_size`` episodes per prompt of the batch with
the live policy, all at once through one generation engine: each episode's
turns are sampled with ``keep_cache`` so that, when the environment answers,
the engine continues the same sequence after the answer's tokens
(``Engine.extend``) without writing the earlier turns again, while the other
episodes keep decoding. Each episode is laid out as one row::

    tokens  [P*G, L]   prompt, opening, turn 1, answer 1, turn 2, ... (0 after the end)
    mask    [P*G, L]   1 on the tokens the model wrote (its turns, stop tokens included), else 0
    reward  [P*G]      the environment's reward when the episode ended (0 if it never did)
    old_logp [P*G, L-1] every token's log-probability under the sampling policy

with L the model's max_seq_len (or ``max_length``), so the step compiles once.
``turns`` [P*G] counts each episode's model turns and ``failed_episodes``
[P*G] marks the episodes whose environment raised or hung.
``transcript()`` hands the rollout journal each episode's prompt, its last
turn (``completions``: the answer an environment's reward judges), its whole
text after the prompt (``episodes``: the opening, the model's turns and the
environment's answers, as the row holds them) and its reward. ``dew report``
shows whole episodes, and ``dew rescore`` scores the last turns, so a reward
the environment's own agrees with (the calculator's exact match) scores
the journal as the run did.

The environment runs on the host between engine steps. The calls into it
that one engine step asks for (every episode's ``start``, ``opening`` or
``step``) run together, each in a daemon thread, and all of them get
``turn_timeout`` seconds from when they began: threads share Python's
interpreter, so environments whose calls compute in Python take turns, and
``turn_timeout`` must cover a whole batch of them. One that raises, runs over,
or answers with something other than text (an opening, an observation) or a
finite reward ends its episode with reward 0 and an
``EnvironmentFailedWarning`` (``EnvironmentTimeoutWarning``), and the others go
on. A hung call's thread is left behind (Python cannot stop it); it holds no
lock of the rollout's.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.data.base import Batch as HostBatch
from dew.data.base import Tokenizer
from dew.data.tokenizers import drawable_vocab
from dew.environments import (
    Environment,
    EnvironmentFailedWarning,
    EnvironmentTimeoutWarning,
    Episode,
    Reply,
    resolve_environment,
)
from dew.errors import BatchKeyError, DewError
from dew.objectives.base import Variables
from dew.objectives.rollouts import PolicyRollout, completion_text, prompt_text
from dew.sampling import Engine, EngineConfig, Request, Sampling

if TYPE_CHECKING:
    from dew.training.state import TrainState

_T = TypeVar("_T")

__all__ = ["EnvironmentReplyError", "EpisodeRollout", "check_turn_timeout", "guarded_calls"]


class _Failed:
    """What a guarded call left instead of a value: the error it raised, or None for a timeout."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


def guarded_calls(calls: Sequence[Callable[[], _T]], timeout: float | None) -> list[_T | _Failed]:
    """Each call's value, or a ``_Failed`` for one that raised or outlasted timeout seconds.

    The calls run together, each in a daemon thread (timeout None: one after
    another in this thread, with no limit); every call gets timeout seconds
    from the start of the batch.
    """
    if timeout is None:
        out: list[_T | _Failed] = []
        for call in calls:
            try:
                out.append(call())
            except Exception as error:  # noqa: BLE001 - the environment's failure ends its episode
                out.append(_Failed(error))
        return out
    results: list[_T | _Failed] = [_Failed(None)] * len(calls)

    def run(index: int, call: Callable[[], _T]) -> None:
        try:
            results[index] = call()
        except Exception as error:  # noqa: BLE001
            results[index] = _Failed(error)

    threads = [threading.Thread(target=run, args=(i, c), daemon=True, name=f"dew-environment-{i}")
               for i, c in enumerate(calls)]
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return [r if t.is_alive() is False else _Failed(None) for r, t in zip(results, threads, strict=True)]


@dataclass(eq=False)
class _Play:
    """One episode on the host: its row so far, its state, and how it ended."""

    index: int
    prompt: str
    tokens: list[int]
    mask: list[float]
    episode: Episode | None = None
    turns: int = 0
    reward: float = 0.0
    failed: bool = False
    done: bool = False
    transcript: list[str] = field(default_factory=list)

    def opening(self) -> str:
        """The episode's opening (called in a guarded thread: whatever it raises is the environment's)."""
        assert self.episode is not None, "the episode was never opened"
        text = self.episode.opening()
        if not isinstance(text, str):
            raise EnvironmentReplyError(f"opening() returned {type(text).__name__} {text!r}, not text")
        return text

    def step(self, action: str) -> object:
        """The episode's reply to action (called in a guarded thread, as opening): a Reply, unless the
        environment breaks its protocol (a reply that is no Reply the caller warns of; one holding
        no text to continue from, or no finite reward, is refused here, as the environment's error)."""
        assert self.episode is not None, "the episode was never opened"
        reply = self.episode.step(action)
        if not isinstance(reply, Reply):
            return reply
        if reply.done:
            reward = reply.reward
            if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
                raise EnvironmentReplyError(f"its Reply ends the episode with reward {reward!r}, not a finite number")
        elif not isinstance(reply.observation, str):
            raise EnvironmentReplyError(f"its Reply's observation is {type(reply.observation).__name__} "
                                        f"{reply.observation!r}, not text")
        return reply


def check_turn_timeout(timeout: float | None, field: str) -> None:
    """Refuse a turn_timeout (named field) that gives the environment no time: 0, below, or NaN."""
    if timeout is not None and not timeout > 0:  # NaN too
        raise ValueError(f"{field}={timeout!r}; give the seconds a batch of calls into the environment may "
                         "take (> 0), or None for no limit.")


class EnvironmentReplyError(DewError, TypeError):
    """An environment answered with something the episode cannot use: an opening or observation that
    is no text, or an ending reward that is no finite number (its episode ends with reward 0)."""


class EpisodeRollout(PolicyRollout):
    """Play group_size episodes of the environment per prompt and lay them out (module docstring).

    max_new_tokens bounds each turn; stop_token (and the environment's
    stop_strings) end one. tokenizer encodes and decodes text (bytes when None).
    """

    def __init__(self, model: nn.Module, environment: Environment, *, group_size: int, max_new_tokens: int,
                 sampling: Sampling, tokenizer: Tokenizer | None = None, stop_token: int | None = None,
                 prompt_key: str = "prompt", prompt_length_key: str = "prompt_length",
                 max_length: int | None = None, turn_timeout: float | None = 10.0,
                 engine: EngineConfig | None = None) -> None:
        super().__init__(model, group_size=group_size, max_new_tokens=max_new_tokens, sampling=sampling,
                         tokenizer=tokenizer, stop_token=stop_token, prompt_key=prompt_key,
                         prompt_length_key=prompt_length_key, engine=engine)
        self.environment: Environment = resolve_environment(environment)
        self.max_length = int(max_length or model.max_seq_len)
        check_turn_timeout(turn_timeout, "turn_timeout")
        self.turn_timeout = turn_timeout

    # -- text --------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode())
        return [int(i) for i in self.tokenizer.encode(text)]

    def _decode(self, ids: Sequence[int]) -> str:
        return completion_text(self.tokenizer, list(ids))[0]

    # -- the environment, guarded -----------------------------------------------------
    def _call(self, plays: list[_Play], calls: Sequence[Callable[[], _T]], what: str) -> list[_T | _Failed]:
        began = time.perf_counter()
        results = guarded_calls(calls, self.turn_timeout)
        self.reward_seconds += time.perf_counter() - began
        name = type(self.environment).__name__
        for result in results:  # the records lack what the environment reads: every episode would fail
            if isinstance(result, _Failed) and isinstance(result.error, BatchKeyError):
                raise result.error
        for play, result in zip(plays, results, strict=True):
            if not isinstance(result, _Failed):
                continue
            play.failed, play.done, play.reward = True, True, 0.0
            if result.error is None:
                warnings.warn(EnvironmentTimeoutWarning(
                    f"The environment {name} did not answer {what} of episode {play.index} (prompt "
                    f"{play.prompt!r}) within turn_timeout={self.turn_timeout:g} s; that episode ends "
                    "with reward 0 and the run goes on. Raise turn_timeout if the environment is slow."),
                    stacklevel=3)
            else:
                warnings.warn(EnvironmentFailedWarning(
                    f"The environment {name} raised {type(result.error).__name__}: {result.error} in "
                    f"{what} of episode {play.index} (prompt {play.prompt!r}); that episode ends with "
                    "reward 0 and the run goes on."), stacklevel=3)
        return results

    # -- one rollout -------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: HostBatch, key: jax.Array) -> dict[str, np.ndarray | jax.Array]:
        prompts, lengths = self.read_prompts(batch)
        others = {k: np.asarray(v) for k, v in batch.items()
                  if k not in (self.prompt_key, self.prompt_length_key)}
        g, width = self.group_size, self.max_length
        params = {"params": state.params["params"]}
        engine = self._engine(len(prompts) * g)
        for left in engine.kept:  # a call stopped midway (an interrupt) left these behind
            engine.release(left)
        engine.set_params(params)

        plays: list[_Play] = []
        records: list[dict[str, Any]] = []
        for i, (row, length) in enumerate(zip(prompts, lengths, strict=True)):
            ids = [int(t) for t in row[: int(length)]]
            text = prompt_text(self.tokenizer, ids)  # as the policy saw it, a chat template's markers spelt out
            record = {k: v[i] for k, v in others.items()}
            for _ in range(g):
                plays.append(_Play(len(plays), text, list(ids), [0.0] * len(ids)))
                records.append(record)
        environment = self.environment
        episodes = self._call(plays, [functools.partial(environment.start, p.prompt, r)
                                      for p, r in zip(plays, records, strict=True)], "the start")
        for play, episode in zip(plays, episodes, strict=True):
            if not isinstance(episode, _Failed):  # a failed start marked its play failed
                play.episode = episode
        alive = [p for p in plays if not p.done]
        openings = self._call(alive, [p.opening for p in alive], "the opening")
        by_request: dict[int, _Play] = {}  # an episode is one request: its turns keep the request's id
        for play, opening in zip(alive, openings, strict=True):
            if play.done or isinstance(opening, _Failed):  # a failed opening marked its play done
                continue
            self._append(play, self._encode(opening), 0.0)
            room = min(self.max_new_tokens, width - len(play.tokens))
            if room <= 0:
                play.done = True
                continue
            request = Request(tuple(play.tokens), room, sampling=self.sampling, stop_tokens=self.stop_tokens,
                              stop_strings=tuple(environment.stop_strings), keep_cache=True)
            by_request[engine.submit(request, jax.random.fold_in(key, play.index))] = play
        self._play(engine, by_request)
        out = self._layout(plays, params, width)
        self._rounds.append({  # the journal's transcript: each episode's last turn, and its whole text
            "prompts": [p.prompt for p in plays],
            "completions": [p.transcript[-1] if p.transcript else "" for p in plays],
            "episodes": [self._decode(p.tokens[int(lengths[p.index // g]):]) for p in plays],
            "rewards": [p.reward for p in plays],
            "context": {k: np.repeat(v, g, axis=0) for k, v in others.items()}})
        return out

    def _play(self, engine: Engine, by_request: dict[int, _Play]) -> None:
        """Step the engine until every episode ended, answering each finished turn."""
        limit = self.environment.max_turns
        while not engine.idle:
            finished = engine.step()
            if not finished:
                continue
            turn_of = [by_request[done.request] for done in finished]
            actions = []
            for play, done in zip(turn_of, finished, strict=True):
                self._append(play, list(done.tokens), 1.0)
                play.turns += 1
                actions.append(completion_text(self.tokenizer, list(done.tokens), self.stop_tokens)[0])
                play.transcript.append(actions[-1])
            replies = self._call(turn_of, [functools.partial(p.step, a)
                                           for p, a in zip(turn_of, actions, strict=True)], "a turn")
            for play, done, reply in zip(turn_of, finished, replies, strict=True):
                if play.failed or not isinstance(reply, Reply):
                    if not play.failed:
                        play.failed, play.done = True, True
                        warnings.warn(EnvironmentFailedWarning(
                            f"The environment {type(self.environment).__name__} answered a turn of "
                            f"episode {play.index} with a {type(reply).__name__}, not a "
                            "dew.environments.Reply; that episode ends with reward 0."), stacklevel=2)
                    engine.release(done.id)
                    continue
                if reply.done:
                    play.done, play.reward = True, float(reply.reward)
                    engine.release(done.id)
                    continue
                answer = self._encode(reply.observation)
                room = min(self.max_new_tokens, self.max_length - len(play.tokens) - len(answer))
                if play.turns >= limit or room <= 0:  # out of turns or of room: no reward
                    play.done = True
                    engine.release(done.id)
                    continue
                self._append(play, answer, 0.0)
                engine.extend(done.id, answer, room, keep_cache=True)

    @staticmethod
    def _append(play: _Play, tokens: list[int], written_by_model: float) -> None:
        play.tokens += tokens
        play.mask += [written_by_model] * len(tokens)

    def _engine(self, rows: int) -> Engine:
        if self.engine is None:
            steps = EngineConfig.steps_per_call
            config = self.engine_config or EngineConfig(
                max_batch=rows, max_len=self.max_length, block_size=min(8, self.max_length),
                prefill_rows=min(rows, 16), batch_buckets=min(4, -(-self.max_new_tokens // steps)) or 1)
            self.engine = Engine(self.model, config, detokenize=self._decode,
                                 vocab=drawable_vocab(self.tokenizer))
        return self.engine

    def _layout(self, plays: list[_Play], params: Variables, width: int) -> dict[str, np.ndarray | jax.Array]:
        rows = len(plays)
        tokens = np.zeros((rows, width), np.int32)
        mask = np.zeros((rows, width), np.float32)
        for r, play in enumerate(plays):
            n = min(len(play.tokens), width)
            tokens[r, :n] = play.tokens[:n]
            mask[r, :n] = play.mask[:n]
        self.last_completions = ["".join(p.transcript) for p in plays]
        old_logp = self._score(params, jnp.asarray(tokens))
        return {"tokens": tokens, "mask": mask,
                "reward": np.asarray([p.reward for p in plays], np.float32), "old_logp": old_logp,
                "turns": np.asarray([p.turns for p in plays], np.float32),
                "failed_episodes": np.asarray([p.failed for p in plays], np.float32)}
