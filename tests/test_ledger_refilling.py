"""The data ledger of a run whose rollout refills its batch from the stream (DAPO's dynamic sampling).

The rollout is dew's own ``GroupFilter`` with dynamic sampling, around a sampler double that
gives every prompt a group of two completions whose rewards are all equal when the prompt's record
id is even, so those groups are dropped and the step reads further prompt batches from the stream.
The sampler writes down the record ids of every batch it was handed: the account the ledger is
checked against, step by step. Last, the shipped addition-dapo recipe (shrunk, from a fresh policy
whose groups are all wrong, so every step samples all its rounds) is trained, stopped and resumed
by `dew train`, and `dew audit` reads its ledger.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.data.sources import ArrayRecords
from dew.data.stream import StreamReader
from dew.objectives.group_sampling import GroupFilter
from dew.provenance.ledger import audit, read_ledger
from dew.testing.doubles import Linear
from dew.training.ledger import records_digest

RECORDS, PROMPTS, STEPS = 40, 4, 6


def _dataset() -> Dataset:
    ids = np.arange(RECORDS)
    x = np.random.default_rng(0).normal(size=(RECORDS, 4)).astype(np.float32)
    source = ArrayRecords({"id": ids, "x": x, "y": x.sum(axis=1, keepdims=True)})
    return Dataset(train=StreamReader(source, batch=PROMPTS, seed=1), batch=PROMPTS)


class Sampler:
    """Two completions per prompt; the group's rewards are equal when the record id is even.

    ``seen`` holds, for every sampling round, the record ids of the prompts it was handed.
    """

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def __call__(self, state, batch, key):
        ids = np.asarray(batch["id"])
        self.seen.append(ids.tolist())
        rows = np.repeat(ids, 2)
        reward = np.where(rows % 2 == 0, 1.0, np.tile([0.0, 1.0], len(ids))).astype(np.float32)
        return {"x": np.repeat(np.asarray(batch["x"]), 2, axis=0),
                "y": np.repeat(np.asarray(batch["y"]), 2, axis=0), "reward": reward}


class Recording(GroupFilter):
    """DAPO's filter, noting which sampling rounds each step made (to group ``Sampler.seen`` by step)."""

    def __init__(self, sampler: Sampler) -> None:
        super().__init__(sampler, group_size=2, dynamic=True, max_rounds=4)
        self.rounds: list[int] = []

    def __call__(self, state, batch, key):
        before = len(self.sampler.seen)
        out = super().__call__(state, batch, key)
        self.rounds.append(len(self.sampler.seen) - before)
        return out


def _train(directory, steps: int) -> tuple[Sampler, list[list[int]]]:
    """Fit to steps, resuming from directory's checkpoint; the record ids each step's rollout read."""
    sampler = Sampler()
    rollout = Recording(sampler)
    Trainer(Linear(), optax.sgd(0.01), key=jax.random.key(0), rollout=rollout,
            checkpoints=Checkpoints(directory)).fit(_dataset(), steps=steps, log_every=steps, checkpoint_every=1)
    per_step, at = [], 0
    for rounds in rollout.rounds:
        per_step.append([i for ids in sampler.seen[at:at + rounds] for i in ids])
        at += rounds
    return sampler, per_step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    _, per_step = _train(directory, STEPS)
    return directory, per_step


def test_the_ledger_lists_every_record_a_refilling_rollout_drew_once(uninterrupted):
    directory, per_step = uninterrupted
    assert len(per_step) == STEPS and any(len(ids) > PROMPTS for ids in per_step), "no step was refilled"
    ledger = read_ledger(directory)
    assert [s.step for s in ledger.steps] == list(range(1, STEPS + 1))
    # Each step's positions and records are every batch its rollout drew, the refills included.
    assert [s.end - s.first for s in ledger.steps] == [len(ids) for ids in per_step]
    assert [s.digest for s in ledger.steps] == [records_digest(ids) for ids in per_step]
    result = audit(ledger)
    assert result.exact and result.records == sum(len(ids) for ids in per_step)
    # The stream handed out exactly these records: a fresh stream's first positions hold them, in order.
    stream = _dataset().train.open()
    handed = [i for _ in range(result.records // PROMPTS) for i in next(stream)["id"].tolist()]
    assert handed == [i for ids in per_step for i in ids]
    # The last checkpoint saved the position right after the last refill.
    checkpoint = [row for row in _rows(directory) if row["kind"] == "checkpoint"][-1]
    assert checkpoint["step"] == STEPS and checkpoint["position"]["records"] == result.records


def test_a_resumed_refilling_run_neither_repeats_nor_skips_a_record(uninterrupted, tmp_path):
    reference, expected = uninterrupted
    _, first = _train(tmp_path, STEPS // 2)
    _, second = _train(tmp_path, STEPS)
    assert first + second == expected  # the rollout read on where it stopped
    ledger = read_ledger(tmp_path)
    assert len(ledger.segments) == 2 and ledger.segments[1].step == STEPS // 2
    assert [s.digest for s in ledger.steps] == [records_digest(ids) for ids in expected]
    assert audit(ledger).exact
    assert audit(ledger, read_ledger(reference)).exact


def _rows(directory):
    return [json.loads(line) for line in (directory / "ledger.jsonl").read_text().splitlines()]


def test_batches_of_one_step_that_leave_a_gap_are_refused_naming_both_spans():
    """A stream whose batches do not follow each other cannot be joined into one step's line."""
    from dew.data.base import Consumption
    from dew.training.ledger import LedgerGapError, joined

    order = {"seed": 1, "size": RECORDS}
    first, later = Consumption(0, 4, np.arange(4), order), Consumption(8, 12, np.arange(8, 12), order)
    with pytest.raises(LedgerGapError, match=r"\[0, 4\) under order .* then \[8, 12\)"):
        joined([first, later])
    step = joined([first, Consumption(4, 8, np.arange(4, 8), order)])
    assert (step.first, step.end) == (0, 8) and records_digest(step.records) == records_digest(range(8))


DAPO = ["addition-dapo", "init=null", "model.num_layers=1", "model.emb_features=32", "model.mlp_features=64",
        "objective.group_size=2", "data.batch=4", "trainer.log_every=1", "trainer.checkpoint_every=1"]


@pytest.mark.slow
def test_dew_audit_counts_the_prompts_dapo_refilled_across_a_resume(tmp_path, monkeypatch, capsys):
    from dew.cli import main

    monkeypatch.chdir(tmp_path)  # the recipe's relative run directory
    assert main(["train", *DAPO, "trainer.steps=2"]) == 0
    assert main(["train", *DAPO, "trainer.steps=4"]) == 0
    run = tmp_path / "runs" / "addition-dapo"
    rounds = {row["step"]: row["train/sampling_rounds"] for row in map(json.loads, (run / "scalars.jsonl").open())
              if "train/sampling_rounds" in row}
    assert sorted(rounds) == [1, 2, 3, 4] and max(rounds.values()) > 1, rounds
    ledger = read_ledger(run)
    assert len(ledger.segments) == 2
    # Every round of a step sampled one batch of 4 prompts from the stream: the first, then the refills.
    assert [s.end - s.first for s in ledger.steps] == [4 * round(rounds[s.step]) for s in ledger.steps]
    capsys.readouterr()
    assert main(["audit", str(run)]) == 0, capsys.readouterr().out


def test_a_mixtures_record_counts_include_the_batches_a_rollout_refilled_from():
    """data/<source>/records, logged with a step, count every batch the step drew, refills included."""
    from dew.data.base import DataPartition
    from dew.data.mixture import Mixture
    from dew.testing.doubles import RecordingTracker

    class Rows:
        def __init__(self, tag):
            self.tag = tag

        def records(self):
            x = np.random.default_rng(self.tag).normal(size=(32, 4)).astype(np.float32)
            return ArrayRecords({"x": x, "y": x.sum(1, keepdims=True), "tag": np.full(32, self.tag)})

    def equal(state, batch, key):  # every group's rewards equal: each step samples all max_rounds rounds
        rows = {k: np.repeat(np.asarray(batch[k]), 2, axis=0) for k in ("x", "y")}
        return {**rows, "reward": np.ones(2 * len(batch["x"]), np.float32)}

    data = Mixture(sources={"a": Rows(0), "b": Rows(1)}, weights={"a": 3, "b": 1}).load(batch=PROMPTS)
    recorder = RecordingTracker()
    rollout = GroupFilter(equal, group_size=2, dynamic=True, max_rounds=2)
    Trainer(Linear(), optax.sgd(0.01), key=jax.random.key(0), tracker=recorder, rollout=rollout).fit(
        data, steps=4, log_every=2)
    stream = data.train(DataPartition())
    tags = np.concatenate([next(stream)["tag"] for _ in range(8)])  # two batches a step
    for name, tag in (("a", 0), ("b", 1)):
        assert recorder.series(f"data/{name}/records") == [
            (step, float((tags[: step * 2 * PROMPTS] == tag).sum())) for step in (2, 4)]
