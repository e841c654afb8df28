"""Asynchronous rollouts and the rollout journal, on any rollout.

A rollout with max_lag L makes the next steps' batches from the policy up to L steps behind while a
step trains; max_lag 0 is the on-policy run, bit for bit. A resumed run replays the rollouts its journal
holds past its checkpoint (asynchronous or not): one that
refills its batch from the stream and keeps a state of its own reads the same records and ends in the
same state as an uninterrupted run, without being called for the replayed steps.

The rollout is a double around dew's Linear objective: it depends on the live parameters and the key,
refills from the stream on some steps (``Refilling``), counts what it made (``Resumable``) and says
what it scored (``Transcribed``).
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np
import optax
import pytest

from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.data.sources import ArrayRecords
from dew.data.stream import StreamReader
from dew.provenance.ledger import audit, read_ledger
from dew.testing.doubles import Linear
from dew.training.rollout_journal import read_journal

RECORDS, PROMPTS, STEPS = 64, 4, 8


def _dataset() -> Dataset:
    ids = np.arange(RECORDS)
    x = np.random.default_rng(0).normal(size=(RECORDS, 4)).astype(np.float32)
    source = ArrayRecords({"id": ids, "x": x, "y": x.sum(axis=1, keepdims=True)})
    return Dataset(train=StreamReader(source, batch=PROMPTS, seed=1), batch=PROMPTS)


class Drifting:
    """Targets moved by the live parameters, the key and a count it keeps; a batch whose first record
    id is odd is swapped for the stream's next one. Call number fail_at raises (a crash)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.made, self.calls, self.fail_at = 0, 0, fail_at
        self.more = None
        self.kernels: list[np.ndarray] = []  # the kernel each call sampled with

    def draw_from(self, more) -> None:
        self.more = more

    def __call__(self, state, batch, key):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the rollout crashed")
        if int(np.asarray(batch["id"])[0]) % 2:
            batch = self.more()
        self.made += 1
        kernel = np.asarray(state.params["params"]["kernel"])
        self.kernels.append(kernel)
        x = np.asarray(batch["x"])
        noise = np.asarray(jax.random.normal(key, (len(x), 1)))
        y = np.asarray(batch["y"]) + 0.1 * self.made + 0.5 * x @ kernel + 0.01 * noise
        return {"x": x, "y": y.astype(np.float32)}

    def get_state(self) -> bytes:
        return json.dumps({"made": self.made}).encode()

    def set_state(self, state: bytes) -> None:
        self.made = json.loads(state)["made"]

    def transcript(self) -> list[dict]:
        return [{"prompts": [], "completions": [], "rewards": [float(self.made)], "context": {}}]


class Lagged(Drifting):
    """Drifting, run ahead by up to max_lag steps."""

    def __init__(self, max_lag: int, fail_at: int | None = None) -> None:
        super().__init__(fail_at)
        self.max_lag = max_lag


def _train(directory, rollout: Drifting, steps: int = STEPS, recipe: dict | None = None):
    return Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), rollout=rollout, recipe=recipe,
                   checkpoints=None if directory is None else Checkpoints(directory)).fit(
        _dataset(), steps=steps, log_every=steps, checkpoint_every=4)


def _digest(state) -> str:
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(state.params))).hexdigest()


def _fit(directory, rollout: Drifting, recipe: dict | None = None) -> str | None:
    try:
        state = _train(directory, rollout, recipe=recipe)
    except RuntimeError as error:
        assert "the rollout crashed" in str(error)
        return None
    return _digest(state)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    rollout = Drifting()
    return directory, _fit(directory, rollout), rollout


def test_a_refilling_stateful_rollout_is_replayed_bitwise_from_the_journal(uninterrupted, tmp_path):
    reference, expected, whole = uninterrupted
    assert any(e.draws > 1 for e in read_journal(reference)), "no step refilled"
    # Crashed in step 6's rollout: the checkpoint is at step 4, the journal holds steps 0-5.
    assert _fit(tmp_path, Drifting(fail_at=7)) is None
    assert [e.step for e in read_journal(tmp_path)] == [0, 1, 2, 3, 4, 5]
    resumed = Drifting()
    assert _fit(tmp_path, resumed) == expected
    assert resumed.calls == 2 and resumed.made == whole.made  # steps 6 and 7 made, 4 and 5 replayed
    # Replaying read the refills again: the same records, step by step, as the uninterrupted run.
    assert audit(read_ledger(tmp_path), read_ledger(reference)).exact
    journal = read_journal(tmp_path)
    assert [e.transcript[0]["rewards"] for e in journal] == [[float(i + 1)] for i in range(STEPS)]


def test_a_resume_whose_objective_changed_samples_again_instead_of_replaying(tmp_path):
    """The journal's steps past the checkpoint were made under the recipe's old objective section
    (a group size, a temperature, a reward): a resume with another one samples them again, with a
    warning, where it replayed them and trained on batches of the old settings."""
    from dew.training.feed import ReplayMismatchWarning

    before = {"objective": {"name": "linear", "group_size": 4}}
    assert _fit(tmp_path, Drifting(fail_at=7), recipe=before) is None  # checkpoint at 4, journal to 5
    same = Drifting()
    assert _fit(tmp_path / "copy", Drifting(fail_at=7), recipe=before) is None
    assert _fit(tmp_path / "copy", same, recipe=before) is not None
    assert same.calls == 2  # steps 4 and 5 replayed under the same settings
    changed = Drifting()
    after = {"objective": {"name": "linear", "group_size": 8}}
    with pytest.warns(ReplayMismatchWarning, match="other objective settings"):
        assert _fit(tmp_path, changed, recipe=after) is not None
    assert changed.calls == 4  # steps 4 to 7 sampled with the new settings


def test_max_lag_0_is_the_on_policy_run_bitwise(uninterrupted, tmp_path):
    _, expected, whole = uninterrupted
    rollout = Lagged(0)
    assert _fit(tmp_path, rollout) == expected
    for seen, on_policy in zip(rollout.kernels, whole.kernels, strict=True):
        np.testing.assert_array_equal(seen, on_policy)


def test_max_lag_1_samples_each_step_from_the_policy_one_step_behind(uninterrupted):
    _, on_policy, whole = uninterrupted
    rollout = Lagged(1)
    assert _digest(_train(None, rollout)) != on_policy
    # Steps 0 and 1 are both made from the starting policy; step s > 1 from the policy after s - 1
    # steps, which a run of s - 1 steps ends with (the steps before do not depend on what is made ahead).
    np.testing.assert_array_equal(rollout.kernels[0], whole.kernels[0])
    np.testing.assert_array_equal(rollout.kernels[1], whole.kernels[0])
    for step in (3, 6):
        behind = _train(None, Lagged(1), steps=step - 1)
        np.testing.assert_array_equal(rollout.kernels[step], np.asarray(behind.params["params"]["kernel"]))
    # The batch past the last step (what a longer run would train on next) is begun while the last
    # step trains; a fit without checkpoints closes without waiting, dropping it if the worker had not
    # begun it yet (as on a loaded machine): made at most once, and never a second one past it.
    assert rollout.calls in (STEPS, STEPS + 1), rollout.calls


@pytest.mark.parametrize(("lag", "threaded"), [(1, True), (2, True), (1, False)])
def test_an_asynchronous_run_resumes_bitwise_from_its_journal(lag, threaded, tmp_path, monkeypatch):
    reference = tmp_path / "whole"
    whole = Lagged(lag)
    expected = _fit(reference, whole)
    if not threaded:  # as on a mesh of several devices: each lagged batch made in the loop, when asked
        from dew.training import feed
        from dew.training.rollout_ahead import Ahead

        monkeypatch.setattr(feed, "Ahead", lambda make, lag, threaded: Ahead(make, lag, threaded=False))
        inline = tmp_path / "inline"
        assert _fit(inline, Lagged(lag)) == expected
        assert audit(read_ledger(inline), read_ledger(reference)).exact
    # Crashed making step 6 (ahead): the checkpoint after step 4 saved the position step 4 was made
    # from, and the journal holds the steps made ahead of it, from the policies behind it.
    stopped = tmp_path / "stopped"
    assert _fit(stopped, Lagged(lag, fail_at=7)) is None
    resumed = Lagged(lag)
    assert _fit(stopped, resumed) == expected
    assert resumed.calls == STEPS + lag - 6  # steps 4 and 5 replayed; 6, 7 and lag past the end made
    assert audit(read_ledger(stopped), read_ledger(reference)).exact
