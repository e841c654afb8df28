"""Tracker directories checked before a run trains into them."""

from __future__ import annotations

import tempfile
from pathlib import Path

from dew.tracking.background import TrackerWriteError
from dew.tracking.protocol import Located, Tracker

__all__ = ["check_directories"]


def check_directories(tracker: Tracker | None) -> None:
    """Refuse, before step 1, a tracker directory this process cannot write into.

    A tracker opens its files lazily (TensorBoard's event file with the first
    value), so an unwritable directory would otherwise be found at the first
    log, after the steps before it trained. A URL (``scheme://``) is the
    tracker's own to reach. Raises TrackerWriteError naming the directory.
    """
    if not isinstance(tracker, Located):
        return
    for where in tracker.directories():
        if "://" in where:
            continue
        try:
            Path(where).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=where):
                pass
        except OSError as error:
            raise TrackerWriteError(
                f"The tracker directory {Path(where).absolute()} cannot be written ({type(error).__name__}: "
                f"{error.strerror or error}); nothing was trained. Point the tracker at a directory "
                "this process can write.") from None
