"""The body of Trainer.fit: one pass from the restored step to the target step.

Per step the host takes a batch, shards it and dispatches the compiled
step. It reads metrics only at log steps, one step late (after the next
step is dispatched), so the device queue never drains otherwise. Evaluation,
checkpoints and a preemption notice are checked between steps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from dew import plugins
from dew.data.base import Dataset
from dew.objectives.base import Metric
from dew.telemetry.records import Goodput, RunStarted
from dew.training.console import Console
from dew.training.evaluation import Evaluation, OutputMeans, evaluate
from dew.training.mesh import check_batch, data_partition, global_shape
from dew.training.runtime.preemption import Preempted, PreemptionWatch
from dew.training.state import TrainState
from dew.training.trainer import NonFiniteLossError, nonfinite_limit

__all__ = ["Loop"]


@dataclass
class _Clock:
    """Where the fit's wall time goes (seconds), for the Goodput record."""

    started: float = field(default_factory=time.perf_counter)
    first_step: float = 0.0
    compile: float = 0.0
    data: float = 0.0
    checkpoint: float = 0.0
    eval: float = 0.0

    def goodput(self) -> Goodput:
        wall = time.perf_counter() - self.started
        overhead = self.first_step + self.data + self.checkpoint + self.eval
        return Goodput(
            first_step_seconds=self.first_step, wall_seconds=wall,
            step_seconds=max(0.0, wall - overhead), compile_seconds=self.compile,
            data_seconds=self.data, checkpoint_seconds=self.checkpoint, eval_seconds=self.eval,
        )


class Loop:
    """One fit: holds the state, the stream and the pending metrics between steps."""

    def __init__(self, trainer: Any, dataset: Dataset, *, steps: int, log_every: int,
                 eval_every: int | None, checkpoint_every: int | None,
                 metrics: tuple[Metric, ...], preview: bool) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be at least 1, got {log_every}.")
        self.trainer = trainer
        self.dataset = dataset
        self.steps = int(steps)
        self.log_every = log_every
        self.eval_every = eval_every
        self.checkpoint_every = checkpoint_every
        self.metrics = metrics
        self.preview = preview
        self.clock = _Clock()
        self.rank0 = jax.process_index() == 0
        self.console = Console() if self.rank0 else None
        self.hooks = plugins.hook()
        self.pending: list[tuple[int, dict, bool]] = []  # (step, device metrics, to be logged)
        self.last_log: tuple[float, int] | None = None  # (time, step) of the last log line
        self.last_saved: int | None = None
        self.rejected_streak = 0
        self.compiled: dict[int, tuple[Any, dict]] = {}  # global rows -> (step, batch shapes)
        schedule = getattr(dataset.train, "schedule", None) or ()
        self.ramp_sizes = {int(size) for _, size in schedule}

    # -- entry -------------------------------------------------------------------
    def run(self) -> TrainState:
        trainer = self.trainer
        mesh = trainer.device_mesh
        self.partition = data_partition(mesh)
        state, _, position = trainer.place()
        start = int(jax.device_get(state.step))
        if start >= self.steps:
            return state
        processes = jax.process_count()
        if self.console is not None:
            self.console.start(start, self.steps, dict(mesh.shape), processes)
        self._report(RunStarted(config={}, start=start, steps=self.steps, mesh=dict(mesh.shape),
                                processes=processes), start)
        self.hooks.dew_run_start(trainer=trainer, start=start, steps=self.steps)
        self.stream = trainer.open_stream(self.dataset, self.partition, position)
        profile = trainer.profile.schedule(start) if trainer.profile is not None else None
        if profile is not None:
            profile.on_step(start)  # a window without warmup opens before the first step
        try:
            with PreemptionWatch() as watch:
                state = self._steps(state, start, watch, profile)
        finally:
            close = getattr(self.stream, "close", None)
            if callable(close):
                close()
            if profile is not None:
                profile.close()
        goodput = self.clock.goodput()
        self._report(goodput, self.steps)
        if self.console is not None:
            self.console.finish(goodput)
            self.console.close()
        self.hooks.dew_run_end(step=self.steps, state=state)
        return state

    def _steps(self, state: TrainState, start: int, watch: PreemptionWatch, profile: Any) -> TrainState:
        trainer = self.trainer
        for step in range(start, self.steps):
            batch = self._next_batch(state, step)
            compiled, sharded = self._compiled_for(state, batch)
            state, metrics = compiled(state, sharded)
            done = step + 1
            if step == start:
                jax.block_until_ready(metrics)
                self.clock.first_step = time.perf_counter() - self.clock.started
            self._flush(done)  # the previous log step's metrics, now one step late
            self.pending.append((done, metrics, done % self.log_every == 0))
            if self.console is not None:
                self.console.advance(done)
            if profile is not None:
                record = profile.on_step(done, state)
                if record is not None:
                    self._report(record, done)
            last = done == self.steps
            if self.eval_every and done % self.eval_every == 0 and not last:
                self._evaluate(state, done)
            if trainer.checkpoints is not None:
                periodic = bool(self.checkpoint_every) and done % self.checkpoint_every == 0
                local_every = trainer.checkpoints.local_every
                if periodic or last:
                    self._save(state, done)
                elif local_every and done % local_every == 0:
                    self._save(state, done, local=True)
            if watch.reached(done):
                self._flush(None)
                if trainer.checkpoints is not None:
                    if self.last_saved != done:
                        self._save(state, done)
                    began = time.perf_counter()
                    trainer.checkpoints.wait()
                    self.clock.checkpoint += time.perf_counter() - began
                self.hooks.dew_preempted(step=done)
                raise Preempted(done, saved=trainer.checkpoints is not None)
        self._flush(None)
        if self.dataset.val is not None:
            self._evaluate(state, self.steps)
        return state

    # -- pieces ------------------------------------------------------------------
    def _compiled_for(self, state: TrainState, batch: Mapping[str, Any]) -> tuple[Any, dict]:
        """The compiled step for this batch's shape, and the batch on the mesh.

        A run compiles once. A batch-size ramp (a train reader with a
        schedule of (step, batch) pairs) adds one compiled step per size it
        names; any other change of shape is refused by name.
        """
        shapes = global_shape(batch, self.partition)
        rows = next((s.shape[0] for s in jax.tree.leaves(shapes) if s.shape), 0)
        known = self.compiled.get(rows)
        if known is not None and known[1] == shapes:
            return known[0], self.trainer.shard(batch, self.partition)
        if known is not None or (self.compiled and rows not in self.ramp_sizes):
            _, expected = known or next(iter(self.compiled.values()))
            check_batch(batch, expected, self.partition)  # raises, naming the key and both shapes
        began = time.perf_counter()
        sharded = self.trainer.shard(batch, self.partition)
        compiled = self.trainer.compile(state, sharded)
        self.clock.compile += time.perf_counter() - began
        self.compiled[rows] = (compiled, shapes)
        return compiled, sharded

    def _next_batch(self, state: TrainState, step: int) -> Mapping[str, Any]:
        began = time.perf_counter()
        try:
            batch = next(self.stream)
        except StopIteration:
            raise RuntimeError(
                f"The training stream ended at step {step}; Dataset.train must yield batches "
                "endlessly (repeat the data, or lower steps)."
            ) from None
        self.clock.data += time.perf_counter() - began
        return self.trainer.prepare_batch(state, batch, step)

    def _flush(self, upto: int | None) -> None:
        """Read the pending metrics of steps before upto (all when None); log marked ones."""
        ready = [p for p in self.pending if upto is None or p[0] < upto]
        if upto is not None and not any(log for _, _, log in ready):
            return
        values = jax.device_get([metrics for _, metrics, _ in ready])
        for (done, _, log), host in zip(ready, values, strict=True):
            self._check_finite(done, host)
            if log:
                self._log(done, host)
        self.pending = [p for p in self.pending if not (upto is None or p[0] < upto)]

    def _check_finite(self, done: int, host: Mapping[str, Any]) -> None:
        if bool(host.get("finite", True)):
            self.rejected_streak = 0
            return
        self.rejected_streak += 1
        limit = nonfinite_limit(self.trainer.dynamic_scale)
        if self.rejected_streak >= limit:
            raise NonFiniteLossError(
                f"Step {done} was the {self.rejected_streak}th step in a row with a non-finite loss "
                f"or gradient (loss {float(host['loss'])}); each was rejected, so the state holds "
                "the last finite update. Lower the learning rate, check the data, or enable "
                "dynamic_scale for low-precision training."
            )

    def _log(self, done: int, host: Mapping[str, Any]) -> None:
        now = time.perf_counter()
        scalars = {k: float(np.asarray(v)) for k, v in host.items() if k != "finite"}
        if self.last_log is not None:
            at, step_then = self.last_log
            if done > step_then and now > at:
                rate = (done - step_then) / (now - at)
                scalars["throughput/steps_per_second"] = rate
                scalars["throughput/records_per_second"] = rate * self.dataset.batch
        self.last_log = (now, done)
        if self.console is not None:
            self.console.log(done, scalars)
        if self.trainer.tracker is not None and self.rank0:
            self.trainer.tracker.log(scalars, done)
        self.hooks.dew_step_end(step=done, metrics=scalars)

    def _evaluate(self, state: TrainState, done: int) -> Evaluation | None:
        if self.dataset.val is None and not self.preview:
            return None
        began = time.perf_counter()
        trainer = self.trainer
        metrics = self.metrics or (OutputMeans(),)
        result = evaluate(
            trainer.objective, state.params, self.dataset.val, key=state.rng, metrics=metrics,
            step=done, averaged=state.averaged, preview=self.preview and trainer.tracker is not None,
            mesh=trainer.device_mesh, schedule_step=int(jax.device_get(state.updates)),
        )
        self.clock.eval += time.perf_counter() - began
        if result.scores and self.console is not None:
            self.console.log(done, result.scores)
        if self.rank0 and trainer.tracker is not None:
            if result.scores:
                trainer.tracker.log(result.scalars, done)
            for artifact in result.previews:
                trainer.tracker.artifact(artifact, done)
            trainer.tracker.artifact(result, done)
        self.hooks.dew_evaluation(step=done, evaluation=result)
        return result

    def _save(self, state: TrainState, done: int, *, local: bool = False) -> None:
        began = time.perf_counter()
        get_state = getattr(self.stream, "get_state", None)
        position = get_state() if callable(get_state) else None
        checkpoints = self.trainer.checkpoints
        checkpoints.save(done, state, position=position, partition=self.partition,
                         meta=self.trainer._meta(), local=local)
        self.clock.checkpoint += time.perf_counter() - began
        if not local:
            self.last_saved = done
        self.hooks.dew_checkpoint(step=done, path=str(checkpoints.path(done)))

    def _report(self, record: Any, step: int) -> None:
        if self.rank0 and self.trainer.tracker is not None:
            self.trainer.tracker.artifact(record, step)
