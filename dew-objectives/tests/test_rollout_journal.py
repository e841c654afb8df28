"""The rollout journal: a GRPO run writes every step's batch, a resumed run replays what it already
sampled (bitwise the uninterrupted run, without calling the reward again), ``dew rescore`` scores the
journal with another reward, and ``dew report`` shows it.

One tiny addition policy; every fit shares one rollout (its engine compiles once) and one persistent
compilation cache (the later fits load the step the first compiled), so the module costs one cold
compile.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from dew import Checkpoints, Trainer
from dew.data.addition import Addition
from dew.models import build
from dew.objectives.grpo import GRPOObjective
from dew.rewards import ExactMatch
from dew.tracking.local import LocalTracker
from dew.training.feed import ReplayMismatchWarning
from dew.training.rollout_journal import ROLLOUTS, read_journal

pytestmark = pytest.mark.slow

STEPS = 6


class Counting:
    """exact_match on the answer, counting its calls; the call numbered fail_at raises (a crash)."""

    def __init__(self) -> None:
        self.calls, self.fail_at = 0, None

    def __call__(self, completions, context):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the scorer crashed")
        return ExactMatch()(completions, context)


class Runs:
    """Fits of one GRPO policy, all through one rollout and one compilation cache."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.reward = Counting()
        model = build("causal_transformer", vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
                      mlp_features=32, max_seq_len=16)
        self.objective = GRPOObjective(model, reward=self.reward, group_size=4, max_new_tokens=3,
                                       stop_token=10, temperature=1.0)
        self.rollout = self.objective.rollout()

    def fit(self, directory: Path, *, fail_at: int | None = None, problems: int = 0, every: int = 3,
            tracker: bool = False) -> str | None:
        """The parameters' digest after STEPS steps (None when the reward crashed the fit)."""
        self.reward.calls, self.reward.fail_at = 0, fail_at
        data = Addition(form="prompts", problems=64, max_operand=9, problem_seed=problems).load(batch=4, seed=0)
        trainer = Trainer(self.objective, optax.adam(1e-2), key=jax.random.key(0),
                          checkpoints=Checkpoints(directory), rollout=self.rollout,
                          tracker=LocalTracker(directory) if tracker else None)
        try:
            state = trainer.fit(data, steps=STEPS, log_every=1, checkpoint_every=every)
        except RuntimeError as error:
            assert "the scorer crashed" in str(error)
            return None
        finally:
            if trainer.tracker is not None:
                trainer.tracker.close()
        return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(state.params))).hexdigest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    cache = tmp_path_factory.mktemp("xla-cache")
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:
        yield Runs(cache)
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


@pytest.fixture(scope="module")
def whole(runs, tmp_path_factory):
    """An uninterrupted run, with its tracker beside its checkpoints: (directory, digest, reward calls)."""
    directory = tmp_path_factory.mktemp("whole")
    digest = runs.fit(directory, tracker=True)
    return directory, digest, runs.reward.calls


def test_every_step_journals_the_batch_it_trained_on_and_what_it_scored(runs, whole):
    directory, _, calls = whole
    assert calls == STEPS
    entries = read_journal(directory)
    assert [e.step for e in entries] == list(range(STEPS))
    for entry in entries:
        (round_,) = entry.transcript
        batch = entry.batch
        assert set(batch) >= {"tokens", "mask", "reward", "old_logp"}
        # The journaled rewards are the transcript's, and exact_match computed again from its texts.
        np.testing.assert_array_equal(batch["reward"], np.asarray(round_["rewards"], np.float32))
        answers = [bytes(a for a in row if a >= 0).decode() for row in round_["context"]["answer"]]
        assert round_["rewards"] == [float(c.split("\n")[0].strip() == a)
                                     for c, a in zip(round_["completions"], answers, strict=True)]
        # Each row's tokens are its prompt and then, under the mask, its completion up to the stop token.
        for row, mask, prompt, completion in zip(batch["tokens"], batch["mask"], round_["prompts"],
                                                 round_["completions"], strict=True):
            assert bytes(row[:len(prompt)].tolist()).decode() == prompt
            sampled = [int(t) % 256 for t in row[mask > 0]]
            sampled = sampled[:-1] if sampled and sampled[-1] == 10 else sampled
            assert bytes(sampled).decode("utf-8", errors="replace") == completion
        assert batch["old_logp"].shape == (16, batch["tokens"].shape[1] - 1)
        assert batch["old_logp"].dtype == np.float32


def test_a_resumed_run_replays_the_rollouts_it_paid_for_and_ends_bitwise(runs, whole, tmp_path):
    _, expected, _ = whole
    # The scorer crashes at the sixth step: the checkpoint is at step 3, the journal holds steps 0-4.
    assert runs.fit(tmp_path, fail_at=6) is None
    assert [e.step for e in read_journal(tmp_path)] == [0, 1, 2, 3, 4]
    # Resumed from step 3: steps 3 and 4 come from the journal, only step 5 is sampled and scored.
    assert runs.fit(tmp_path) == expected
    assert runs.reward.calls == 1
    assert [e.step for e in read_journal(tmp_path)] == list(range(STEPS))


def test_a_stream_that_changed_since_the_journal_is_sampled_again(runs, whole, tmp_path):
    _, expected, _ = whole
    assert runs.fit(tmp_path, fail_at=6) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        changed = runs.fit(tmp_path, problems=1)  # other problems: the steps from 3 on read other prompts
    assert any(issubclass(w.category, ReplayMismatchWarning) for w in caught)
    assert runs.reward.calls == 3  # steps 3, 4 and 5 sampled again
    assert changed != expected


def test_rescore_scores_the_journal_with_another_reward(whole, tmp_path, capsys):
    from dew.cli import main

    directory, _, _ = whole
    out = tmp_path / "scores.jsonl"
    assert main(["rescore", str(directory), "reward=length", "reward.target=2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in printed[1:STEPS + 1]]
    import json

    written = [json.loads(line) for line in out.read_text().splitlines()]
    for entry, row, line in zip(read_journal(directory), rows, written, strict=True):
        (round_,) = entry.transcript
        by_hand = [-abs(len(c) - 2.0) for c in round_["completions"]]  # Length(target=2), no stop
        assert line["rewards"] == by_hand and line["step"] == entry.step
        assert int(row[0]) == entry.step and int(row[1]) == len(by_hand)
        assert float(row[2]) == pytest.approx(np.mean(round_["rewards"]), abs=1e-4)
        assert float(row[3]) == pytest.approx(np.mean(by_hand), abs=1e-4)


def test_rescore_refuses_in_one_line(whole, tmp_path, capsys):
    from dew.cli import main

    directory, _, _ = whole
    cases = [([str(tmp_path), "reward=exact_match"], ROLLOUTS), ([str(directory)], "reward=NAME"),
             ([str(directory), "reward=no_such_reward"], "no_such_reward"),
             ([str(directory), "temperature=2"], "reward.FIELD=VALUE")]
    for arguments, named in cases:
        assert main(["rescore", *arguments]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("dew rescore: ") and named in err, err


def test_report_shows_the_sampled_completions_by_step(whole, tmp_path):
    import html

    from dew.cli.report import render_report

    directory, _, _ = whole
    page = render_report(directory, tmp_path / "report").read_text()
    assert "id='rollouts'" in page
    last = read_journal(directory)[-1]
    assert html.escape(last.transcript[0]["completions"][0]) in page
    assert f"<td rowspan='8'>{last.step}<br>" in page
