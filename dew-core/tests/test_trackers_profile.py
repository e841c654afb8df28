"""Profiler windows and dew.profile, and a fit's reports arriving in a LocalTracker."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax
import pytest

import dew
from dew.telemetry import profiling
from dew.testing.doubles import RecordingTracker, Regression
from dew.testing.doubles import regression_dataset as dataset
from dew.tracking.composite import Trackers
from dew.tracking.local import LocalTracker
from dew.training.profiling import ProfilerBusyError, ProfileWindow


def _traces(directory):
    return list(directory.rglob("*.xplane.pb"))


def test_profile_context_traces_and_excludes_a_second_trace(tmp_path):
    assert not profiling.active()
    with dew.profile(tmp_path / "outer"):
        assert profiling.active()
        jnp.ones(8).sum().block_until_ready()
        with pytest.raises(ProfilerBusyError, match="dew.profile"):
            ProfileWindow(str(tmp_path / "inner"), steps=2).schedule(0)
        with pytest.raises(ProfilerBusyError):
            with dew.profile(tmp_path / "again"):
                pass
    assert not profiling.active()
    assert _traces(tmp_path / "outer") and not (tmp_path / "inner").exists()


def test_window_opens_after_warmup_and_closes_after_steps(tmp_path):
    schedule = ProfileWindow(str(tmp_path), steps=3, warmup=2).schedule(10)
    opened, records = [], []
    for done in range(11, 20):
        record = schedule.on_step(done)
        opened.append(profiling.active())
        if record is not None:
            records.append((done, record))
    # steps 11 and 12 warm up; the trace opens at 12 and holds steps 13, 14, 15
    assert opened == [False, True, True, True, False, False, False, False, False]
    (done, record), = records
    assert done == 15 and (record.start, record.steps) == (12, 3)
    assert _traces(tmp_path)
    with pytest.raises(ValueError, match="at least one step"):
        ProfileWindow(str(tmp_path), steps=0)


def test_a_fit_reports_its_window_goodput_and_lines(tmp_path, capsys):
    local, recorder = LocalTracker(tmp_path / "run"), RecordingTracker()
    trainer = dew.Trainer(Regression(), optax.sgd(0.05), key=jax.random.key(0),
                          tracker=Trackers(local, recorder),
                          profile=ProfileWindow(str(tmp_path / "trace"), steps=2, warmup=2))
    trainer.fit(dataset(), steps=8, log_every=4)
    local.close()

    rows = [json.loads(line) for line in (tmp_path / "run/scalars.jsonl").read_text().splitlines()]
    assert rows == [{"step": step, **row} for step, row in recorder.rows] and [row["step"] for row in rows] == [4, 8]
    records = [json.loads(line) for line in (tmp_path / "run/records.jsonl").read_text().splitlines()]
    kinds = [row["type"] for row in records]
    assert kinds[0] == "run_started" and kinds[-1] == "goodput" and "profile_window" in kinds
    window = records[kinds.index("profile_window")]["record"]
    assert (window["start"], window["steps"]) == (2, 2) and _traces(tmp_path / "trace")
    # The tracker receives it as the reference documents name it: the ProfileWindow record of
    # dew.telemetry.records.
    from dew.telemetry.records import ProfileWindow as Written
    assert [(value.start, value.steps) for _, value in recorder.artifacts if isinstance(value, Written)] == [(2, 2)]
    goodput = records[-1]["record"]
    assert 0 < goodput["fraction"] <= 1 and goodput["wall_seconds"] >= goodput["step_seconds"]

    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Training from step 0 to 8 on {'data': 1")
    assert out[0].endswith("(1 process(es))")
    assert out[1].startswith("no checkpoints: a preemption notice (SIGTERM) stops this run without saving it")
    assert out[2] == f"tracking: {tmp_path / 'run'}"
    assert out[3].startswith("compiling the step for batches of 8 rows: ")
    logged = [line for line in out if line.startswith("step ") and ": loss " in line]
    assert [line.split(":")[0] for line in logged] == ["step 4", "step 8"]
    # once, at the first logged step: the compile is not in the throughput
    assert [line for line in out if "throughput is timed" in line][0].startswith("step 4: ")
    assert logged[0].startswith(f"step 4: loss {rows[0]['train/loss']:.4f}")
    assert out[-1].startswith("Goodput: first step after ")


def test_a_fit_inside_dew_profile_refuses_its_window(tmp_path):
    trainer = dew.Trainer(Regression(), optax.sgd(0.05), key=jax.random.key(0),
                          profile=ProfileWindow(str(tmp_path / "window"), steps=2))
    with dew.profile(tmp_path / "outer"):
        with pytest.raises(ProfilerBusyError, match="ProfileWindow"):
            trainer.fit(dataset(), steps=4, log_every=2)
