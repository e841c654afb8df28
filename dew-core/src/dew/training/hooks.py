"""What a fit does between steps, one hook per concern, each with its cadence.

A hook sees every ``StepRecord`` (dew.training.loop), does what its cadence
makes due and returns a ``Contribution``: lines for the console, records
and evaluations for the trackers, seconds for the goodput clock, a
checkpoint handed to the writer, or a reason to stop. ``ProgressHook`` (the
``Progress`` of the fit, owning its clock) is the hook the others report
through; it asks the run to stop when a plugin does. The others: validation
and scheduled evaluation tasks, saves (with local saves), a profile window,
and the preemption watch.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax

from dew.checkpoints.pool import pooled
from dew.data.base import Dataset
from dew.objectives.base import Metric
from dew.telemetry.hardware import peak_flops
from dew.telemetry.records import Goodput
from dew.tracking.progress import Progress
from dew.tracking.protocol import Located, Reported
from dew.training.evaluation import Evaluation, Evaluator, OutputMeans
from dew.training.execution import Execution
from dew.training.feed import Feed
from dew.training.loop import Compilation, StepRecord
from dew.training.runtime.preemption import (
    Preempted,
    PreemptionNotice,
    PreemptionWatch,
    UnsavedStopError,
)
from dew.training.state import TrainState

if TYPE_CHECKING:
    from dew.checkpoints.manager import Checkpoints
    from dew.evaluations.base import Periodic
    from dew.training.profiling import ProfileSchedule, ProfileWindow
    from dew.training.trainer import Trainer

__all__ = ["Contribution", "Evaluating", "Hook", "Preemption", "Profiling", "ProgressHook", "Saving", "Scoring",
           "at_target", "opening_notes"]


@dataclass(frozen=True)
class Contribution:
    """What a hook adds to a step: reported by ``ProgressHook``, in this order."""

    notes: tuple[str, ...] = ()
    records: tuple[Reported, ...] = ()  # tracker artifacts (a profile window's record)
    evaluations: tuple[Evaluation, ...] = ()  # logged and handed to plugins
    eval_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    checkpoint: str | None = None  # the path of a checkpoint handed to the writer
    stop: str | None = None  # why the run should stop after this step


class Hook:
    """One concern of the loop; every method may return nothing."""

    def open(self) -> None:
        """The fit is about to dispatch its first step."""

    def after(self, record: StepRecord) -> Contribution | None:
        """Step record.done was dispatched."""
        return None

    def end(self, done: int, state: TrainState) -> Contribution | None:
        """The loop ended at step done (its last, or a stop) with state: finish what is under way."""
        return None

    def fail(self, error: BaseException) -> None:
        """The fit is failing with error (Preempted included)."""

    def close(self) -> None:
        """Release what open took; called however the fit ends."""


def opening_notes(steps: int, log_every: int, every: int, checkpoints: Checkpoints | None,
                  tracker: object) -> list[str]:
    """The console lines a fit opens with: a shortened log interval, where it saves and tracks."""
    notes = [f"log_every={log_every} is more than the run's {steps} steps: logging every {every} "
             f"step{'s' if every > 1 else ''} instead (and the last)"] if every != log_every else []
    notes += [f"checkpoints: {checkpoints.directory}"] if checkpoints is not None else [
        "no checkpoints: a preemption notice (SIGTERM) stops this run without saving it (exit 143); "
        "set a recipe's trainer.checkpoint_dir (or give the Trainer checkpoints=Checkpoints(directory)) to make "
        "a stop resumable"]
    return notes + [f"tracking: {where}" for where in (tracker.directories() if isinstance(tracker, Located) else ())]


def at_target(progress: Progress, state: TrainState, start: int, steps: int, *, said: bool) -> TrainState:
    """The state of a fit whose checkpoints already reach its steps (or asked for none), which trains
    nothing: it says so, unless a recipe's run has (with the command that trains further:
    dew.recipes.resuming)."""
    if start == 0:  # steps=0 on a fresh state: no checkpoint holds anything
        progress.note("steps=0: nothing to train (fit trains until the step counter reaches steps); give steps "
                      "above 0 to train.")
    elif not said:
        progress.note(f"The checkpoints already hold step {start}, at or past steps={steps}: nothing to train. "
                      f"Fit with steps above {start} to train further, or give the Trainer another "
                      "checkpoint directory to start afresh.")
    return state


def _every(done: int, every: int | None) -> bool:
    return bool(every) and done % every == 0  # type: ignore[operator]  # every is an int when truthy


class ProgressHook(Hook):
    """The fit's Progress as a hook: it reads step metrics one step late and reports contributions."""

    def __init__(self, progress: Progress, trainer: Trainer, feed: Feed, *, start: int, steps: int,
                 notes: Sequence[str]) -> None:
        self.progress, self.trainer, self.feed = progress, trainer, feed
        self.start, self.steps, self.notes = start, steps, tuple(notes)
        self.failed = False
        self.last: tuple[int, TrainState] | None = None
        self.within_first = 0.0  # the stream's seconds (data, rollout, reward) before the first step ended

    def open(self) -> None:
        checkpoints = self.trainer.checkpoints
        self.progress.start(self.trainer, self.start, self.steps, self.trainer.device_mesh.shape,
                            recipe=self.trainer.recipe,
                            folder=None if checkpoints is None else str(checkpoints.directory))
        for line in self.notes:
            self.progress.note(line)

    def after(self, record: StepRecord) -> Contribution | None:
        if record.compiled is not None:
            self._compiled(record.compiled)
        self.progress.stepped(record.done, record.metrics, first=record.first)
        if record.first:  # the first step's time holds these already: the Goodput counts them once
            clock = self.feed.clock
            self.within_first = clock.data + clock.rollout + clock.reward
        self.last = record.done, record.state
        stop = self.progress.stop_requested
        return None if stop is None else Contribution(stop=stop)

    def _compiled(self, compiled: Compilation) -> None:
        self.progress.compiled(compiled.seconds, at=compiled.at)
        kept = bool(jax.config.jax_compilation_cache_dir)  # type: ignore[attr-defined]  # a flag jax.config holds, undeclared
        self.progress.note(f"compiling the step for batches of {compiled.rows} rows: {compiled.seconds:.2f} s"
                           + ("" if kept else " (not kept: a recipe's trainer.compilation_cache_dir, or "
                              "prepare_process, keeps compiled programs for the next run)"))
        device = next(iter(self.trainer.device_mesh.devices.flat))
        self.progress.measure(records=compiled.rows, tokens=compiled.tokens, flops=compiled.flops,
                              peak_flops=peak_flops(device.device_kind))

    def take(self, contribution: Contribution | None, done: int) -> str | None:
        """Report what a hook contributed at step done; return its reason to stop, if it gave one."""
        if contribution is None:
            return None
        progress = self.progress
        for line in contribution.notes:
            progress.note(line)
        for item in contribution.records:
            progress.record(item, done)
        progress.clock.eval += contribution.eval_seconds
        progress.clock.checkpoint += contribution.checkpoint_seconds
        for result in contribution.evaluations:
            progress.evaluation(result, done)
        if contribution.checkpoint is not None:
            progress.checkpoint(done, contribution.checkpoint)
        return contribution.stop

    def note(self, line: str) -> None:
        self.progress.note(line)

    def end(self, done: int, state: TrainState) -> Contribution | None:
        self.progress.drain()
        self.progress.check_weights(done, state.params)  # a run without checkpoints: said at its end
        return None

    def fail(self, error: BaseException) -> None:
        self.failed = True
        with contextlib.suppress(Exception):  # the steps that ran are reported: the loss before the failure
            self.progress.drain()
        if isinstance(error, Preempted) and self.last is not None:  # a stop on request, saved: its time
            self.progress.record(self._goodput(), self.last[0])     # counts toward the run's as a fit's does
        self.progress.close()

    def close(self) -> None:
        if self.failed or self.last is None:
            return
        done, state = self.last
        self.progress.finish(done, state, self._goodput())

    def _goodput(self) -> Goodput:
        clock = self.feed.clock
        return self.progress.clock.goodput(clock.data, clock.rollout, clock.reward, within_first=self.within_first)


class Profiling(Hook):
    """A profile window: opened after its warmup, its record reported when it closes."""

    def __init__(self, window: ProfileWindow, start: int) -> None:
        self.window, self.start = window, start
        self.schedule: ProfileSchedule | None = None

    def open(self) -> None:
        self.schedule = self.window.schedule(self.start)
        self.schedule.on_step(self.start)  # a window without warmup opens before the first step

    def after(self, record: StepRecord) -> Contribution | None:
        assert self.schedule is not None
        window = self.schedule.on_step(record.done, record.state)
        return None if window is None else Contribution(records=(window,))

    def close(self) -> None:
        if self.schedule is not None:
            self.schedule.close()


class Evaluating(Hook):
    """Validation every eval_every steps, and once at the end (with the preview) when there is any."""

    def __init__(self, evaluator: Evaluator, execution: Execution, dataset: Dataset, *, every: int | None,
                 metrics: Sequence[Metric], preview: bool, tracked: bool) -> None:
        self.evaluator, self.execution, self.dataset = evaluator, execution, dataset
        self.every, self.metrics, self.preview = every, tuple(metrics) or (OutputMeans(),), preview
        self.writes_preview = preview and tracked  # a preview is written only where a tracker keeps it

    def after(self, record: StepRecord) -> Contribution | None:
        return self._evaluate(record.done, record.state) if _every(record.done, self.every) and not record.last \
            else None

    def end(self, done: int, state: TrainState) -> Contribution | None:
        return self._evaluate(done, state)  # the last step's scores and preview

    def _evaluate(self, done: int, state: TrainState) -> Contribution | None:
        if self.dataset.val is None and not self.preview:
            return None
        began = time.perf_counter()
        variables, averaged = self.execution.readable(state)
        result = self.evaluator(
            variables, self.dataset.val, key=state.rng, metrics=self.metrics, step=done,
            averaged=averaged, preview=self.writes_preview, schedule_step=int(jax.device_get(state.updates)),
        )
        return Contribution(evaluations=(result,), eval_seconds=time.perf_counter() - began)


class Scoring(Hook):
    """The scheduled evaluation tasks (dew.evaluations.Periodic), each on its own cadence."""

    def __init__(self, tasks: Sequence[Periodic], execution: Execution) -> None:
        self.tasks, self.execution = tuple(tasks), execution

    def after(self, record: StepRecord) -> Contribution | None:
        due = [task for task in self.tasks if task.due(record.done, record.last)]
        if not due:
            return None
        began = time.perf_counter()
        variables = self.execution.readable(record.state)[0]
        results = tuple(task(variables, mesh=self.execution.mesh, step=record.done) for task in due)
        return Contribution(evaluations=results, eval_seconds=time.perf_counter() - began)


class Saving(Hook):
    """Checkpoints every checkpoint_every steps and at the last, local ones every local_every.

    Before each, the fit's reports up to its step are written (settle), so a resume from it
    leaves no gap in the trackers.
    """

    def __init__(self, checkpoints: Checkpoints, feed: Feed, meta: dict[str, object], *, every: int | None,
                 settle: Callable[[int, object], None] = lambda done, weights: None) -> None:
        self.checkpoints, self.feed, self.meta, self.every = checkpoints, feed, meta, every
        self.settle = settle
        self.saved: int | None = None
        self.failed = False

    def after(self, record: StepRecord) -> Contribution | None:
        if record.first:
            self.checkpoints.prepare(record.state)  # compiles the leaf digests off the loop
        if record.last or _every(record.done, self.every):
            return self.save(record)
        if _every(record.done, self.checkpoints.local_every):
            return self.save(record, local=True)
        return None

    def save(self, record: StepRecord, *, local: bool = False) -> Contribution:
        # The steps already dispatched finish first: their time is the steps' (the loop runs
        # ahead of the device by up to log_every steps), not the checkpoint's.
        began = time.perf_counter()
        jax.block_until_ready(record.state)
        in_flight = time.perf_counter() - began
        self.settle(record.done, record.state.params)
        began = time.perf_counter()
        self.checkpoints.save(record.done, record.state, position=self.feed.position(),
                              partition=self.feed.partition, meta=self.meta, local=local)
        blocked = time.perf_counter() - began
        if not local:
            self.saved = record.done
        path = str(self.checkpoints.path(record.done, local=local))
        return Contribution(
            notes=(f"step {record.done}: checkpoint {'(local) ' if local else ''}handed to the writer, "
                   f"the loop blocked {blocked:.2f} s, after {in_flight:.2f} s finishing the "
                   f"steps in flight ({path})",),
            checkpoint_seconds=blocked, checkpoint=path)

    def end(self, done: int, state: TrainState) -> Contribution:
        """Wait for the writes under way, so a program that exits after fit loses no step."""
        began = time.perf_counter()
        self.checkpoints.wait()
        return Contribution(checkpoint_seconds=time.perf_counter() - began)

    def fail(self, error: BaseException) -> None:
        """On a failing fit, finish the checkpoint already handed to the writer, and say so; in a
        pool, let it go (its commit is a collective the other processes may never reach)."""
        self.failed = True
        if isinstance(error, Preempted):
            return
        if pooled():
            abandoned = self.checkpoints.abandon()
            if abandoned is not None:
                error.add_note(f"dew: the checkpoint of step {abandoned} was still being written when this "
                               "process failed, and was abandoned (the pool's other processes cannot "
                               "finish it with this one); the previous committed step is kept.")
            return
        try:
            self.checkpoints.wait()
        except Exception as failure:  # noqa: BLE001 - the fit's own error is the one to raise
            error.add_note(f"dew: the checkpoint being written when the fit failed was not completed "
                           f"({failure}); the previous committed step is kept.")
            print(f"dew: fit failed; the checkpoint under way was abandoned ({failure})",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        """Let go of the writer however the fit ended (Orbax's threads, the directory's lease): a
        program that keeps its Trainer (a notebook) holds neither between fits, and the next fit
        takes them again. A failed fit's own error stays the one raised."""
        if not self.failed:
            self.checkpoints.close()
            return
        with contextlib.suppress(Exception):
            self.checkpoints.close()


class Preemption(Hook):
    """A preemption notice (SIGTERM) stops the run at the next step, saved: Preempted is raised."""

    def __init__(self, reporting: ProgressHook, saving: Saving | None) -> None:
        self.reporting, self.saving = reporting, saving
        self.watch: PreemptionWatch | None = None
        self.at_the_last = False  # a notice met at the run's own last step, saved: it stops as the fit ends

    def open(self) -> None:
        self.watch = PreemptionWatch(say=self.reporting.progress.note).__enter__()

    def after(self, record: StepRecord) -> Contribution | None:
        assert self.watch is not None
        done, saving = record.done, self.saving
        if not self.watch.reached(done):
            return None
        progress = self.reporting.progress
        progress.note(self.watch.stopping(done, saving=saving is not None and saving.saved != done))
        progress.drain()
        if saving is None:
            raise UnsavedStopError(done, status=self.watch.status)
        if saving.saved != done:
            self.reporting.take(saving.save(record), done)
        self.reporting.take(saving.end(done, record.state), done)
        if record.last and record.stop is None:
            # The run's own last step, committed: its final validation and preview still run (a
            # resume finds nothing left to train and would never give them), then end() stops.
            self.at_the_last = True
            return None
        progress.fire("dew_preempted", step=done)
        raise Preempted(done, status=self.watch.status)

    def end(self, done: int, state: TrainState) -> Contribution | None:
        """A notice met at the last step, or one that came after it was checked (in the final save
        or validation): the run is whole and saved, and still stops with the status the notice asks
        for, so the scheduler (or the person who pressed Ctrl-C) sees the stop rather than a finish."""
        if not self.at_the_last and (self.saving is None or not PreemptionNotice.received()):
            return None  # a pool's notice stops at a step
        self.reporting.progress.fire("dew_preempted", step=done)
        assert self.watch is not None
        raise Preempted(done, status=self.watch.status)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.__exit__(None, None, None)
            self.watch = None
