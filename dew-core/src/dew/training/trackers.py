"""Where a run's reports go: the Tracker protocol, a fan-out, and a local journal.

A tracker receives scalars (``log``) and reports (``artifact``): a preview
(dew.telemetry.artifacts.Artifact) or a typed record (anything with ``type``
and ``to_json()``, see dew.telemetry.records). The trainer never closes a
tracker; whoever built it does. Backends for TensorBoard, MLflow and W&B live
in dew-trackers and are imported only when one of them logs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol, TypeAlias, runtime_checkable

from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import Record, is_record, previews_of, record_row

__all__ = ["LocalTracker", "NotAReportError", "Reported", "Tracker", "Trackers", "scalar_row"]

Reported: TypeAlias = Artifact | Record


class NotAReportError(TypeError):
    """artifact() was given something that is neither a preview nor a record."""


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


def check_reported(value: object) -> None:
    """Raise NotAReportError unless value is an Artifact or a record."""
    if not (isinstance(value, Artifact) or is_record(value)):
        raise NotAReportError(
            f"A tracker reports an Artifact or a record (an object with a `type` name and "
            f"`to_json()`); got {type(value).__name__}. Log numbers with log() instead."
        )


def _finite_or_name(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


def scalar_row(scalars: Mapping[str, float], step: int) -> dict[str, Any]:
    """The journal row of one log call: the step, then each value as a float or its name."""
    row: dict[str, Any] = {"step": int(step)}
    for name, value in scalars.items():
        row[name] = _finite_or_name(float(value))
    return row


class Trackers:
    """Several trackers as one: every report reaches every sink.

    A sink that raises does not stop the others from receiving the same
    report; once all were attempted, the first failure is raised (the
    others are attached to it as notes).
    """

    def __init__(self, *trackers: Tracker) -> None:
        self.trackers: tuple[Tracker, ...] = tuple(trackers)

    def _each(self, method: str, *args: Any) -> None:
        failures: list[tuple[Tracker, BaseException]] = []
        for tracker in self.trackers:
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # noqa: BLE001 - every sink is attempted
                failures.append((tracker, error))
        if failures:
            first = failures[0][1]
            for tracker, error in failures[1:]:
                first.add_note(f"{type(tracker).__name__}.{method} also failed: {error!r}")
            raise first

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._each("log", scalars, step)

    def artifact(self, value: Reported, step: int) -> None:
        self._each("artifact", value, step)

    def close(self) -> None:
        self._each("close")

    def __len__(self) -> int:
        return len(self.trackers)

    def __repr__(self) -> str:
        return f"Trackers({', '.join(repr(t) for t in self.trackers)})"


class LocalTracker:
    """Writes a run's reports into a directory, one line per report, as it happens.

    ``scalars.jsonl`` holds one row per ``log`` call, ``records.jsonl`` one
    row per record, ``previews.jsonl`` one row per preview file written under
    ``previews/``. Non-finite values are the strings ``NaN``, ``+Inf`` and
    ``-Inf``. ``plot()`` draws each metric from the journal into ``plots/``;
    nothing is kept in memory between calls.

    >>> import tempfile, json, pathlib
    >>> directory = pathlib.Path(tempfile.mkdtemp())
    >>> tracker = LocalTracker(directory)
    >>> tracker.log({"loss": float("nan")}, step=1)
    >>> tracker.close()
    >>> json.loads((directory / "scalars.jsonl").read_text())
    {'step': 1, 'loss': 'NaN'}
    """

    SCALARS = "scalars.jsonl"
    RECORDS = "records.jsonl"
    PREVIEWS = "previews.jsonl"

    def __init__(self, directory: str | Path, *, plots: bool = False) -> None:
        self.directory = Path(directory)
        self.plots = plots
        self._handles: dict[str, IO[str]] = {}

    def _write(self, journal: str, row: Mapping[str, Any]) -> None:
        handle = self._handles.get(journal)
        if handle is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle = self._handles[journal] = open(  # noqa: SIM115 - held until close()
                self.directory / journal, "a", encoding="utf-8"
            )
        handle.write(json.dumps(row, allow_nan=False) + "\n")
        handle.flush()

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._write(self.SCALARS, scalar_row(scalars, step))

    def artifact(self, value: Reported, step: int) -> None:
        from dew.telemetry.render import write_preview

        check_reported(value)
        if is_record(value):
            self._write(self.RECORDS, record_row(value, step))
        for preview in previews_of(value):
            path = write_preview(preview, self.directory / "previews", step)
            self._write(self.PREVIEWS, {
                "step": int(step), "name": preview.name, "kind": preview.kind,
                "path": path.relative_to(self.directory).as_posix(),
            })

    def plot(self) -> list[Path]:
        """Draw every metric of the scalar journal into ``plots/``; return the PNG paths."""
        from dew.telemetry.render import plot_journal

        handle = self._handles.get(self.SCALARS)
        if handle is not None:
            handle.flush()
        return plot_journal(self.directory / self.SCALARS, self.directory / "plots")

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.close()
        if self.plots:
            self.plot()

    def __repr__(self) -> str:
        return f"LocalTracker({str(self.directory)!r}, plots={self.plots})"

