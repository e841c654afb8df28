"""Where a run's reports go: the Tracker protocol, and what a tracker may be handed.

A tracker receives scalars (``log``) and reports (``artifact``): a preview
(dew.telemetry.artifacts.Artifact) or a typed record (anything with ``type``
and ``to_json()``, see dew.telemetry.records). The trainer never closes a
tracker; whoever built it does. Importing this module imports no JAX, so a
tracker plugin depends on it alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, TypeAlias, runtime_checkable

from dew.errors import DewError
from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import Record, is_record

__all__ = ["Concludes", "Flushes", "Located", "NotAReportError", "Outcome", "Reported", "Tracker", "check_reported"]

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
class Located(Protocol):
    """A tracker that writes where a person can look says where: the trainer prints it.

    Optional beside Tracker: a tracker that keeps its reports elsewhere (a
    server, memory) needs nothing more than log, artifact and close.
    """

    def directories(self) -> Sequence[str]:
        """The directories (or URLs) this tracker writes into."""
        ...


@runtime_checkable
class Flushes(Protocol):
    """A tracker that writes on its own schedule says when everything so far is written.

    Optional beside Tracker: a fit flushes before each checkpoint, so a run
    resumed from that checkpoint finds every step up to it in the tracker. A
    remote in an outage is not waited for (its backlog keeps retrying).
    """

    def flush(self) -> None:
        """Write every report received so far; raise what failed."""
        ...


Outcome: TypeAlias = Literal["finished", "failed", "killed"]
"""How a run ended: trained to its last step, stopped by an error, or stopped by a signal or
Ctrl-C (resumable from its last checkpoint)."""


@runtime_checkable
class Concludes(Protocol):
    """A tracker that records how the run ended (a server's run status) is told before close.

    Optional beside Tracker; ``dew train`` tells it. A tracker closed without
    being told takes the run as finished.
    """

    def conclude(self, outcome: Outcome) -> None:
        """Record the run's outcome; close follows."""
        ...


class NotAReportError(DewError, TypeError):
    """artifact() was given something that is neither a preview nor a record."""


def check_reported(value: object) -> None:
    """Raise NotAReportError unless value is an Artifact or a record."""
    if not (isinstance(value, Artifact) or is_record(value)):
        raise NotAReportError(
            f"A tracker reports an Artifact or a record (an object with a `type` name and "
            f"`to_json()`); got {type(value).__name__}. Log numbers with log() instead."
        )
