"""The training loop, in two parts a reader holds in their head.

``steps`` is the engine: for each step it takes the feed's next batch,
compiles the program for a batch shape it has not seen, dispatches the
step and yields a ``StepRecord`` (the new state and its metrics, still on
the device). ``run_hooks`` drives it: after each record every hook (dew.training.hooks)
does what its cadence makes due and returns what it contributes, which the
reporting hook hands on; the run stops at its last step or when a
contribution asks it to. Reading step n's metrics happens while step n+1
runs (``Progress`` reads one step late), so the host never waits otherwise.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax

from dew.objectives.base import Objective
from dew.training.feed import Feed, Signature
from dew.training.opening import Pending
from dew.training.state import TrainState

if TYPE_CHECKING:
    from dew.training.hooks import Hook, ProgressHook

__all__ = ["Compilation", "StepRecord", "run_hooks", "steps"]

StepProgram = Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, dict]]


@dataclass(frozen=True)
class Compilation:
    """A step program compiled for a new batch shape: how long it took, and what a step of it processes."""

    seconds: float
    at: float  # perf_counter when it finished
    rows: int
    tokens: int | None
    flops: float | None


@dataclass(frozen=True)
class StepRecord:
    """One dispatched step: done steps are finished once it is; metrics are still on the device.

    last is true at the fit's last step, and once a hook asks the run to stop
    (stop then says why), so the hooks after it treat the step as the last.
    """

    done: int
    state: TrainState
    metrics: dict[str, jax.Array | float]
    first: bool
    last: bool
    compiled: Compilation | None = None
    stop: str | None = None

    def stopping(self, reason: str) -> StepRecord:
        return self if self.stop is not None else dataclasses.replace(self, stop=reason, last=True)


def steps(state: TrainState | Pending, feed: Feed, compile: Callable[[TrainState, Mapping[str, jax.Array]], StepProgram],
          objective: Objective, start: int, stop: int) -> Iterator[StepRecord]:
    """Dispatch steps start+1 .. stop, yielding each one's record as soon as it is dispatched.

    compile is the execution's (dew.training.execution): it turns the state, or its abstract
    template, and a batch into the step program; the objective says what a step of each new
    batch shape processes (tokens, flops).
    """
    compiled: dict[Signature, StepProgram] = {}
    for step in range(start, stop):
        fed = feed.next(state, step)  # type: ignore[arg-type]  # Pending only where no rollout reads it
        compilation = None
        if fed.signature not in compiled:
            began = time.perf_counter()
            abstract = state.template if isinstance(state, Pending) else state
            compiled[fed.signature] = compile(abstract, fed.batch)
            at = time.perf_counter()
            shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in fed.batch.items()}
            rows = next((v.shape[0] for v in shapes.values() if v.shape), 0)
            compilation = Compilation(at - began, at, rows, objective.tokens(shapes), objective.flops(shapes))
        if isinstance(state, Pending):  # the initializer compiled and ran beside the step's compilation
            state = state.result()
        state, metrics = compiled[fed.signature](state, fed.batch)
        yield StepRecord(step + 1, state, {**metrics, **fed.scalars}, first=step == start,
                         last=step + 1 == stop, compiled=compilation)


def run_hooks(records: Iterator[StepRecord], reporting: ProgressHook, hooks: Sequence[Hook]) -> TrainState:
    """Run every record through the hooks in order, then end them; a failure reaches each hook.

    Returns the last step's state.
    """
    everyone = (reporting, *hooks)
    record = None
    try:
        for hook in everyone:
            hook.open()
        for record in records:
            for hook in everyone:
                stop = reporting.take(hook.after(record), record.done)
                record = record if stop is None else record.stopping(stop)
            if record.stop is not None:
                reporting.note(f"step {record.done}: stopping early: {record.stop}")
                break
        assert record is not None, "a fit runs at least one step"
        done, state = record.done, record.state
        for hook in everyone:
            reporting.take(hook.end(done, state), done)
    except BaseException as error:
        for hook in reversed(everyone):
            hook.fail(error)
        raise
    finally:
        for hook in reversed(everyone):
            hook.close()
    return state
