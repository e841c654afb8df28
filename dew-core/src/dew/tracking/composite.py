"""Several trackers as one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dew.errors import DewError
from dew.tracking.protocol import Concludes, Flushes, Located, Outcome, Reported, Tracker

__all__ = ["TrackerFailedError", "Trackers"]


class TrackerFailedError(DewError, RuntimeError):
    """A tracker's own code raised an error dew does not name (a plugin's bug, say)."""


class Trackers:
    """Several trackers as one: every report reaches every sink.

    A sink that raises does not stop the others from receiving the same
    report; once all were attempted, the first failure is raised (the
    others are attached to it as notes).
    """

    def __init__(self, *trackers: Tracker) -> None:
        self.trackers: tuple[Tracker, ...] = tuple(trackers)

    def _each(self, method: str, *args: object, among: tuple[Tracker, ...] | None = None) -> None:
        failures: list[tuple[Tracker, BaseException]] = []
        for tracker in self.trackers if among is None else among:
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # noqa: BLE001 - every sink is attempted
                failures.append((tracker, error))
        if failures:
            tracker, first = failures[0]
            if not isinstance(first, DewError):  # named, not a traceback that blames dew
                at = f" at step {args[-1]}" if method in ("log", "artifact") else ""
                first = TrackerFailedError(
                    f"The tracker {type(tracker).__module__}.{type(tracker).__qualname__} failed in {method}{at}: "
                    f"{type(first).__name__}: {first}. Fix it (or the distribution that ships it), or leave it "
                    "out of the recipe's trackers; a run with checkpoints resumes from its last one.")
                first.__cause__ = failures[0][1]
            for other_tracker, other in failures[1:]:
                first.add_note(f"{type(other_tracker).__name__}.{method} also failed: {other!r}")
            raise first

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._each("log", scalars, step)

    def artifact(self, value: Reported, step: int) -> None:
        self._each("artifact", value, step)

    def close(self) -> None:
        self._each("close")

    def conclude(self, outcome: Outcome) -> None:
        """Tell each tracker that records a run's outcome (Concludes) how it ended."""
        self._each("conclude", outcome, among=tuple(t for t in self.trackers if isinstance(t, Concludes)))

    def flush(self) -> None:
        """Flush each tracker that writes on its own schedule (Flushes)."""
        self._each("flush", among=tuple(t for t in self.trackers if isinstance(t, Flushes)))

    def directories(self) -> Sequence[str]:
        """Where each of the trackers that says where writes, in order."""
        return [where for tracker in self.trackers if isinstance(tracker, Located)
                for where in tracker.directories()]

    def __len__(self) -> int:
        return len(self.trackers)

    def __repr__(self) -> str:
        return f"Trackers({', '.join(repr(t) for t in self.trackers)})"
