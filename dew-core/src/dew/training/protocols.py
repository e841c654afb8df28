"""The two things a run hands the trainer as code: where reports go, and how batches are made.

``Tracker`` and ``Rollout`` sit here, beside nothing that trains, so a
tracker or rollout plugin depends on these protocols (and on
``dew.objectives.base`` and ``dew.data.base`` for the other two), never on
the trainer. Importing this module imports no JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from dew.data.base import Resumable
from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import Record

if TYPE_CHECKING:
    import jax

    from dew.training.state import TrainState

__all__ = ["Refilling", "Reported", "Rollout", "StatefulRollout", "Tracker"]

Reported: TypeAlias = Artifact | Record
"""What ``Tracker.artifact`` receives: a preview or a typed record."""


@runtime_checkable
class Tracker(Protocol):
    """A sink for a run's scalars, previews and records."""

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """Record scalar values at step."""
        ...

    def artifact(self, value: Reported, step: int) -> None:
        """Record a preview or a typed record at step."""
        ...

    def close(self) -> None:
        """Flush and release what the tracker holds."""
        ...


@runtime_checkable
class Rollout(Protocol):
    """Produce a batch on the host, before the compiled step reads it.

    Called with the live state, this process's prefetched batch and a key
    from the run's rollout stream (folded with the step). It returns this
    process's share of the batch the step trains on: a mapping of arrays
    whose shapes are the same at every step, so the step compiles once.
    A rollout that also has ``get_state() -> bytes`` and
    ``set_state(bytes)`` is saved with the data position and resumed.
    """

    def __call__(self, state: TrainState, batch: Mapping[str, Any], key: jax.Array) -> Mapping[str, Any]: ...


@runtime_checkable
class StatefulRollout(Rollout, Resumable, Protocol):
    """A rollout whose position (get_state/set_state) a checkpoint keeps."""


@runtime_checkable
class Refilling(Protocol):
    """A rollout that may read more of the training stream within one step.

    The trainer calls ``draw_from(more)`` once, before the first step;
    ``more()`` returns this process's next batch of the stream. A rollout that
    drops part of what it sampled (dynamic sampling drops groups whose
    rewards are all equal) refills its batch from there; the stream's saved
    position counts those batches, so a resumed run reads on after them.
    """

    def draw_from(self, more: Callable[[], Mapping[str, Any]]) -> None: ...
