"""What a fit tells the world between steps: metrics, records, hooks, the console.

``Progress`` keeps each step's metrics on the device until they are ready
or due. At a log step it reads them one step late (after the next step is
dispatched), so the device queue never drains for reporting; between log
steps it only looks at metrics that are already computed, eight steps'
verdicts (``finite``) at a time, so a run of non-finite steps is noticed
(and each rejected step reported) within a few steps, without making the
host wait or read every step. It knows nothing of the trainer:
the trainer hands it values and asks it what the hooks want.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import pluggy
from jax.experimental import multihost_utils
from numpy.typing import ArrayLike

from dew import plugins
from dew.errors import DewError
from dew.telemetry.records import Goodput, RunStarted
from dew.tracking.background import LOOP, tracker_cpu_seconds
from dew.tracking.console import Console
from dew.tracking.protocol import Flushes, Reported, Tracker

if TYPE_CHECKING:
    from dew.training.evaluation import Evaluation

__all__ = ["Clock", "NonFiniteLossError", "Progress", "nonfinite_limit"]

_VERDICTS_AT_ONCE = 8
"""Steps between log steps whose verdicts are read together: on a two-core CPU a read takes the
loop's thread about as long for eight values as for one, and that time is the step's."""

_NONFINITE_LIMIT = 5  # consecutive rejected steps (without a loss scaler) that stop a run
_NONFINITE_LIMIT_SCALED = 50


class NonFiniteLossError(DewError, FloatingPointError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def nonfinite_limit(dynamic_scale: bool) -> int:
    """How many rejected steps in a row stop a run (more with a loss scaler, which expects some)."""
    return _NONFINITE_LIMIT_SCALED if dynamic_scale else _NONFINITE_LIMIT


@dataclass
class Clock:
    """Where the fit's wall time goes (seconds), for the Goodput record."""

    started: float = field(default_factory=time.perf_counter)
    first_step: float = 0.0
    compile: float = 0.0
    checkpoint: float = 0.0
    eval: float = 0.0

    def goodput(self, data: float, rollout: float, reward: float = 0.0, *, within_first: float = 0.0) -> Goodput:
        """The record of where the wall time went; within_first is the part of data, rollout and
        reward spent before the first step ended, already inside first_step (counted once)."""
        wall = time.perf_counter() - self.started
        overhead = self.first_step + data + rollout + reward - within_first + self.checkpoint + self.eval
        return Goodput(
            first_step_seconds=self.first_step, wall_seconds=wall,
            step_seconds=max(0.0, wall - overhead), compile_seconds=self.compile,
            data_seconds=data, checkpoint_seconds=self.checkpoint, eval_seconds=self.eval,
            rollout_seconds=rollout, reward_seconds=reward,
        )


@dataclass
class _Pending:
    step: int
    metrics: dict[str, jax.Array | float]  # the step's arrays and the stream's scalars
    log: bool


def _wanted(pending: _Pending) -> Mapping[str, jax.Array | float]:
    """What the host reads of a step: all its metrics where they are logged, else only whether
    it was accepted (``finite``), which the count of rejections in a row needs. A read per
    step costs the loop's thread a fifth as much for one value as for five."""
    if pending.log or "finite" not in pending.metrics:
        return pending.metrics
    return {"finite": pending.metrics["finite"]}


class _Loading:
    """The installed plugins loading on a thread of their own (entry points are read and
    imported: a tenth of a second or more), overlapping the fit's first compiles."""

    def __init__(self) -> None:
        import threading

        self._thread = threading.Thread(target=self._load, name="dew-plugins", daemon=True)
        self._thread.start()

    @staticmethod
    def _load() -> None:
        with contextlib.suppress(Exception):  # a load error is raised again by plugins.hook()
            plugins.manager()

    def wait(self) -> None:
        self._thread.join()


def _conventional(name: str) -> str:
    """A step metric's logged name: train/<name>, unless it names its own group.

    >>> _conventional("loss"), _conventional("accuracy"), _conventional("rl/kl")
    ('train/loss', 'train/accuracy', 'rl/kl')
    """
    return name if "/" in name else f"train/{name}"


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    return jax.numpy.all(jax.numpy.stack([jax.numpy.isfinite(leaf).all() for leaf in leaves]))


def _finite(tree: Any) -> bool:
    """Whether every float in tree is finite (one program over its leaves; every process of a
    pool calls it at the same step)."""
    leaves = [leaf for leaf in jax.tree.leaves(tree)
              if isinstance(leaf, jax.Array | np.ndarray) and jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)]
    return not leaves or bool(_all_finite(leaves))


class Progress:
    """The reporting side of one fit (see the module docstring).

    The scalars it logs follow one convention (docs/metrics.md): the loss and
    the objective's metrics under ``train/``, with ``train/lr``,
    ``train/grad_norm`` and ``train/step_time``; ``throughput/*`` for steps,
    examples and tokens per second and the MFU estimate; ``val/*`` for
    validation.
    """

    def __init__(self, *, tracker: Tracker | None, records_per_step: int, log_every: int,
                 dynamic_scale: bool, schedule: Callable[[int], ArrayLike] | None = None) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be at least 1, got {log_every}.")
        self.tracker = tracker
        self.records_per_step = records_per_step
        self.schedule = schedule
        self.tokens_per_step: int | None = None
        self.flops_per_step: float | None = None
        self.peak_flops: float | None = None
        self.log_every = log_every
        self.steps: int | None = None  # the fit's last step, always logged
        self.limit = nonfinite_limit(dynamic_scale)
        self.scaled = dynamic_scale
        self.clock = Clock()
        self.rank0 = jax.process_index() == 0
        self.console = Console() if self.rank0 else None
        self._hooks: pluggy.HookRelay | None = None
        self._plugins: _Loading | None = _Loading()
        self.pending: list[_Pending] = []
        self.last_log: tuple[float, int] | None = None
        # The first step's own timing, compile excluded: when its compile ended, when it was
        # ready, and the step count it made (the first log step's rate starts from it).
        self.compiled_at: float | None = None
        self.first: tuple[float, float, int] | None = None
        # What each step not yet logged processed (records, tokens, FLOPs): a batch ramp changes it
        # between steps, and a step is logged after the next one's batch was measured.
        self.sizes: dict[int, tuple[int, int | None, float | None]] = {}
        self.compile_counted = 0.0  # compile seconds already kept out of the rates logged so far
        self.rejected_streak = 0
        self.stop_requested: str | None = None
        # Reading a step's metrics as soon as they are ready is process-local timing; in a
        # pool every process must stop at the same step, so only the log-step reads count.
        self.eager = jax.process_count() == 1
        self.tracker_cpu_at_start = tracker_cpu_seconds()
        self.in_loop = False  # holding the tracker writer to the loop's waits (LOOP)

    @property
    def hooks(self) -> pluggy.HookRelay:
        """The plugins' hook relay (the installed plugins load on a thread of their own while
        the fit builds its state, the first time a process fits; a load error is raised here)."""
        if self._hooks is None:
            if self._plugins is not None:
                self._plugins.wait()
                self._plugins = None
            self._hooks = plugins.hook()
        return self._hooks

    def fire(self, hook: str, **arguments: object) -> Any:
        """Fire a lifecycle hook with its arguments; a plugin's own error is named (plugins.blamed)."""
        with plugins.blamed(hook):
            return getattr(self.hooks, hook)(**arguments)

    # -- the run's edges -----------------------------------------------------------
    def start(self, trainer: object, start: int, steps: int, mesh: Mapping[str, int], *,
              recipe: Mapping[str, object] | None = None, folder: str | None = None) -> None:
        """The fit began: the RunStarted record (carrying the recipe, when the run has one, and the
        folder its checkpoints are kept in)."""
        processes = jax.process_count()
        self.steps = int(steps)
        if self.console is not None:
            self.console.start(start, steps, dict(mesh), processes)
        self.record(RunStarted(config=dict(recipe or {}), start=start, steps=steps, mesh=dict(mesh),
                               processes=processes, folder=folder), start)
        self.fire("dew_run_start", trainer=trainer, start=start, steps=steps)
        if not self.in_loop:  # from here the trackers' writer works while the loop waits
            self.in_loop = True
            LOOP.enter()

    def _leave_loop(self) -> None:
        if self.in_loop:
            self.in_loop = False
            LOOP.leave()

    def finish(self, step: int, state: object, goodput: Goodput) -> None:
        self._leave_loop()
        self.record(goodput, step)
        if self.console is not None:
            self.console.finish(goodput)
            self.console.close()
        self.fire("dew_run_end", step=step, state=state)

    def close(self) -> None:
        self._leave_loop()
        if self.console is not None:
            self.console.close()

    # -- per step --------------------------------------------------------------------
    def stepped(self, done: int, metrics: dict[str, jax.Array | float], *, first: bool) -> None:
        """Step done was dispatched; report what is due or already computed."""
        if first:
            with LOOP.waiting():
                jax.block_until_ready(metrics)
            ready = time.perf_counter()
            self.clock.first_step = ready - self.clock.started
            self.first = (ready if self.compiled_at is None else self.compiled_at, ready, done)
        due = any(p.log for p in self.pending)
        self._read(upto=done, block=due)
        self.sizes[done] = (self.records_per_step, self.tokens_per_step, self.flops_per_step)
        self.pending.append(_Pending(done, metrics, done % self.log_every == 0 or done == self.steps))
        if self.console is not None:
            self.console.advance(done)

    def drain(self) -> None:
        """Read and report every pending step (at the end, and before a save or stop)."""
        self._read(upto=None, block=True)

    def settle(self, done: int, weights: Any) -> None:
        """Report every pending step and have the tracker write it (Flushes): before a checkpoint,
        so a run resumed from it finds every step up to it, and a tracker that cannot write stops
        the run before the checkpoint is committed rather than after. Weights that are not
        finite are refused then too (check_weights)."""
        self.drain()
        if isinstance(self.tracker, Flushes):
            with LOOP.waiting():  # the writer thread has the interpreter while the loop waits for it
                self.tracker.flush()
        self.check_weights(done, weights)

    def check_weights(self, done: int, weights: Any) -> None:
        """After a rejected step, stop the run if its weights themselves are NaN or infinite.

        The guard rejects a step whose loss or gradient is not finite; an update computed from
        finite gradients can still make the weights so (a learning rate far too high, an epsilon
        that computes as 0), and then every later step is rejected. Checked only after a
        rejection, so a healthy run never pays for it; a run shorter than the guard's limit would
        otherwise end as if it had trained, and checkpoint the broken weights."""
        if self.rejected_streak == 0 or _finite(weights):
            return
        raise NonFiniteLossError(
            f"Step {done} was rejected ({self.rejected_streak} in a row) because the weights themselves hold "
            "NaN or infinite values: an accepted update made them so (a learning rate far too high, or an "
            "optimizer eps that computes as 0). They are not checkpointed; lower the learning rate and start "
            "again (a resume starts from the last checkpoint written before they turned).")

    def _read(self, *, upto: int | None, block: bool) -> None:
        """Read pending steps before upto in order: all of them when block, else the ready ones
        (once the first _VERDICTS_AT_ONCE are)."""
        if not block and not self._group_ready():
            return
        ready: list[_Pending] = []
        for pending in self.pending:
            if upto is not None and pending.step >= upto:
                break
            if not block and (not self.eager or pending.log
                              or not pending.metrics["finite"].is_ready()):  # type: ignore[union-attr]  # the step's array; is_ready is an ArrayImpl method jax.Array does not declare
                break
            ready.append(pending)
        if not ready:
            return
        del self.pending[: len(ready)]
        wanted = [_wanted(p) for p in ready]
        if block:  # the loop waits for its device: the trackers' writer may work meanwhile
            with LOOP.waiting():
                values = jax.device_get(wanted)
        else:
            values = jax.device_get(wanted)
        for pending, host in zip(ready, values, strict=True):
            if not bool(host.get("finite", True)) and "loss" not in host:
                host = jax.device_get(pending.metrics)  # a rejected step: its loss is in the note
            self._check_finite(pending.step, host)
            if pending.log:
                self._log(pending.step, host)

    def _group_ready(self) -> bool:
        """Whether the oldest _VERDICTS_AT_ONCE pending steps are computed (in a lone process)."""
        if not self.eager or len(self.pending) < _VERDICTS_AT_ONCE:
            return False
        finite = self.pending[_VERDICTS_AT_ONCE - 1].metrics.get("finite")
        return isinstance(finite, jax.Array) and finite.is_ready()  # type: ignore[attr-defined]  # an ArrayImpl method jax.Array does not declare

    def _check_finite(self, done: int, host: Mapping[str, ArrayLike]) -> None:
        if bool(host.get("finite", True)):
            self.rejected_streak = 0
            return
        self.rejected_streak += 1
        loss = float(np.asarray(host.get("loss", np.nan)))
        if self.console is not None:
            self.console.note(
                f"step {done}: non-finite loss or gradient (loss {loss}); the step was rejected "
                f"({self.rejected_streak} in a row, the run stops at {self.limit})"
            )
        if self.tracker is not None and self.rank0:
            self.tracker.log({"train/rejected_steps_in_a_row": float(self.rejected_streak)}, done)
        if self.rejected_streak >= self.limit:
            raise NonFiniteLossError(
                f"Step {done} was the {self.rejected_streak}th step in a row with a non-finite loss "
                f"or gradient (loss {loss}); each was rejected, so the state holds the last "
                "finite update, whose weights may already be where training diverged. Lower the "
                "learning rate or check the data (a resume keeps the weights: if its steps fail "
                "again, start fresh), or, for low-precision training, "
                + ("note that the dynamic loss scale is on, and halved at each rejected step "
                   "(train/loss_scale): float16 overflowed even at its smallest scale, so compute in "
                   "bfloat16 (model.dtype=bfloat16) or keep the weights in float32 (model.param_dtype=float32)."
                   if self.scaled else
                   "start a new run with trainer.dynamic_scale=true (a resume keeps the loss scaler it was "
                   "trained with).")
            )

    def compiled(self, seconds: float, at: float | None = None) -> None:
        """A step program was compiled in seconds (finishing at perf_counter at, or now): compile
        time, kept out of every rate."""
        self.clock.compile += seconds
        if self.compiled_at is None:  # the rates start when the first compile ends
            self.compiled_at = time.perf_counter() if at is None else at
            self.compile_counted = self.clock.compile

    def _span(self, done: int, now: float) -> tuple[int, float] | None:
        """The steps and seconds the rate logged at step done covers: since the previous log,
        or, at the first log, since the end of the first compile (the first step alone: until
        it was ready, its own time)."""
        if self.last_log is not None:
            at, step_then = self.last_log
            return done - step_then, now - at
        if self.first is None:
            return None
        compiled_at, ready, first = self.first
        if self.console is not None:
            self.console.note(f"step {done}: throughput is timed from the end of the first step's "
                              f"compile; the {self.clock.compile:.2f} s of compiling are excluded")
        return done - first + 1, (ready if done == first else now) - compiled_at

    def measure(self, *, records: int, tokens: int | None, flops: float | None,
                peak_flops: float | None) -> None:
        """What one step processes, for the throughput scalars (set from the first batch)."""
        self.records_per_step = records
        self.tokens_per_step = tokens
        self.flops_per_step = flops
        self.peak_flops = peak_flops

    def _log(self, done: int, host: Mapping[str, ArrayLike]) -> None:
        now = time.perf_counter()
        scalars = {_conventional(k): float(np.asarray(v)) for k, v in host.items()
                   if k not in ("finite", "updates")}
        if self.schedule is not None and "updates" in host:
            # The rate of the latest update: optax reads the schedule at the count before it, so
            # the count after it (what the step returns) is the next update's.
            latest = max(int(np.asarray(host["updates"])) - 1, 0)
            scalars["train/lr"] = float(np.asarray(self.schedule(latest)))
        span = self._span(done, now)
        covered = [self.sizes.pop(step) for step in sorted(self.sizes) if step <= done]
        if span is not None:
            steps, seconds = span
            # a compile inside the span (a batch ramp's next size) is no step's time
            seconds -= self.clock.compile - self.compile_counted
            self.compile_counted = self.clock.compile
            if steps > 0 and seconds > 0:
                rate = steps / seconds
                records, tokens, flops = self._spanned(covered[-steps:], steps)
                scalars["train/step_time"] = 1.0 / rate
                scalars["throughput/steps_per_second"] = rate
                scalars["throughput/examples_per_second"] = records / seconds
                if tokens is not None:
                    scalars["throughput/tokens_per_second"] = tokens / seconds
                if flops is not None and self.peak_flops:
                    scalars["throughput/mfu"] = flops / seconds / (self.peak_flops * jax.device_count())
        self.last_log = (now, done)
        if self.tracker is not None:
            scalars["telemetry/tracker_cpu_seconds"] = tracker_cpu_seconds() - self.tracker_cpu_at_start
        scalars.update(self._hook_scalars(done, scalars))
        if self.console is not None:
            self.console.log(done, scalars)
        if self.tracker is not None and self.rank0:
            self.tracker.log(scalars, done)

    def _spanned(self, covered: list[tuple[int, int | None, float | None]],
                 steps: int) -> tuple[int, int | None, float | None]:
        """The records, tokens and FLOPs of a logged span's steps, each step's own (a batch ramp changes
        them); the current sizes when none was kept."""
        rows = covered or [(self.records_per_step, self.tokens_per_step, self.flops_per_step)] * steps
        tokens, flops = [row[1] for row in rows], [row[2] for row in rows]
        return (sum(row[0] for row in rows), None if None in tokens else sum(t or 0 for t in tokens),
                None if None in flops else sum(f or 0.0 for f in flops))

    def _hook_scalars(self, done: int, scalars: Mapping[str, float]) -> dict[str, float]:
        """Fire dew_step_end; gather the scalars hooks add and whether one asks to stop."""
        added: dict[str, float] = {}
        stop: str | None = None
        for result in self.fire("dew_step_end", step=done, metrics=dict(scalars)) or ():
            contribution = plugins.StepContribution.of(result)
            added.update({k: float(v) for k, v in contribution.scalars.items()})
            if contribution.stop and stop is None:
                stop = contribution.reason or "a plugin asked the run to stop"
        if jax.process_count() > 1:  # every process stops at the same step, or none does
            flags = np.asarray(multihost_utils.process_allgather(np.asarray(stop is not None, np.int32)))
            if flags.max() and stop is None:
                stop = "a plugin on another process asked the run to stop"
        if stop is not None and self.stop_requested is None:
            self.stop_requested = stop
        return added

    # -- other reports -----------------------------------------------------------------
    def record(self, record: Reported, step: int) -> None:
        if self.rank0 and self.tracker is not None:
            self.tracker.artifact(record, step)

    def evaluation(self, result: Evaluation, done: int) -> None:
        if result.scores and self.console is not None:
            self.console.log(done, result.scores)
        if self.rank0 and self.tracker is not None:
            if result.scores:
                self.tracker.log(result.scalars, done)
            for artifact in result.previews:
                self.tracker.artifact(artifact, done)
            self.tracker.artifact(result, done)
        self.fire("dew_evaluation", step=done, evaluation=result)

    def checkpoint(self, done: int, path: str) -> None:
        self.fire("dew_checkpoint", step=done, path=path)

    def note(self, line: str) -> None:
        if self.console is not None:
            self.console.note(line)
