"""The rollout journal and asynchronous rollouts on GRPO: a run writes every step's batch, a resumed run
replays what it already sampled (bitwise the uninterrupted run, without calling the reward again, on-
and off-policy), an asynchronous run's old_logp is the lagged sampling policy's, ``dew rescore`` scores
the journal with another reward, and ``dew report`` shows it.

One tiny addition policy; the fits of each max_lag share one rollout (its engine compiles once) and
all share one persistent compilation cache (the later fits load the step the first compiled; the
suite's own where it keeps one), so the module costs at most one cold compile.
"""

from __future__ import annotations

import hashlib
import json
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
from dew.testing.processes import shared_compilation_cache
from dew.tracking.local import LocalTracker
from dew.training.feed import ReplayMismatchWarning
from dew.training.rollout_journal import read_journal

pytestmark = pytest.mark.slow

STEPS = 6


def _scored(completion: str, answer: str) -> float:
    """The reward by hand: 1 for the right answer, and a tenth per character of the answer given (so
    the completions of a group differ and the policy moves from the first step)."""
    given = completion.split("\n")[0]
    return float(given.strip() == answer) + 0.1 * len(given)


class Counting:
    """exact_match on the answer plus a tenth per character, counting its calls; the call numbered
    fail_at raises (a crash)."""

    def __init__(self) -> None:
        self.calls, self.fail_at = 0, None

    def __call__(self, completions, context):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the scorer crashed")
        lengths = np.asarray([len(c.split("\n")[0]) for c in completions], np.float32)
        return ExactMatch()(completions, context) + np.float32(0.1) * lengths


class _Undigested:
    """Records read through, without the fingerprint() a saved position keeps of ArrayRecords."""

    def __init__(self, records) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        return self.records[index]

    def take(self, indices):
        return self.records.take(indices)


class Runs:
    """Fits of one GRPO policy, all through one rollout and one compilation cache."""

    def __init__(self) -> None:
        self.reward = Counting()
        self.model = build("causal_transformer", vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
                           mlp_features=32, max_seq_len=16)
        self.objectives = {lag: GRPOObjective(self.model, reward=self.reward, group_size=4, max_new_tokens=3,
                                              stop_token=10, temperature=1.0, max_lag=lag) for lag in (0, 1)}
        self.rollouts = {lag: objective.rollout() for lag, objective in self.objectives.items()}
        self._whole: dict[int, tuple[Path, str, int]] = {}

    def train(self, directory: Path | None, *, lag: int = 0, steps: int = STEPS, problems: int = 0,
              every: int = 3, tracker: bool = False, digested: bool = True):
        reader = Addition(form="prompts", problems=64, max_operand=9, problem_seed=problems)
        if digested:
            data = reader.load(batch=4, seed=0)
        else:  # records whose saved position keeps no digest of them (a plugin's source, say)
            from dew.data.stream import record_dataset

            data = record_dataset(_Undigested(reader.records()), None, batch=4, seed=0)
        trainer = Trainer(self.objectives[lag], optax.adam(1e-2), key=jax.random.key(0),
                          checkpoints=None if directory is None else Checkpoints(directory),
                          rollout=self.rollouts[lag], tracker=LocalTracker(directory) if tracker else None)
        try:
            return trainer.fit(data, steps=steps, log_every=1, checkpoint_every=every)
        finally:
            if trainer.tracker is not None:
                trainer.tracker.close()

    def fit(self, directory: Path, *, fail_at: int | None = None, **options) -> str | None:
        """The parameters' digest after STEPS steps (None when the reward crashed the fit)."""
        self.reward.calls, self.reward.fail_at = 0, fail_at
        try:
            state = self.train(directory, **options)
        except RuntimeError as error:
            assert "the scorer crashed" in str(error)
            return None
        return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(state.params))).hexdigest()

    def whole(self, directory: Path, lag: int) -> tuple[Path, str, int]:
        """An uninterrupted run of max_lag lag, its tracker beside its checkpoints: (directory, digest,
        reward calls), made once."""
        if lag not in self._whole:
            digest = self.fit(directory, lag=lag, tracker=True)
            self._whole[lag] = (directory, digest, self.reward.calls)
        return self._whole[lag]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir",
                      str(shared_compilation_cache(tmp_path_factory.mktemp("xla-cache"))))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:
        yield Runs()
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


@pytest.fixture(scope="module")
def whole(runs, tmp_path_factory):
    """The uninterrupted on-policy run: (directory, digest, reward calls)."""
    return runs.whole(tmp_path_factory.mktemp("whole"), 0)


def test_every_step_journals_the_batch_it_trained_on_and_what_it_scored(runs, whole):
    directory, _, calls = whole
    assert calls == STEPS
    entries = read_journal(directory)
    assert [e.step for e in entries] == list(range(STEPS))
    for entry in entries:
        (round_,) = entry.transcript
        batch = entry.batch
        assert set(batch) >= {"tokens", "mask", "reward", "old_logp"}
        # The journaled rewards are the transcript's, and the reward computed again from its texts.
        np.testing.assert_array_equal(batch["reward"], np.asarray(round_["rewards"], np.float32))
        answers = [bytes(a for a in row if a >= 0).decode() for row in round_["context"]["answer"]]
        by_hand = [_scored(c, a) for c, a in zip(round_["completions"], answers, strict=True)]
        np.testing.assert_allclose(round_["rewards"], by_hand, rtol=1e-6)
        # Each row's tokens are its prompt and then, under the mask, its completion up to the stop token.
        for row, mask, prompt, completion in zip(batch["tokens"], batch["mask"], round_["prompts"],
                                                 round_["completions"], strict=True):
            assert bytes(row[:len(prompt)].tolist()).decode() == prompt
            sampled = [int(t) % 256 for t in row[mask > 0]]
            sampled = sampled[:-1] if sampled and sampled[-1] == 10 else sampled
            assert bytes(sampled).decode("utf-8", errors="replace") == completion
        assert batch["old_logp"].shape == (16, batch["tokens"].shape[1] - 1)
        assert batch["old_logp"].dtype == np.float32


@pytest.mark.parametrize("lag", [0, 1])
def test_a_resumed_run_replays_the_rollouts_it_paid_for_and_ends_bitwise(runs, lag, tmp_path_factory, tmp_path):
    _, expected, calls = runs.whole(tmp_path_factory.mktemp("whole"), lag)
    assert calls == STEPS + lag  # asynchronous: one batch made past the end, while the last step trained
    # The scorer crashes making the sixth step: the checkpoint is at step 3, the journal holds steps 0-4.
    assert runs.fit(tmp_path, lag=lag, fail_at=6) is None
    assert [e.step for e in read_journal(tmp_path)] == [0, 1, 2, 3, 4]
    # Resumed from step 3: steps 3 and 4 come from the journal (asynchronous: made by the policies of
    # steps 2 and 3), only step 5 (and the one past the end) is sampled and scored.
    assert runs.fit(tmp_path, lag=lag) == expected
    assert runs.reward.calls == 1 + lag
    assert [e.step for e in read_journal(tmp_path)] == list(range(STEPS + lag))


def test_an_asynchronous_step_trains_on_the_sampling_policys_log_probs(runs, tmp_path_factory):
    from dew.objectives.policy import token_logprobs

    directory, _, _ = runs.whole(tmp_path_factory.mktemp("whole"), 1)
    step = 4
    tokens, old_logp = (read_journal(directory)[step].batch[k] for k in ("tokens", "old_logp"))
    # Step 4's completions were sampled, and old_logp scored, by the policy after 3 steps, not 4.
    for done, sampled in ((step - 1, True), (step, False)):
        params = {"params": runs.train(None, lag=1, steps=done).params["params"]}
        scored = np.asarray(token_logprobs(runs.model, params, jax.numpy.asarray(tokens))[0])
        assert np.allclose(scored, old_logp, rtol=1e-5, atol=1e-6) == sampled, done


def test_a_stream_that_changed_since_the_journal_is_sampled_again(runs, whole, tmp_path):
    """Records whose position keeps a digest of them are refused when they changed; others (a
    plugin's source) give the journal other batches than it holds, which are sampled again."""
    from dew.data.stream import PositionMismatchError

    _, expected, _ = whole
    assert runs.fit(tmp_path, fail_at=6) is None
    with pytest.raises(PositionMismatchError, match="as many records, other contents"):
        runs.fit(tmp_path, problems=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        changed = runs.fit(tmp_path, problems=1, digested=False)  # the steps from 3 on read other prompts
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
        assert line["rewards"] == by_hand and line["step"] == entry.step + 1  # steps done, as the scalars
        assert int(row[0]) == entry.step + 1 and int(row[1]) == len(by_hand)
        assert float(row[2]) == pytest.approx(np.mean(round_["rewards"]), abs=1e-4)
        assert float(row[3]) == pytest.approx(np.mean(by_hand), abs=1e-4)


def test_rescore_refuses_in_one_line(whole, tmp_path, capsys):
    from dew.cli import main

    directory, _, _ = whole
    (tmp_path / "images").mkdir()  # a run whose rollout samples no text (FlowGRPO's) keeps no journal
    (tmp_path / "images" / "run.json").write_text('{"objective": {"name": "flow_grpo"}}')
    (tmp_path / "lm").mkdir()  # a language model samples text, but not as it trains: it said "samples no text"
    (tmp_path / "lm" / "run.json").write_text('{"objective": {"name": "lm"}}')
    cases = [([str(tmp_path), "reward=exact_match"], "Point at that directory"),
             ([str(tmp_path / "images"), "reward=exact_match"], "kept no rollout journal (rollouts.jsonl): "
              "only a rollout that samples text completions and scores them as it trains (GRPO's, PPO's) "
              "journals them, so this run's objective (flow_grpo) left nothing to rescore"),
             ([str(tmp_path / "lm"), "reward=exact_match"], "objective (lm) left nothing to rescore (or its "
              "journal was removed). To score what its model makes now, draw samples with dew generate"),
             ([str(directory)], "reward=NAME"),
             ([str(directory), "reward=no_such_reward"], "no_such_reward"),
             ([str(directory), "temperature=2"], "reward.FIELD=VALUE")]
    for arguments, named in cases:
        assert main(["rescore", *arguments]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("dew rescore: ") and named in err, err


def test_rescore_refuses_a_journal_damaged_in_its_middle_and_reads_one_cut_short(whole, tmp_path, capsys):
    """A line a crash cut short (the last, no newline) is what that step never finished writing; a
    damaged line before it held a step the run trained on, and rescoring without it would be silent."""
    import shutil

    from dew.cli import main
    from dew.training.rollout_journal import ROLLOUTS

    directory, _, _ = whole
    lines = (Path(directory) / ROLLOUTS).read_text().splitlines(keepends=True)
    rollouts = [n for n, line in enumerate(lines) if '"kind": "rollout"' in line]
    torn = tmp_path / "torn"
    shutil.copytree(directory, torn)
    (torn / ROLLOUTS).write_text("".join(lines) + lines[rollouts[0]][:40])
    assert [e.step for e in read_journal(torn)] == [e.step for e in read_journal(directory)]
    damaged = tmp_path / "damaged"
    shutil.copytree(directory, damaged)
    middle = rollouts[1]
    (damaged / ROLLOUTS).write_text("".join(lines[:middle]) + lines[middle][:40] + "\n" + "".join(lines[middle + 1:]))
    assert main(["rescore", str(damaged), "reward=length"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"line {middle + 1}, is not JSON" in err and f"sed -i '{middle + 1}d'" in err, err


def test_rescore_names_which_rule_a_reward_broke(whole, capsys):
    """A NaN and a two-column reward were one message ("16 values for 16 completions, or one that is
    not finite"), the matrix flattened before its shape was read; a reward's own error was caught only
    for three exception types."""
    from dew import registry
    from dew.cli import main

    directory, _, _ = whole
    planted = {"nan_at_one": lambda: (lambda c, x: [0.0] + [float("nan")] * (len(c) - 1)),
               "two_columns": lambda: (lambda c, x: np.zeros((len(c), 2))),
               "raises": lambda: (lambda c, x: 1 / 0)}
    count = len(read_journal(directory, batches=False)[0].transcript[0]["completions"])
    said = {"nan_at_one": "returned nan for step 1's completion 1 (", "two_columns": "returned an array of shape "
            f"({count}, 2) for step 1's {count} completions", "raises": "raised ZeroDivisionError: division by zero "
            "on step 1's"}
    for name, factory in planted.items():
        with registry.rewards.temporary(name, factory):
            assert main(["rescore", str(directory), f"reward={name}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"dew rescore: The reward '{name}' {said[name]}"), err


def test_report_shows_the_sampled_completions_by_step(whole, tmp_path):
    import html

    from dew.cli.report import render_report

    directory, _, _ = whole
    page = render_report(directory, tmp_path / "report").read_text()
    assert "id='rollouts'" in page
    last = read_journal(directory)[-1]
    assert html.escape(last.transcript[0]["completions"][0]) in page
    assert f"<td rowspan='8'>{last.step + 1}<br>" in page


def test_rescore_and_report_count_only_the_steps_the_run_took(runs, tmp_path_factory, tmp_path, capsys):
    """Run asynchronously, the journal ends with a batch sampled for a step past the end; the rows
    left are the run's steps, numbered and averaged as its tracker logged them."""
    from dew.cli import main
    from dew.cli.report import render_report

    directory, _, _ = runs.whole(tmp_path_factory.mktemp("whole"), 1)
    assert [e.step for e in read_journal(directory)] == list(range(STEPS + 1))
    logged = {row["step"]: row["train/reward"] for row in map(json.loads, (directory / "scalars.jsonl").open())
              if "train/reward" in row}
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert main(["rescore", str(directory), "reward=exact_match"]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in printed[1:] if line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert float(row[2]) == pytest.approx(logged[int(row[0])], abs=1e-4)
    (total,) = [line.split() for line in printed if line.startswith("   all")]
    assert float(total[2]) == pytest.approx(np.mean(list(logged.values())), abs=1e-4)
    assert printed[-1].startswith(f"(1 journaled step(s) past the last checkpoint, step {STEPS}, left out")
    page = render_report(directory, tmp_path / "report").read_text()
    assert f"<td rowspan='8'>{STEPS}<br>" in page and f"<td rowspan='8'>{STEPS + 1}<br>" not in page
    assert f"1 journaled past the last checkpoint (step {STEPS}) are not shown" in page


SHARDED = r'''
import hashlib, json, sys
import jax, numpy as np, optax
from dew import Checkpoints, Trainer
from dew.data.addition import Addition
from dew.models import build
from dew.objectives.grpo import GRPOObjective
from dew.rewards import ExactMatch
from dew.training import MeshSpec
import dew.training.feed as feed

out = sys.argv[1]
placed = []
place = feed.shard_batch


def recording(batch, mesh, partition, expected=None):
    arrays = place(batch, mesh, partition, expected)
    placed.append({key: str(array.sharding.spec) for key, array in arrays.items()})
    return arrays


feed.shard_batch = recording  # every batch the feed puts on the mesh, fresh or replayed
calls = {"n": 0, "fail_at": None}


def reward(completions, context):
    calls["n"] += 1
    if calls["n"] == calls["fail_at"]:
        raise RuntimeError("the scorer crashed")
    lengths = np.asarray([len(c.split("\n")[0]) for c in completions], np.float32)
    return ExactMatch()(completions, context) + np.float32(0.1) * lengths


model = build("causal_transformer", vocab_size=257, emb_features=16, num_layers=1, num_heads=2, mlp_features=32,
              max_seq_len=16)
objective = GRPOObjective(model, reward=reward, group_size=4, max_new_tokens=3, stop_token=10, temperature=1.0,
                          max_lag=0)
rollout = objective.rollout()


def fit(directory, fail_at=None):
    calls["n"], calls["fail_at"] = 0, fail_at
    placed.clear()
    data = Addition(form="prompts", problems=64, max_operand=9).load(batch=4, seed=0)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), mesh=MeshSpec(fsdp=2, tensor=2),
                      checkpoints=Checkpoints(directory), rollout=rollout)
    try:
        state = trainer.fit(data, steps=6, log_every=1, checkpoint_every=3)
    except RuntimeError:
        return None, list(placed), calls["n"]
    leaves = jax.tree.leaves(jax.device_get(state.params))
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest(), list(placed), calls["n"]


whole = fit(f"{out}/whole")
crashed = fit(f"{out}/stopped", fail_at=6)
resumed = fit(f"{out}/stopped")
print("RESULT" + json.dumps({"whole": whole, "crashed": crashed, "resumed": resumed}))
'''


def test_replayed_batches_are_placed_as_fresh_batches_on_a_mesh(tmp_path):
    """The spec: replay records follow batches. On 8 devices (data=2, fsdp=2, tensor=2) a run
    resumed from step 3 replays steps 3 and 4 from the journal: the feed places them with the
    batch's own sharding, exactly as the uninterrupted run placed the batches it sampled, and the
    run ends bitwise the uninterrupted one, calling the reward only for step 5."""
    from dew.testing.processes import run_python

    done = run_python(SHARDED.replace("sys.argv[1]", repr(str(tmp_path))), devices=8, timeout=600,
                      compilation_cache=shared_compilation_cache(tmp_path / "xla-cache"))
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    (digest, placed, calls), (_, _, crashed_calls), (resumed, replaced, resumed_calls) = (
        result["whole"], result["crashed"], result["resumed"])
    assert calls == 6 and crashed_calls == 6 and resumed_calls == 1
    assert resumed == digest
    assert len(placed) == 6 and len(replaced) == 3
    assert replaced == placed[3:]  # steps 3 and 4 replayed, step 5 sampled: placed alike
    assert all("data" in spec["tokens"] for spec in placed), placed  # the batch axes, not replicated
