"""Several trackers as one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dew.tracking.protocol import Located, Reported, Tracker

__all__ = ["Trackers"]


class Trackers:
    """Several trackers as one: every report reaches every sink.

    A sink that raises does not stop the others from receiving the same
    report; once all were attempted, the first failure is raised (the
    others are attached to it as notes).
    """

    def __init__(self, *trackers: Tracker) -> None:
        self.trackers: tuple[Tracker, ...] = tuple(trackers)

    def _each(self, method: str, *args: object) -> None:
        failures: list[tuple[Tracker, BaseException]] = []
        for tracker in self.trackers:
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # noqa: BLE001 - every sink is attempted
                failures.append((tracker, error))
        if failures:
            first = failures[0][1]
            for tracker, other in failures[1:]:
                first.add_note(f"{type(tracker).__name__}.{method} also failed: {other!r}")
            raise first

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._each("log", scalars, step)

    def artifact(self, value: Reported, step: int) -> None:
        self._each("artifact", value, step)

    def close(self) -> None:
        self._each("close")

    def directories(self) -> Sequence[str]:
        """Where each of the trackers that says where writes, in order."""
        return [where for tracker in self.trackers if isinstance(tracker, Located)
                for where in tracker.directories()]

    def __len__(self) -> int:
        return len(self.trackers)

    def __repr__(self) -> str:
        return f"Trackers({', '.join(repr(t) for t in self.trackers)})"
