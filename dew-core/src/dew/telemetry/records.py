"""Typed records a run reports besides its scalars, and their JSON form.

A record is any object with a ``type`` name and a ``to_json()`` method; the
ones below are dew's own. Trackers handle every record the same way, so a
record type added elsewhere (the trainer's ``Evaluation``) needs no tracker
change. JSON produced here never holds a non-finite float: ``nan``, ``inf``
and ``-inf`` become the strings ``"NaN"``, ``"+Inf"`` and ``"-Inf"``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeGuard, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from dew.telemetry.artifacts import Artifact as _Artifact

__all__ = [
    "Goodput",
    "ProfileWindowRecord",
    "Record",
    "RunStarted",
    "TrackerDropped",
    "is_record",
    "json_value",
    "previews_of",
    "record_row",
]


@runtime_checkable
class Record(Protocol):
    """What a tracker needs from a record: its type name and its JSON form."""

    @property
    def type(self) -> str: ...  # a class's name for its records (a ClassVar on dew's own)

    def to_json(self) -> dict[str, Any]: ...


def is_record(value: object) -> TypeGuard[Record]:
    """True for anything carrying a ``type`` name and a ``to_json`` method."""
    # A record is any object of that shape, a third party's too: probing is the definition.
    return isinstance(getattr(value, "type", None), str) and callable(
        getattr(value, "to_json", None)
    )


def json_value(value: object) -> object:
    """value with numpy and JAX scalars made plain and non-finite floats spelled out."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        if math.isnan(value):
            return "NaN"
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if is_record(value):
            return json_value(value.to_json())
        return {f.name: json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    array = np.asarray(value)
    if array.dtype.kind in "biuf" and array.ndim == 0:
        item = array.item()
        return json_value(item)
    if array.dtype.kind in "biuf":
        return [json_value(v) for v in array.tolist()]
    return str(value)


def record_row(value: Record, step: int) -> dict[str, object]:
    """The journal row of one record: the step it was reported at, its type, its JSON."""
    return {"step": int(step), "type": value.type, "record": json_value(value.to_json())}


def previews_of(value: object) -> tuple[_Artifact, ...]:
    """The preview files a report stands for: an Artifact itself, nothing for a record.

    A record that holds previews (an Evaluation) is reported as a record only;
    the trainer reports each of its previews on its own.
    """
    from dew.telemetry.artifacts import Artifact

    return (value,) if isinstance(value, Artifact) else ()


def _fields(record: DataclassInstance) -> dict[str, Any]:
    return {f.name: json_value(getattr(record, f.name)) for f in dataclasses.fields(record)}


@dataclass(frozen=True)
class RunStarted:
    """A fit began: its configuration, the step range and where it runs.

    folder is the run's folder, where the fit keeps its checkpoints (absolute, or a store's URL),
    None for a fit that keeps none; the recipe in config names it as written, ``{timestamp}``
    unexpanded, so it cannot tell one run of a recipe from another.
    """

    type: ClassVar[str] = "run_started"

    config: dict[str, Any]
    start: int
    steps: int
    mesh: dict[str, int] = field(default_factory=dict)
    processes: int = 1
    folder: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _fields(self)

    def run_folder(self) -> str | None:
        """The run folder, if the fit has one: a tracker keeps one run per folder, which a resume
        there reopens."""
        return self.folder


@dataclass(frozen=True)
class ProfileWindowRecord:
    """The profiler window a fit wrote: steps ``start`` to ``start + steps`` in directory."""

    type: ClassVar[str] = "profile_window"

    directory: str
    start: int
    steps: int

    def to_json(self) -> dict[str, Any]:
        return _fields(self)


# The name the reference documents give this record. It stays out of __all__: dew.training's
# ProfileWindow (the request for a window) is the public class of that name.
ProfileWindow = ProfileWindowRecord


@dataclass(frozen=True)
class Goodput:
    """Where a fit's wall time went, in seconds.

    ``step_seconds`` is time spent in training steps (the good part); the
    other fields split the rest: tracing and compiling, waiting for the next
    batch, blocked on checkpoint writes, evaluation, work redone after a
    preemption, the rollout that makes a batch on the host before the
    step, and the part of the rollout spent scoring it with a reward (a
    rollout that keeps ``reward_seconds`` reports it; ``rollout_seconds``
    excludes it). ``first_step_seconds`` is the time from the start of the fit
    to the end of its first step. ``data_seconds`` is only the time the step
    loop stood waiting for a batch: a fit starts its stream before it places
    the state, and the part of the stream's start-up (worker processes, the
    first batch) that ran while the state was placed is not waiting.

    >>> g = Goodput(2.0, 10.0, 7.5, 1.5, 0.5, 0.25, 0.25, 0.0)
    >>> g.fraction, g.badput["other"]
    (0.75, 0.0)
    """

    type: ClassVar[str] = "goodput"

    first_step_seconds: float
    wall_seconds: float
    step_seconds: float
    compile_seconds: float = 0.0
    data_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    eval_seconds: float = 0.0
    lost_seconds: float = 0.0
    rollout_seconds: float = 0.0
    reward_seconds: float = 0.0

    @property
    def fraction(self) -> float:
        """The share of the wall time spent in steps (0 when no time passed)."""
        return self.step_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def badput(self) -> dict[str, float]:
        """Seconds not spent in steps, by cause; ``other`` is what no cause claims."""
        named = {
            "compile": self.compile_seconds,
            "data": self.data_seconds,
            "checkpoint": self.checkpoint_seconds,
            "evaluation": self.eval_seconds,
            "preemption": self.lost_seconds,
            "rollout": self.rollout_seconds,
            "reward": self.reward_seconds,
        }
        rest = self.wall_seconds - self.step_seconds - sum(named.values())
        return {**named, "other": max(rest, 0.0)}

    def to_json(self) -> dict[str, Any]:
        return {**_fields(self), "fraction": json_value(self.fraction),
                "badput": json_value(self.badput)}


@dataclass(frozen=True)
class TrackerDropped:
    """A tracker could not write for a while and lost ``reports`` reports (one per log
    or artifact call) from steps ``first_step`` to ``last_step``; ``where`` is the
    file or address it writes to and ``error`` the last failure it met."""

    type: ClassVar[str] = "tracker_dropped"

    where: str
    reports: int
    first_step: int | None
    last_step: int | None
    error: str

    @classmethod
    def of(cls, dropped: Any, where: str) -> TrackerDropped:
        """The record of a channel's Dropped count (dew.tracking.background)."""
        return cls(where, dropped.items, dropped.first_step, dropped.last_step, dropped.error)

    def to_json(self) -> dict[str, Any]:
        return _fields(self)
