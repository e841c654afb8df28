"""Multi-turn episodes: the environments' registry and kit, the calculator, and EpisodeRollout's rows.

The rollout's rows are checked against a scripted environment whose answers are known: the
mask covers exactly the model's turns, the environment's text sits between them, the reward is
the environment's, and old_logp is the policy's own log-probability of every token (computed
here by token_logprobs directly). An environment that raises or hangs ends only its episodes.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import registry
from dew.data.addition import Addition
from dew.environments import (
    EnvironmentFailedWarning,
    EnvironmentTimeoutWarning,
    NotAnEnvironmentError,
    Reply,
    resolve_environment,
)
from dew.environments.calculator import Calculator, arithmetic
from dew.errors import BatchKeyError
from dew.nn.backbones import CausalTransformer
from dew.objectives.episodes import EpisodeRollout
from dew.objectives.grpo import GRPOObjective
from dew.objectives.policy import token_logprobs
from dew.sampling import Sampling
from dew.testing import EnvironmentKit

MODEL = CausalTransformer(vocab_size=257, emb_features=16, num_layers=1, num_heads=2, mlp_features=32,
                          max_seq_len=32, position_embedding="rotary")


class TestCalculatorKit(EnvironmentKit):
    def environment(self):
        return Calculator()

    def problems(self):
        return [("3+4=", {"answer": np.asarray([55, -1], np.int32)}), ("12+30=", {"answer": "42"}),
                ("0+0=", {"answer": "0"})]

    def actions(self, prompt, record):
        return ["3+4)", "7"] if prompt == "3+4=" else ["(1+2)*x)", "42"] if prompt == "12+30=" else ["", "0"]


def test_the_calculator_is_registered_and_resolved_by_name_fields_or_instance():
    assert registry.environments.names()["calculator"] == "dew-objectives"
    assert registry.registry("environments") is registry.environments
    assert resolve_environment("calculator") == Calculator()
    assert resolve_environment({"name": "calculator", "open_call": False}) == Calculator(open_call=False)
    mine = Calculator(max_turns=3)
    assert resolve_environment(mine) is mine
    with pytest.raises(NotAnEnvironmentError, match="start\\(prompt, record\\)"):
        resolve_environment(object())
    with pytest.raises(registry.UnknownNameError, match="calculator"):
        resolve_environment("calculater")


def test_a_calculator_episode_answers_a_call_with_its_value_and_the_question_then_scores_the_answer():
    assert arithmetic("12+30") == 42 and arithmetic("(2+3)*4-1") == 19
    with pytest.raises(ValueError, match="not an integer expression"):
        arithmetic("__import__('os')")
    episode = Calculator().start("7+8=", {"answer": "15"})
    assert episode.opening() == "calc("
    assert episode.step("7+8=") == Reply("15\n7+8=")       # the addition model closes with "="
    assert episode.step("15") == Reply(done=True, reward=1.0)
    episode = Calculator(open_call=False).start("7+8=", {"answer": "15"})
    assert episode.opening() == ""
    assert episode.step("calc(7*8)") == Reply("56\n7+8=")
    assert episode.step("56") == Reply(done=True, reward=0.0)
    episode = Calculator().start("7+8=", {"answer": "15"})
    assert episode.step("7+x)") == Reply("error\n7+8=")
    assert Calculator().start("7+8=", {"answer": "15"}).step("15") == Reply(done=True, reward=1.0)


def test_the_addition_calculator_transcripts_are_episodes_as_the_calculator_plays_them():
    """Addition's calculator transcripts, which a language model learns the tool from, are what a
    rollout's row holds for a right episode, token for token: the question, the calculator's
    opening, the call closed by "=", the calculator's reply, the answer and the stop token."""
    windows = Addition(form="text", problems=64, max_operand=9, length=24, calculator=1.0).records()
    for row in windows.columns["text"]:
        text = bytes(row.tolist()).decode()
        transcript = text[: text.index("\n", text.index("\n") + 1) + 1]  # the window's first episode
        question = text[: text.index("=") + 1]
        answer = str(arithmetic(question[:-1]))
        episode = Calculator().start(question, {"answer": answer})
        opening = episode.opening()
        reply = episode.step(question)  # the call: the question itself, closed by "=" (a stop string)
        assert episode.step(answer) == Reply(done=True, reward=1.0)
        assert transcript == question + opening + question + reply.observation + answer + "\n"


# -- the rollout, with a scripted environment --------------------------------------------------------
@dataclass(frozen=True)
class Scripted:
    """Opens with '<'; answers a first turn with '!' and its length; ends the second with reward 2.

    Episodes of prompts starting with fail_on raise in `where` ("start" or "step", or answer with a
    string for "reply"); those of prompts
    starting with hang_on sleep 30 s in step.
    """

    max_turns: int = 3
    stop_strings: tuple[str, ...] = ()
    fail_on: str = "-"
    where: str = "step"
    hang_on: str = "-"
    given: object = None  # what "opening", "observation" or "reward" answers with, for fail_on's prompts

    def start(self, prompt, record):
        if self.where == "start" and prompt.startswith(self.fail_on):
            raise RuntimeError("the tool broke")
        return _ScriptedEpisode(self, prompt)


@dataclass
class _ScriptedEpisode:
    environment: Scripted
    prompt: str
    turns: int = 0

    def _failing(self, where):
        return self.environment.where == where and self.prompt.startswith(self.environment.fail_on)

    def opening(self):
        return self.environment.given if self._failing("opening") else "<"

    def step(self, action):
        if self._failing("step"):
            raise RuntimeError("the tool broke")
        if self._failing("observation"):
            return Reply(self.environment.given)
        if self._failing("reward"):
            return Reply(done=True, reward=self.environment.given)
        if self.environment.where == "reply" and self.prompt.startswith(self.environment.fail_on):
            return "a string, not a Reply"
        if self.prompt.startswith(self.environment.hang_on):
            time.sleep(30)
        self.turns += 1
        if self.turns == 1:
            return Reply(f"!{len(action)}")
        return Reply(done=True, reward=2.0)


@pytest.fixture(scope="module")
def state():
    class State:
        params = MODEL.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))

    return State


BATCH = {"prompt": np.asarray([list(b"1+1="), list(b"2+2=")], np.int32),
         "prompt_length": np.asarray([4, 4], np.int32), "answer": np.asarray([[50], [52]], np.int32)}


def _rollout(environment, **kwargs):
    return EpisodeRollout(MODEL, environment, group_size=2, max_new_tokens=3, sampling=Sampling(1.0),
                          **kwargs)


def _segments(mask_row):
    """(value, start, end) runs of a mask row."""
    runs, start = [], 0
    for i in range(1, len(mask_row) + 1):
        if i == len(mask_row) or mask_row[i] != mask_row[start]:
            runs.append((int(mask_row[start]), start, i))
            start = i
    return runs


def test_a_row_holds_prompt_opening_turns_and_answers_with_the_mask_on_the_turns_only(state):
    rollout = _rollout(Scripted())
    out = rollout(state, BATCH, jax.random.key(3))
    assert out["tokens"].shape == out["mask"].shape == (4, 32)
    np.testing.assert_array_equal(out["reward"], [2.0] * 4)
    np.testing.assert_array_equal(out["turns"], [2.0] * 4)
    np.testing.assert_array_equal(out["failed_episodes"], [0.0] * 4)
    for r in range(4):
        tokens, runs = out["tokens"][r], _segments(out["mask"][r])
        (_, a, b), (one, c, d), (_, e, f), (two, g, h), (_, i, _) = runs
        assert (one, two) == (1, 1) and d - c == h - g == 3  # two turns of max_new_tokens each
        assert bytes(tokens[a:b].tolist()) == bytes(BATCH["prompt"][r // 2].tolist()) + b"<"
        turn = bytes(tokens[c:d].tolist()).decode(errors="replace")
        assert bytes(tokens[e:f].tolist()) == f"!{len(turn)}".encode()
        assert not tokens[i:].any()  # padding after the episode
    # The cache carries each episode across its turns: each prompt (and opening) is written once for
    # its group, all but its last token (4 each); a second turn writes the first turn's last token and
    # the answer but its last token ("!n": 1 + 1), nothing of the earlier turns again.
    assert rollout.engine.stats.prefilled_tokens == 2 * 4 + 4 * 2
    expected = token_logprobs(MODEL, {"params": state.params["params"]}, jnp.asarray(out["tokens"]))[0]
    np.testing.assert_allclose(out["old_logp"], expected, rtol=1e-5, atol=1e-5)
    (journaled,) = rollout.transcript()  # what the rollout journal keeps: each episode after its prompt
    assert journaled["prompts"] == ["1+1=", "1+1=", "2+2=", "2+2="] and journaled["rewards"] == [2.0] * 4
    assert all(e.startswith("<") for e in journaled["episodes"])  # the whole episode, opening first
    last_turns = [_segments(out["mask"][r])[3] for r in range(4)]  # (1, start, end) of each second turn
    turns = [bytes(out["tokens"][r][a:b].tolist()).decode(errors="replace") for r, (_, a, b) in enumerate(last_turns)]
    assert journaled["completions"] == turns  # the last turn: what the environment's reward judged
    np.testing.assert_array_equal(journaled["context"]["answer"], [[50], [50], [52], [52]])
    assert rollout.transcript() == []
    again = rollout(state, BATCH, jax.random.key(3))  # the same key: the same episodes
    np.testing.assert_array_equal(again["tokens"], out["tokens"])


@pytest.mark.parametrize("where", ["start", "step", "reply"])
def test_an_environment_that_raises_ends_its_episodes_with_zero_reward_and_a_warning(state, where):
    rollout = _rollout(Scripted(fail_on="1", where=where))
    said = {"start": "raised RuntimeError: the tool broke in the start",
            "step": "raised RuntimeError: the tool broke in a turn",
            "reply": r"answered a turn of episode \d with a str, not a dew.environments.Reply"}[where]
    with pytest.warns(EnvironmentFailedWarning, match=f"Scripted {said}"):
        out = rollout(state, BATCH, jax.random.key(3))
    np.testing.assert_array_equal(out["reward"], [0.0, 0.0, 2.0, 2.0])
    np.testing.assert_array_equal(out["failed_episodes"], [1.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(out["turns"], [0.0, 0.0, 2.0, 2.0] if where == "start" else [1.0, 1.0, 2.0, 2.0])
    assert rollout.engine.kept == () and rollout.engine.blocks.used_blocks == 0  # nothing left held



@pytest.mark.parametrize("where, given, said", [
    ("opening", 123, r"opening\(\) returned int 123, not text"),
    ("opening", None, r"opening\(\) returned NoneType None, not text"),
    ("observation", b"42", r"its Reply's observation is bytes b'42', not text"),
    ("reward", float("nan"), r"its Reply ends the episode with reward nan, not a finite number"),
    ("reward", float("inf"), r"its Reply ends the episode with reward inf, not a finite number"),
    ("reward", "lots", r"its Reply ends the episode with reward 'lots', not a finite number"),
])
def test_an_environment_answering_with_no_text_or_no_finite_reward_ends_its_episodes(state, where, given, said):
    """An opening or observation that was no text failed the run with a traceback from the tokenizer
    (naming no environment), and a NaN reward was taken: its group's advantages went NaN and every
    step was rejected as non-finite. Each ends its episode with reward 0 and a warning, as a raise does."""
    rollout = _rollout(Scripted(fail_on="1", where=where, given=given))
    with pytest.warns(EnvironmentFailedWarning, match=f"Scripted raised EnvironmentReplyError: {said}"):
        out = rollout(state, BATCH, jax.random.key(3))
    np.testing.assert_array_equal(out["reward"], [0.0, 0.0, 2.0, 2.0])
    np.testing.assert_array_equal(out["failed_episodes"], [1.0, 1.0, 0.0, 0.0])
    assert np.isfinite(out["old_logp"]).all() and rollout.engine.kept == ()


def test_an_environment_allowing_no_turn_or_a_timeout_of_no_time_is_refused():
    """max_turns 0 or below was accepted, and the model still played a turn whose reward counted;
    a turn_timeout of 0 or below cut every call off at once."""
    for turns in (0, -2, 1.5, True):
        with pytest.raises(NotAnEnvironmentError, match=rf"Scripted.max_turns is {turns!r}; an episode allows "
                                                        "the model at least one turn"):
            resolve_environment(Scripted(max_turns=turns))
    for timeout in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=rf"turn_timeout={timeout!r}; give the seconds"):
            _rollout(Scripted(), turn_timeout=timeout)
    # a recipe's objective is refused as it is built (dew train --check), not at its first rollout
    with pytest.raises(NotAnEnvironmentError, match=r"Calculator.max_turns is 0"):
        GRPOObjective(MODEL, environment={"name": "calculator", "max_turns": 0}, group_size=2, stop_token=10)
    with pytest.raises(ValueError, match=r"GRPOObjective.turn_timeout=0; give the seconds"):
        GRPOObjective(MODEL, environment={"name": "calculator"}, group_size=2, stop_token=10, turn_timeout=0)


def test_the_environment_and_the_journal_read_the_prompt_as_the_policy_saw_it(state, tmp_path):
    """A chat prompt reached start(prompt) and the episode journal with its template's markers
    dropped ('user\\nWhat is...'), where the one-turn rollout journals them spelt out: an environment
    could not see the turns, and dew report and rescore read another prompt than the policy saw."""
    from bpe_helpers import build_tokenizer
    from dew.data.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer.from_directory(build_tokenizer(tmp_path / "tokenizer"))
    model = MODEL.clone(vocab_size=tokenizer.vocab_size, max_seq_len=64)
    text = "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text)
    batch = {"prompt": np.asarray([ids], np.int32), "prompt_length": np.asarray([len(ids)], np.int32)}
    seen = []

    @dataclass(frozen=True)
    class Seeing(Scripted):
        def start(self, prompt, record):
            seen.append(prompt)
            return super().start(prompt, record)

    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    rollout = EpisodeRollout(model, Seeing(), group_size=2, max_new_tokens=3, sampling=Sampling(1.0),
                             tokenizer=tokenizer)
    rollout(type("State", (), {"params": params}), batch, jax.random.key(0))
    assert seen == [text, text] and rollout.transcript()[0]["prompts"] == [text, text]


def test_records_without_the_key_the_calculator_reads_stop_the_rollout_naming_it(state):
    # Each episode's start failed alone (reward 0 and a warning per episode) and the run went on
    # learning nothing; a record that lacks the answers is the data's fault, said once.
    rollout = _rollout(Calculator(key="solution"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(BatchKeyError, match=r"checks answers under 'solution'.*\['answer'\].*objective\.environment\.key"):
            rollout(state, BATCH, jax.random.key(3))
    assert rollout.engine.kept == ()

def test_an_environment_that_hangs_is_cut_off_at_the_turn_timeout(state):
    rollout = _rollout(Scripted(hang_on="2"), turn_timeout=0.3)
    began = time.perf_counter()
    with pytest.warns(EnvironmentTimeoutWarning, match="within turn_timeout=0.3 s"):
        out = rollout(state, BATCH, jax.random.key(3))
    assert time.perf_counter() - began < 20.0  # not the 30 s the hung turns sleep
    np.testing.assert_array_equal(out["reward"], [2.0, 2.0, 0.0, 0.0])
    np.testing.assert_array_equal(out["failed_episodes"], [0.0, 0.0, 1.0, 1.0])
    with warnings.catch_warnings():  # the run goes on: the next call plays every episode again
        warnings.simplefilter("error")
        fine = _rollout(Scripted(), turn_timeout=0.3)(state, BATCH, jax.random.key(4))
    np.testing.assert_array_equal(fine["reward"], [2.0] * 4)


def test_grpo_with_an_environment_plays_episodes():
    objective = GRPOObjective(MODEL, environment={"name": "calculator"}, group_size=2, stop_token=10)
    rollout = objective.rollout()
    assert isinstance(rollout, EpisodeRollout) and rollout.environment == Calculator()
    assert rollout.turn_timeout == 10.0


KITS = '''
from dataclasses import dataclass, field

from dew.environments import Reply
from dew.environments.calculator import Calculator
from dew.testing import EnvironmentKit


class CalculatorKit(EnvironmentKit):
    def environment(self):
        return Calculator()

    def problems(self):
        return [("3+4=", {"answer": "7"}), ("1+1=", {"answer": "2"})]


@dataclass
class Shared:
    """Every episode appends to one list: episodes played together answer otherwise."""

    max_turns: int = 2
    stop_strings: tuple = ()
    seen: list = field(default_factory=list)

    def start(self, prompt, record):
        return self

    def opening(self):
        return ""

    def step(self, action):
        self.seen.append(action)
        return Reply(str(len(self.seen)))


class SharedKit(EnvironmentKit):
    def environment(self):
        return Shared()

    def problems(self):
        return [("a", {}), ("b", {})]
'''


def test_check_plugin_certifies_an_environment_with_its_kit(tmp_path, monkeypatch):
    from dew.testing.certify import GROUPS, Component, checks_of

    assert GROUPS["dew.environments"][:2] == ("dew.testing.environment", "EnvironmentKit")
    (tmp_path / "environment_kits.py").write_text(KITS)
    monkeypatch.syspath_prepend(str(tmp_path))
    good = checks_of(Component("dew.environments", "calculator", "dew.environments.calculator:Calculator",
                               "environment_kits:CalculatorKit"))
    assert {c.subject for c in good} == {"environment `calculator`"}
    assert [c.check for c in good if c.result != "passed"] == [], good
    assert "kit builds the registered component" in {c.check for c in good}
    bad = checks_of(Component("dew.environments", "shared", "environment_kits:Shared", "environment_kits:SharedKit"))
    failed = {c.check for c in bad if c.result == "failed"}
    assert "episodes share no state" in failed, bad


def _calculator_fit(directory, *, fail_at: int | None = None) -> tuple[str | None, list[int]]:
    """GRPO on calculator episodes for 4 steps, saving every 2; the rollout's call fail_at raises.
    The parameters' digest (None after the crash), and the steps the rollout was called for."""
    import hashlib

    import optax

    from dew import Checkpoints, Trainer

    objective = GRPOObjective(MODEL, environment={"name": "calculator"}, group_size=2, stop_token=10,
                              max_new_tokens=4)
    rollout = objective.rollout()
    calls = []

    class Crashing(EpisodeRollout):
        def __call__(self, state, batch, key):
            calls.append(int(state.step))
            if len(calls) == fail_at:
                raise RuntimeError("the rollout crashed")
            return super().__call__(state, batch, key)

    rollout.__class__ = Crashing  # the same rollout, counted
    data = Addition(form="prompts", problems=32, max_operand=9).load(batch=2, seed=0)
    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=rollout,
                      checkpoints=Checkpoints(directory))
    try:
        state = trainer.fit(data, steps=4, log_every=4, checkpoint_every=2)
    except RuntimeError as error:
        assert "the rollout crashed" in str(error)
        return None, calls
    leaves = jax.tree.leaves(jax.device_get(state.params))
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest(), calls


def test_episodes_are_played_on_policy_and_a_lag_they_would_not_read_is_refused():
    """An environment's episodes are played with the policy that trains on them (a step waits for
    its episodes): a dynamic-sampling filter around them no longer runs ahead, and a max_lag above
    the default, which would pace nothing, is refused by name."""
    from dew.objectives.group_sampling import IncompatibleOptionsError
    from dew.training.protocols import Lagging

    for dynamic in (False, True):
        rollout = GRPOObjective(MODEL, environment={"name": "calculator"}, group_size=2, stop_token=10,
                                max_new_tokens=4, dynamic_sampling=dynamic).rollout()
        assert not isinstance(rollout, Lagging) or rollout.max_lag == 0
    with pytest.raises(IncompatibleOptionsError, match=r"max_lag=2 \(an environment's episodes are played"):
        GRPOObjective(MODEL, environment={"name": "calculator"}, group_size=2, stop_token=10, max_lag=2)


@pytest.mark.slow
def test_a_resumed_episode_run_replays_its_journaled_episodes_bitwise(tmp_path):
    from dew.training.rollout_journal import read_journal

    expected, _ = _calculator_fit(tmp_path / "whole")
    # Crashed in step 3's rollout: the checkpoint is at step 2, the journal holds steps 0-2.
    assert _calculator_fit(tmp_path / "stopped", fail_at=4)[0] is None
    journaled = read_journal(tmp_path / "stopped")
    assert [e.step for e in journaled] == [0, 1, 2]
    assert all(text.startswith("calc(") for e in journaled for text in e.transcript[0]["episodes"])
    digest, calls = _calculator_fit(tmp_path / "stopped")
    assert digest == expected
    assert calls == [3]  # step 2's episodes replayed, not played again
