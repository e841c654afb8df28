"""The training loop, in two parts a reader holds in their head.

``steps`` is the engine: for each step it takes the feed's next batch,
compiles the program for a batch shape it has not seen, dispatches the
step and yields a ``StepRecord`` (the new state and its metrics, still on
the device). ``train`` drives it: after each record every hook (dew.training.hooks)
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
from typing import TYPE_CHECKING, Any

import jax

from dew.training.feed import Feed, Signature
from dew.training.state import TrainState

if TYPE_CHECKING:
    from dew.training.hooks import Hook, Reporting

__all__ = ["Compilation", "StepRecord", "steps", "train"]

StepProgram = Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, dict]]


@dataclass(frozen=True)
class Compilation:
    """A step program compiled for a new batch shape: how long it took and for what."""

    seconds: float
    at: float  # perf_counter when it finished
    shapes: dict[str, jax.ShapeDtypeStruct]


@dataclass(frozen=True)
class StepRecord:
    """One dispatched step: done steps are finished once it is; metrics are still on the device.

    last is true at the fit's last step, and once a hook asks the run to stop
    (stop then says why), so the hooks after it treat the step as the last.
    """

    done: int
    state: TrainState
    metrics: dict[str, Any]
    first: bool
    last: bool
    compiled: Compilation | None = None
    stop: str | None = None

    def stopping(self, reason: str) -> StepRecord:
        return self if self.stop is not None else dataclasses.replace(self, stop=reason, last=True)


def steps(state: TrainState, feed: Feed, compile: Callable[[TrainState, Mapping[str, jax.Array]], StepProgram],
          start: int, stop: int) -> Iterator[StepRecord]:
    """Dispatch steps start+1 .. stop, yielding each one's record as soon as it is dispatched."""
    compiled: dict[Signature, StepProgram] = {}
    for step in range(start, stop):
        fed = feed.next(state, step)
        compilation = None
        if fed.signature not in compiled:
            began = time.perf_counter()
            compiled[fed.signature] = compile(state, fed.batch)
            at = time.perf_counter()
            compilation = Compilation(at - began, at, {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                                                       for k, v in fed.batch.items()})
        state, metrics = compiled[fed.signature](state, fed.batch)
        yield StepRecord(step + 1, state, {**metrics, **fed.scalars}, first=step == start,
                         last=step + 1 == stop, compiled=compilation)


def train(records: Iterator[StepRecord], reporting: Reporting, hooks: Sequence[Hook]) -> StepRecord | None:
    """Run every record through the hooks in order, then end them; a failure reaches each hook."""
    everyone = (reporting, *hooks)
    record = None
    try:
        for hook in everyone:
            hook.open()
        for record in records:
            for hook in everyone:
                record = reporting.take(hook.after(record), record)
            if record.stop is not None:
                reporting.note(f"step {record.done}: stopping early: {record.stop}")
                break
        for hook in everyone:
            if record is not None:
                reporting.take(hook.end(record), record)
    except BaseException as error:
        for hook in reversed(everyone):
            hook.fail(error)
        raise
    finally:
        for hook in reversed(everyone):
            hook.close()
    return record
