"""The host side of a step: rollouts, custom steps, evaluation compiled once, hooks that
contribute, checkpoint URLs, batch edges and fit's exit paths."""

from __future__ import annotations

import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.objectives.base import EMASpec
from dew.plugins import StepContribution, hookimpl, registered
from dew.testing.doubles import Linear, RecordingTracker  # y = w.x + b by squared error
from dew.training.composition import CustomStepUnusedPartError
from dew.training.placement.mesh import BatchMismatchError


def batch_at(index, rows=8):
    x = np.random.default_rng(index).normal(size=(rows, 4)).astype(np.float32)
    return {"x": x, "y": x @ np.arange(1, 5, dtype=np.float32)[:, None] + 1}


class Numbered:
    """A resumable stream of batch_at(0), batch_at(1), ..."""

    def __init__(self, make=batch_at):
        self.index, self.make = 0, make

    def __iter__(self):
        return self

    def __next__(self):
        self.index += 1
        return self.make(self.index - 1)

    def get_state(self):
        return str(self.index).encode()

    def set_state(self, state):
        self.index = int(state)


def numbered(make=batch_at, val=None):
    return Dataset(train=lambda p: Numbered(make), val=val, batch=8)


Recorder = RecordingTracker


# -- rollouts ------------------------------------------------------------------------------



class Reusing:
    """A stateful rollout: one random sample, reused for k steps (like PPO's epochs)."""

    def __init__(self, k=3):
        self.k, self.used, self.sample = k, 0, None

    def __call__(self, state, batch, key):
        if self.sample is None or self.used == self.k:
            noise = np.asarray(jax.random.normal(key, (8, 1)), np.float32)
            self.sample, self.used = {"x": batch["x"], "y": batch["y"] + noise}, 0
        self.used += 1
        return self.sample

    def get_state(self):
        import pickle

        return pickle.dumps((self.used, self.sample))

    def set_state(self, state):
        import pickle

        self.used, self.sample = pickle.loads(state)


@pytest.mark.slow
def test_a_stateful_rollout_resumes_exactly_with_the_data_position(tmp_path):
    uninterrupted = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), rollout=Reusing())
    expected = jax.device_get(uninterrupted.fit(numbered(), steps=8, log_every=8).params)

    first = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), rollout=Reusing(),
                    checkpoints=Checkpoints(tmp_path))
    first.fit(numbered(), steps=4, log_every=4)  # step 4 is inside a reuse window (3..5)
    rollout = Reusing()
    second = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), rollout=rollout,
                     checkpoints=Checkpoints(tmp_path))
    final = second.fit(numbered(), steps=8, log_every=8)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(final.params), expected)

    # Restored without the rollout's state, the run would have drawn a new sample at once.
    fresh = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), rollout=Reusing(k=1_000),
                    checkpoints=Checkpoints(tmp_path / "other"))
    different = jax.device_get(fresh.fit(numbered(), steps=8, log_every=8).params)
    assert not np.array_equal(different["params"]["kernel"], expected["params"]["kernel"])


def test_a_rollout_that_changes_shape_is_refused_naming_the_key_and_both_shapes():
    def rollout(state, batch, key):
        rows = 8 if int(state.step) < 2 else 6
        return {"x": batch["x"][:rows], "y": batch["y"][:rows]}

    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), rollout=rollout)
    with pytest.raises(BatchMismatchError, match=r"step 2, batch key 'x' has shape \(6, 4\).*expects shape \(8, 4\)"):
        trainer.fit(numbered(), steps=4)


def test_rollout_time_is_its_own_row_of_the_goodput_split():
    import time

    def rollout(state, batch, key):
        time.sleep(0.05)
        return batch

    tracker = Recorder()
    Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), rollout=rollout, tracker=tracker).fit(
        numbered(), steps=4, log_every=4)
    goodput = next(v for _, v in tracker.artifacts if getattr(v, "type", "") == "goodput")
    assert goodput.rollout_seconds >= 0.2 and goodput.badput["rollout"] >= 0.2
    assert goodput.data_seconds < goodput.rollout_seconds


# -- a custom step --------------------------------------------------------------------------

def sgd_step(objective, optimizer):
    """A hand-written transaction: plain gradient descent on the params collection."""

    def step(state, batch):
        def total(params):
            loss, _ = objective.loss({**state.params, "params": params}, batch, None)
            return loss.total / loss.count

        loss, grads = jax.value_and_grad(total)(state.params["params"])
        params = jax.tree.map(lambda p, g: p - 0.1 * g, state.params["params"], grads)
        new = state.replace(params={**state.params, "params": params}, step=state.step + 1,
                            updates=state.updates + 1, microstep=state.microstep + 1)
        return new, {"loss": loss, "finite": jnp.isfinite(loss)}

    return step


def test_a_custom_step_that_leaves_the_step_counter_is_counted_by_the_trainer(tmp_path):
    """A transaction that moved no counter trained on with step 0: the same key at every step, a
    checkpoint labelled step 4 holding step 0, and a resume that trained every step again."""

    def forgetful(objective, optimizer):
        inner = sgd_step(objective, optimizer)

        def step(state, batch):
            new, metrics = inner(state, batch)
            return new.replace(step=state.step, microstep=state.microstep), metrics

        return step

    def trainer():
        return Trainer(Linear(), optax.identity(), key=jax.random.key(0), step=forgetful,
                       checkpoints=Checkpoints(tmp_path / "run"))

    first = trainer()
    state = first.fit(numbered(), steps=4, log_every=4, checkpoint_every=4)
    first.checkpoints.close()
    assert (int(state.step), int(state.microstep), int(state.updates)) == (4, 4, 4)
    again = trainer()
    restored, _, _ = again.place()
    assert int(restored.step) == 4  # the checkpoint labelled step 4 holds step 4
    assert int(again.fit(numbered(), steps=6, log_every=2).updates) == 6  # two more, not six
    again.checkpoints.close()


@pytest.mark.slow
def test_a_custom_step_composes_with_the_ema():
    objective = Linear(ema=EMASpec(decay=0.5))
    trainer = Trainer(objective, optax.identity(), key=jax.random.key(0), step=sgd_step)
    initial = jax.device_get(trainer.initial_state().params["params"])
    state = trainer.fit(numbered(), steps=3, log_every=3)

    params, ema = initial, initial
    for i in range(3):
        batch = batch_at(i)

        def loss(p, batch=batch):
            return jnp.mean((batch["x"] @ p["kernel"] + p["bias"][None, :] - batch["y"]) ** 2)

        grads = jax.grad(loss)(params)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        ema = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, ema, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
                 jax.device_get(state.params["params"]), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
                 jax.device_get(state.averaged["params"]), ema)


def optax_step(objective, optimizer, *, seen=None):
    """A hand-written transaction that differentiates the mean loss and updates through the optimizer it is
    handed; it moves the counters as if nothing were composed around it. seen, a list, receives the norm of
    the gradients it differentiated (before the optimizer), as a metric."""

    def step(state, batch):
        def total(trainable):
            loss, _ = objective.loss({**state.params, **trainable}, batch, None)
            return loss.total / loss.count

        trainable = {"params": state.params["params"]}
        loss, grads = jax.value_and_grad(total)(trainable)
        updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        new = state.replace(params={**state.params, **trainable}, opt_state=opt_state, step=state.step + 1,
                            updates=state.updates + 1, microstep=state.microstep + 1)
        return new, {"loss": loss, "seen": optax.global_norm(grads)}

    return step


def mean_loss(params, batch):
    return jnp.mean((batch["x"] @ params["kernel"] + params["bias"][None, :] - batch["y"]) ** 2)


@pytest.mark.slow
def test_a_custom_step_composes_with_accumulation_as_a_batch_that_many_times_larger():
    optimizer = optax.adam(0.1)
    trainer = Trainer(Linear(), optimizer, key=jax.random.key(0), step=optax_step, accumulation=2)
    initial = jax.device_get(trainer.initial_state().params["params"])
    state = trainer.fit(numbered(), steps=6, log_every=6)

    # By hand: three Adam updates, each on the mean gradient of two 8-row batches (a 16-row batch).
    params, opt_state = initial, optimizer.init(initial)
    for pair in range(3):
        both = {k: np.concatenate([batch_at(2 * pair)[k], batch_at(2 * pair + 1)[k]]) for k in ("x", "y")}
        grads = jax.grad(mean_loss)(params, both)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.device_get(state.params["params"]), params)
    assert (int(state.step), int(state.microstep), int(state.updates)) == (6, 6, 3)


@pytest.mark.slow
def test_a_custom_step_stopped_mid_window_resumes_bitwise(tmp_path):
    def run(directory, *stops):
        for steps in stops:
            trainer = Trainer(Linear(), optax.adam(0.1), key=jax.random.key(0), step=optax_step, accumulation=2,
                              dynamic_scale=True, checkpoints=Checkpoints(directory))
            state = trainer.fit(numbered(), steps=steps, log_every=steps, checkpoint_every=steps)
        return jax.device_get(state)

    whole, resumed = run(tmp_path / "whole", 5), run(tmp_path / "resumed", 3, 5)  # step 3 is half a window
    assert int(resumed.updates) == int(whole.updates) == 2
    jax.tree.map(np.testing.assert_array_equal, resumed, whole)


@pytest.mark.slow
def test_a_custom_step_composes_with_the_loss_scale():
    def poisoned(index):  # the second batch's loss is not finite
        batch = batch_at(index)
        return {**batch, "x": batch["x"] * np.float32("nan")} if index == 1 else batch

    tracker = Recorder()
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), step=optax_step, dynamic_scale=True,
                      tracker=tracker)
    initial = jax.device_get(trainer.initial_state().params["params"])
    state = trainer.fit(numbered(poisoned), steps=3, log_every=1)

    # By hand: SGD on batches 0 and 2; batch 1 is rejected whole and halves the scale.
    params, norms = initial, []
    for index in (0, 2):
        grads = jax.grad(mean_loss)(params, batch_at(index))
        norms.append(float(optax.global_norm(grads)))
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.device_get(state.params["params"]), params)
    assert (int(state.step), int(state.microstep), int(state.updates)) == (3, 2, 2)
    assert tracker.values("train/loss_scale") == [2.0**15, 2.0**14, 2.0**14]
    # The gradients the step differentiated carried the scale it ran under: the backward was scaled.
    seen = tracker.values("train/seen")
    np.testing.assert_allclose([seen[0] / 2.0**15, seen[2] / 2.0**14], norms, rtol=1e-5)


@pytest.mark.parametrize("settings, missing", [
    ({"accumulation": 2}, "never calls its update"),
    ({"dynamic_scale": True}, "never calls its update"),
])
def test_a_custom_step_that_bypasses_a_composed_part_is_refused_by_name(settings, missing):
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), step=sgd_step, **settings)
    with pytest.raises(CustomStepUnusedPartError, match=missing):
        trainer.fit(numbered(), steps=1, log_every=1)


def test_a_scaled_custom_step_that_never_reads_the_objectives_loss_is_refused():
    def own_loss(objective, optimizer):
        def step(state, batch):
            trainable = {"params": state.params["params"]}
            grads = jax.grad(lambda t: mean_loss(t["params"], batch))(trainable)
            updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
            return state.replace(opt_state=opt_state), {"loss": jnp.zeros(())}
        return step

    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), step=own_loss, dynamic_scale=True)
    with pytest.raises(CustomStepUnusedPartError, match="never calls objective.loss"):
        trainer.fit(numbered(), steps=1, log_every=1)


# -- evaluation -------------------------------------------------------------------------------

def test_evaluation_compiles_once_per_batch_shape_over_several_events():
    val = lambda partition: iter([batch_at(100), batch_at(101)])  # noqa: E731
    trainer = Trainer(Linear(ema=EMASpec(0.9)), optax.sgd(0.1), key=jax.random.key(0), tracker=Recorder())
    trainer.fit(numbered(val=val), steps=8, eval_every=2, log_every=4)
    events = [v for _, v in trainer.tracker.artifacts if getattr(v, "type", "") == "evaluation"]
    assert [e.step for e in events] == [2, 4, 6, 8]
    assert trainer._evaluator.traces == 1


# -- hooks ---------------------------------------------------------------------------------------

def test_a_step_end_hook_adds_scalars_and_can_stop_the_run(tmp_path):
    class Plugin:
        @hookimpl
        def dew_step_end(self, step, metrics):
            if step == 4:
                return StepContribution(scalars={"plugin/twice": 2 * metrics["train/loss"]}, stop=True,
                                        reason="the loss is low enough")
            return {"plugin/twice": 2 * metrics["train/loss"]}

    tracker = Recorder()
    checkpoints = Checkpoints(tmp_path)
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), tracker=tracker,
                      checkpoints=checkpoints)
    with registered(Plugin()):
        state = trainer.fit(numbered(), steps=50, log_every=2)
    logged = {step: scalars for step, scalars in tracker.rows if "train/loss" in scalars}
    assert sorted(logged) == [2, 4]
    for scalars in logged.values():
        assert scalars["plugin/twice"] == pytest.approx(2 * scalars["train/loss"])
    # The request is read one step late (the step after it was already dispatched): the run
    # stops there, saves that step and returns normally.
    assert int(state.step) == 5 and checkpoints.latest == 5


def test_a_fit_stopped_by_a_preemption_notice_records_where_its_time_went(tmp_path):
    """Only a fit that finished wrote its Goodput: a run stopped and resumed ten times reported the
    wall time of its last fit alone."""
    from dew.telemetry.records import Goodput
    from dew.training.runtime import Preempted, PreemptionNotice

    class StopAt:
        @hookimpl
        def dew_step_end(self, step):
            if step == 3:
                PreemptionNotice.send()

    tracker = Recorder()
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), tracker=tracker,
                      checkpoints=Checkpoints(tmp_path))
    with registered(StopAt()), pytest.raises(Preempted) as stopped:
        trainer.fit(numbered(), steps=50, log_every=1)
    goodput = [(step, value) for step, value in tracker.artifacts if isinstance(value, Goodput)]
    assert [step for step, _ in goodput] == [stopped.value.step]
    assert 0 < goodput[0][1].step_seconds < goodput[0][1].wall_seconds


def test_a_notice_after_the_last_step_was_checked_still_stops_with_its_status(tmp_path):
    """A Ctrl-C or SIGTERM during the final save or validation was dropped: the run returned as
    finished (exit 0) and printed its sample, though the person or scheduler had asked it to stop."""
    from dew.training.runtime import Preempted, PreemptionNotice

    class StopAtTheLast:
        @hookimpl
        def dew_step_end(self, step):
            if step == 4:  # the last step's metrics are read as the fit ends, after its check
                PreemptionNotice.send()

    checkpoints = Checkpoints(tmp_path)
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=checkpoints)
    with registered(StopAtTheLast()), pytest.raises(Preempted) as stopped:
        trainer.fit(numbered(), steps=4, log_every=1)
    assert stopped.value.step == 4 and stopped.value.status == 143 and checkpoints.latest == 4
    assert not PreemptionNotice.received()  # consumed by the stop


def test_a_notice_at_the_last_step_stops_after_its_final_validation(tmp_path):
    """Stopped at the run's own last step, the run raised before its final validation and preview,
    and a resume, with nothing left to train, never gave them."""
    from dew.training.runtime import Preempted, PreemptionNotice

    class StopAtTheLast:
        @hookimpl
        def dew_step_end(self, step):
            if step == 3:  # read while the last step, 4, is dispatched: its record meets the notice
                PreemptionNotice.send()

    val = lambda partition: iter([batch_at(100)])  # noqa: E731
    checkpoints, tracker = Checkpoints(tmp_path), Recorder()
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=checkpoints, tracker=tracker)
    with registered(StopAtTheLast()), pytest.raises(Preempted) as stopped:
        trainer.fit(numbered(val=val), steps=4, log_every=1)
    assert stopped.value.step == 4 and stopped.value.status == 143 and checkpoints.latest == 4
    events = [v for _, v in tracker.artifacts if getattr(v, "type", "") == "evaluation"]
    assert [e.step for e in events] == [4]
    assert not PreemptionNotice.received()


def test_an_evaluation_task_that_fails_at_the_last_step_keeps_that_steps_checkpoint(tmp_path):
    """Scheduled tasks ran before the save: one that failed at the last step (a bad task file, a
    model it cannot score) lost the step the run had just trained, and the folder kept only the one
    before it."""
    from dew.evaluations.base import Periodic

    class Fails:
        def evaluate(self, subject, *, mesh=None):
            raise RuntimeError("the task's own failure")

    checkpoints = Checkpoints(tmp_path)
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=checkpoints,
                      evaluations=[Periodic("fails", Fails(), None, None, None)])
    with pytest.raises(RuntimeError, match="the task's own failure"):
        trainer.fit(numbered(), steps=4, log_every=4, checkpoint_every=3)
    assert checkpoints.latest == 4


def test_each_save_note_names_the_store_it_was_written_to(tmp_path, capsys):
    checkpoints = Checkpoints(tmp_path / "shared", local_directory=tmp_path / "local", local_every=2)
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=checkpoints)
    trainer.fit(numbered(), steps=6, log_every=6, checkpoint_every=4)
    notes = [line for line in capsys.readouterr().out.splitlines() if "handed to the writer" in line]
    # step 2 is a local save; 4 (checkpoint_every) and 6 (the last) go to the shared store
    where = {int(line.split(":")[0].split()[1]): line.rsplit("(", 1)[1].rstrip(")") for line in notes}
    assert where == {2: str(tmp_path / "local" / "2"), 4: str(tmp_path / "shared" / "4"),
                     6: str(tmp_path / "shared" / "6")}, notes
    assert (tmp_path / "local" / "2").is_dir() and (tmp_path / "shared" / "4").is_dir()


# -- recipes keep checkpoint URLs ------------------------------------------------------------------


# -- batch edges -------------------------------------------------------------------------------------

def test_a_batch_with_an_extra_key_is_refused_at_its_step_naming_the_key():
    def extra(i):
        batch = batch_at(i)
        if i == 2:
            batch["mask"] = np.ones((8,), np.float32)
        return batch

    with pytest.raises(BatchMismatchError, match=r"step 2 has key\(s\) 'mask' that the first batch did not"):
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0)).fit(numbered(extra), steps=5)


def test_a_tuple_batch_is_refused_saying_what_a_batch_is():
    data = Dataset(train=lambda p: itertools.repeat((np.zeros((8, 4)), np.zeros((8, 1)))), batch=8)
    with pytest.raises(BatchMismatchError, match=r"gave step 0 a tuple, not a batch: a batch is a mapping"):
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0)).fit(data, steps=2)


def test_resuming_a_stream_that_cannot_report_its_position_warns(tmp_path):
    data = Dataset(train=lambda p: (batch_at(i) for i in itertools.count()), batch=8)
    Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path)).fit(data, steps=2)
    with pytest.warns(UserWarning, match=r"holds no data position.*restarts from its first record"):
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0),
                checkpoints=Checkpoints(tmp_path)).fit(data, steps=4)


def test_each_rejected_step_is_reported_at_its_step():
    def poisoned(i):
        batch = batch_at(i)
        if i == 3:
            batch["y"] = np.full_like(batch["y"], np.nan)
        return batch

    tracker = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), tracker=tracker).fit(
            numbered(poisoned), steps=8, log_every=8)
    assert [(s, v) for s, v in tracker.rows if "train/rejected_steps_in_a_row" in v] == [
        (4, {"train/rejected_steps_in_a_row": 1.0})]


# -- exit paths ----------------------------------------------------------------------------------------

def test_a_program_that_exits_right_after_fit_keeps_its_final_checkpoint(python_in_subprocess, tmp_path):
    python_in_subprocess(f"""
        import jax, optax, sys
        sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})
        from test_core_feed_hooks import Linear, numbered
        from dew import Checkpoints, Trainer
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0),
                checkpoints=Checkpoints({str(tmp_path)!r})).fit(numbered(), steps=6, checkpoint_every=3)
    """)
    assert Checkpoints(tmp_path).latest == 6


@pytest.mark.slow
def test_a_failing_fit_finishes_the_checkpoint_it_had_started(python_in_subprocess, tmp_path):
    result = python_in_subprocess(f"""
        import jax, optax, sys
        sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})
        from test_core_feed_hooks import Linear, numbered, batch_at
        from dew import Checkpoints, Trainer
        def broken(i):
            if i == 3:
                raise OSError("the data disk went away")
            return batch_at(i)
        try:
            Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0),
                    checkpoints=Checkpoints({str(tmp_path)!r})).fit(numbered(broken), steps=6, checkpoint_every=3)
        except OSError as error:
            print("raised", error)
    """)
    assert "raised the data disk went away" in result
    assert Checkpoints(tmp_path).latest == 3


def test_a_streak_of_rejected_steps_stops_the_run_without_waiting_for_a_log_step():
    from dew.training.trainer import NonFiniteLossError

    drawn = []

    def poisoned(i):
        drawn.append(i)
        batch = batch_at(i)
        if i >= 3:
            batch["y"] = np.full_like(batch["y"], np.nan)
        return batch

    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(NonFiniteLossError, match=r"Step 8 was the 5th step in a row"):
        trainer.fit(numbered(poisoned), steps=2000, log_every=1000)
    assert len(drawn) < 40, len(drawn)  # before: every batch up to the log step at 1000


def test_between_log_steps_the_loop_reads_each_steps_verdict_alone_eight_steps_at_a_time(monkeypatch):
    """On a CPU the loop's own reads take time from the step: between log steps it reads only whether
    each step was accepted, and reads them in groups, not one read of every metric per step."""
    reads: list[list[set[str]]] = []
    real = jax.device_get

    def counting(tree):
        if isinstance(tree, list) and tree and all(isinstance(item, dict) for item in tree):
            reads.append([set(item) for item in tree])  # the steps' metrics Progress reads
        return real(tree)

    monkeypatch.setattr(jax, "device_get", counting)
    Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0)).fit(numbered(), steps=41, log_every=41)
    *between, last = reads
    assert between, "no step was read before the end"
    assert all(len(read) >= 8 for read in between)  # each read takes a group of steps
    assert all(keys == {"finite"} for read in between for keys in read)  # only the verdicts
    assert {"finite", "loss"} <= last[-1]  # the logged last step: every metric
    assert sum(len(read) for read in reads) == 41


def test_the_logged_learning_rate_is_the_one_each_update_applied():
    """optax reads the schedule at the update count before an update; train/lr read it at the
    count after, one update ahead: a warmup's first rate (0) was never logged."""
    from dew.training.optim import OptimizerConfig, build_optimizer

    optimizer = build_optimizer(OptimizerConfig(solver="sgd", learning_rate=0.3, warmup_steps=3))
    tracker = Recorder()
    trainer = Trainer(Linear(), optimizer, key=jax.random.key(0), tracker=tracker)
    start = trainer.initial_state()
    first = trainer.fit(numbered(), steps=1, log_every=1)
    assert tracker.values("train/lr") == [0.0]  # and the first update indeed moved nothing
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start.params), jax.tree.leaves(first.params),
                                                  strict=True))
    tracker = Recorder()
    Trainer(Linear(), optimizer, key=jax.random.key(0), tracker=tracker).fit(numbered(), steps=4, log_every=1)
    np.testing.assert_allclose(tracker.values("train/lr"), [0.0, 0.1, 0.2, 0.3], rtol=1e-6)


@pytest.mark.parametrize("arguments, said", [
    ({"steps": -2}, "steps is the step count to train to, at least 0; got -2"),
    ({"steps": 5, "checkpoint_every": 0}, "checkpoint_every must be at least 1 (None turns it off), got 0"),
    ({"steps": 5, "eval_every": 0}, "eval_every must be at least 1 (None turns it off), got 0"),
    ({"steps": 5, "log_every": 0}, "log_every must be at least 1, got 0"),
])
def test_fit_refuses_a_negative_step_count_and_an_interval_below_one(arguments, said):
    """A recipe's Cadence refuses these; fit ran an interval of 0 as "never" and returned at once
    for a negative step count."""
    from dew.training.cadence import CadenceError

    with pytest.raises(CadenceError, match=re.escape(said)):
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0)).fit(numbered(), **arguments)


def test_the_first_steps_rollout_is_counted_once_in_the_goodput():
    """The first step's time holds its rollout, which the rollout total holds too: a run whose time
    went to its rollouts (GRPO's) reported 0.0% of its wall time in steps, the subtraction clamped."""
    import time

    def rollout(state, batch, key):
        time.sleep(0.3)
        return batch

    tracker = Recorder()
    Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), rollout=rollout, tracker=tracker).fit(
        numbered(), steps=4, log_every=4)
    goodput = next(v for _, v in tracker.artifacts if getattr(v, "type", "") == "goodput")
    assert goodput.rollout_seconds >= 1.2 and goodput.first_step_seconds >= 0.3
    later = goodput.wall_seconds - goodput.first_step_seconds  # steps 2 to 4: three rollouts and the steps
    assert 0.0 < goodput.step_seconds <= later - 0.9 + 1e-3, goodput


# -- arguments of the wrong type -----------------------------------------------------------------

def test_arguments_of_the_wrong_type_are_named_when_the_trainer_is_built(tmp_path):
    """They surfaced deep in fit: a string key as a JAX error about an abstract array, a string
    tracker as an AttributeError after the first step had compiled and run."""
    from flax import linen as nn

    from dew.training.arguments import TrainerArgumentError

    key = jax.random.key(0)
    cases = {"key": dict(key="abc"), "key ": dict(key=0), "objective": dict(objective=nn.Dense(1)),
             "optimizer": dict(optimizer="adam"), "checkpoints": dict(checkpoints=str(tmp_path)),
             "tracker": dict(tracker=str(tmp_path)),
             # an AttributeError, a TypeError deep in fit, or (a truthy string) loss scaling turned on
             "mesh": dict(mesh={"fsdp": 1}), "layout": dict(layout=None), "profile": dict(profile="dir"),
             "accumulation": dict(accumulation="2"), "accumulation ": dict(accumulation=0),
             "dynamic_scale": dict(dynamic_scale="no"),
             # a batch of keys passed, then failed in fit with JAX's "split accepts a single key"
             "key  ": dict(key=jax.random.split(key, 2))}
    for name, given in cases.items():
        arguments = {"objective": Linear(), "optimizer": optax.sgd(0.1), "key": key, **given}
        objective, optimizer = arguments.pop("objective"), arguments.pop("optimizer")
        with pytest.raises(TrainerArgumentError, match=rf"^Trainer's {name.strip()} must (be|have) .*; got "):
            Trainer(objective, optimizer, **arguments)
    # a legacy uint32 key is still taken, as JAX's own functions take it
    Trainer(Linear(), optax.sgd(0.1), key=jax.random.PRNGKey(0)).fit(numbered(), steps=1, log_every=1)


def test_fit_names_data_that_is_not_a_dataset_and_a_count_that_is_not_whole():
    from dew.training.arguments import TrainerArgumentError
    from dew.training.cadence import CadenceError

    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(TrainerArgumentError, match=r"fit's data must be a dew.data.Dataset; got list .*"
                                                   r"Dataset\(train=lambda partition"):
        trainer.fit([batch_at(0)], steps=1)
    for given, said in ((dict(steps="10"), "steps must be a whole number, got str '10'"),
                        (dict(steps=10.7), "steps must be a whole number, got float 10.7"),
                        (dict(steps=None), "steps must be a whole number, got NoneType None"),
                        (dict(steps=2, log_every="5"), "log_every must be a whole number, got str '5'")):
        with pytest.raises(CadenceError, match=re.escape(said)):
            trainer.fit(numbered(), **given)
    assert int(trainer.fit(numbered(), steps=np.int64(2), log_every=1).step) == 2  # NumPy's whole numbers are


def test_a_loss_reading_a_key_the_batch_lacks_and_an_objective_without_its_methods_are_dew_errors(capsys):
    """Without required_keys() the trace met a bare KeyError ('y'), and an objective without loss or init
    a NotImplementedError: neither a DewError, so dew train printed a traceback. A KeyError of the
    loss's own (a dict it builds, in an objective whose required_keys() the feed checked) is left as
    it is. fit(steps=0) without checkpoints spoke of
    checkpoints that hold step 0."""
    from dew.errors import BatchKeyError, DewError, ObjectiveMethodError
    from dew.objectives.base import Aux, Mean, Objective

    def no_y(i):
        return {"x": batch_at(i)["x"]}

    class Undeclared(Linear):  # the loss reads x and y, and required_keys() names neither
        def required_keys(self):
            return ()

    with pytest.raises(BatchKeyError, match=r"Undeclared.loss raised KeyError 'y', a key the batch does not hold "
                                            r"\(it holds \['x'\]\)") as missing:
        Trainer(Undeclared(), optax.sgd(0.1), key=jax.random.key(0)).fit(Dataset(train=lambda p: iter(
            no_y(i) for i in range(10**6)), batch=8), steps=1)
    assert isinstance(missing.value, KeyError) and isinstance(missing.value, DewError)

    class OwnKeyError(Linear):  # its required keys are checked by the feed: a KeyError is its own
        def loss(self, variables, batch, step):
            return {"a": 1}["b"]

    with pytest.raises(KeyError, match="'b'") as own:
        Trainer(OwnKeyError(), optax.sgd(0.1), key=jax.random.key(0)).fit(numbered(), steps=1)
    assert not isinstance(own.value, DewError)

    class NoLoss(Objective):
        def init(self, key, variables=None):
            return Linear().init(key)

    class NoInit(Objective):
        def loss(self, variables, batch, step):
            return Mean(jnp.float32(0), jnp.float32(1)), Aux()

    for objective, said in ((NoLoss(), "NoLoss must implement loss"), (NoInit(), "NoInit must implement init")):
        with pytest.raises(ObjectiveMethodError, match=said) as unimplemented:
            Trainer(objective, optax.sgd(0.1), key=jax.random.key(0)).fit(numbered(), steps=1)
        assert isinstance(unimplemented.value, NotImplementedError)
    Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0)).fit(numbered(), steps=0)
    out = capsys.readouterr()
    assert "steps=0: nothing to train" in out.out + out.err and "checkpoints already hold" not in out.out + out.err


def test_a_stream_that_runs_out_is_a_dew_error_naming_its_step():
    """A finite generator ended fit with a plain RuntimeError, where every refusal is a DewError."""
    from dew.errors import DewError
    from dew.training.feed import StreamEndedError

    finite = Dataset(train=lambda partition: iter([batch_at(i) for i in range(3)]), batch=batch_at(0)["x"].shape[0])
    with pytest.raises(StreamEndedError, match="ended at step 3; Dataset.train must yield batches endlessly") as ended:
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0)).fit(finite, steps=6, log_every=1)
    assert isinstance(ended.value, DewError)


def test_a_fit_lets_go_of_the_checkpoint_writer_when_it_ends(tmp_path):
    """A program that keeps its Trainers (a notebook's variables) held one Orbax thread and the
    directory's lease per finished fit until it ended: a `dew train --resume` in a terminal was
    refused the folder for as long as the notebook lived."""
    import threading

    from dew.checkpoints import lease

    kept = []
    for steps in (2, 4, 6):
        trainer = Trainer(Linear(), optax.sgd(0.05), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path))
        trainer.fit(numbered(), steps=steps, log_every=2)
        kept.append(trainer)
        assert not (tmp_path / lease.LEASE).exists()
        assert not [thread.name for thread in threading.enumerate() if thread.name.startswith("metadata_store")]
    assert kept[-1].checkpoints.latest == 6 and kept[0].checkpoints.latest == 6  # each fit resumed the last


def test_a_step_compiled_without_a_persistent_cache_says_how_to_keep_it(python_in_subprocess, tmp_path):
    """A notebook's fits compiled the same step afresh each time (3-6 s) without a word: the Python
    API keeps no compiled program unless asked, where `dew train` keeps them by default."""
    code = """
        import jax, optax
        from dew import Trainer
        from dew.testing.doubles import Regression, regression_dataset
        Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0)).fit(regression_dataset(), steps=1, log_every=1)
    """
    bare = python_in_subprocess(code, env={"JAX_COMPILATION_CACHE_DIR": ""})
    assert ("(not kept: a recipe's trainer.compilation_cache_dir, or prepare_process, keeps compiled programs "
            "for the next run)") in bare, bare
    kept = python_in_subprocess(code, compilation_cache=tmp_path / "cache")
    assert "compiling the step for batches of" in kept and "not kept" not in kept, kept


# -- a notebook's Trainer, fit again after a failure ------------------------------------------


def test_a_fit_that_fails_before_its_first_step_lets_go_of_the_checkpoint_directory(tmp_path):
    """The lease was given back only by the loop's Saving hook: a fit whose data failed to open kept
    the directory leased for as long as its Trainer lived, refusing every other process."""
    def missing(partition):
        raise FileNotFoundError("no such shard")

    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such shard"):
        trainer.fit(Dataset(train=missing, batch=8), steps=4, log_every=2)
    assert not trainer.checkpoints.writing
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dew-writer")]  # no lease file left
    state = trainer.fit(numbered(), steps=4, log_every=2)  # and the same Trainer trains there after
    assert int(state.step) == 4 and not trainer.checkpoints.writing


def test_a_failed_fit_reports_every_step_that_ran_before_it_failed():
    """Progress reads a step's metrics one step late: the last step before the failure was not logged,
    so the loss just before a crash was the one value a user debugging it could not see."""
    def failing(index):
        if index == 4:
            raise RuntimeError("the fifth batch is unreadable")
        return batch_at(index)

    recorder = Recorder()
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), tracker=recorder)
    with pytest.raises(RuntimeError, match="fifth batch"):
        trainer.fit(numbered(failing), steps=10, log_every=1)
    assert [step for step, _ in recorder.rows] == [1, 2, 3, 4]


def test_a_fit_its_checkpoints_already_reach_says_it_trains_nothing(tmp_path, capsys):
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path))
    trainer.fit(numbered(), steps=6, log_every=3)
    capsys.readouterr()
    state = trainer.fit(numbered(), steps=4, log_every=2)
    assert int(state.step) == 6
    out = capsys.readouterr().out
    assert "already hold step 6, at or past steps=4: nothing to train" in out, out
