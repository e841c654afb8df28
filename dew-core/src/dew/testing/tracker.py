"""TrackerKit: what a tracker writes reads back through its own reader; closing is safe.

A tracker receives scalars with ``log(scalars, step)``, reports with
``artifact(value, step)`` and ends with ``close()``. Subclass and supply a
tracker writing under a directory, and a reader that goes through the
backend's own client (TensorBoard's event reader, MLflow's client, the
files W&B writes) rather than the tracker's code::

    class TestMyTracker(TrackerKit):
        def tracker(self, directory):
            return MyTracker(directory)

        def read_back(self, directory):
            return {name: [(step, value), ...], ...}

``read_back`` returns every scalar series by name as (step, value) pairs.
``log`` may be called more than once for one step (a run logs validation
and training scalars apart), each call with names of its own: all are kept.
``log`` runs on the training thread, between steps: the kit times it and
refuses a tracker whose median call takes longer than ``log_budget``
seconds (a network round trip, say), which should hand its writes to a
thread of its own (``dew.tracking.background.Channel``) instead.

A backend that cannot store NaN or infinities says so in its documentation
and sets ``non_finite``: ``"clipped"`` when NaN reads back but an infinity
comes back as the largest float (MLflow's store), ``"dropped"`` when none of
them is stored. The kit then checks that logging them does not fail and
that the finite values around them arrive.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

__all__ = ["TrackerKit"]

Series = Mapping[str, Sequence[tuple[int, float]]]


class TrackerKit:
    """Conformance tests for a tracker (see the module docstring)."""

    non_finite: Literal["kept", "clipped", "dropped"] = "kept"
    rtol: float = 1e-6
    log_budget: float = 0.005  # seconds a median log() call may take on the training thread

    def tracker(self, directory: Path) -> Any:
        """A fresh tracker that writes under directory."""
        raise NotImplementedError(f"{type(self).__name__} must define tracker(directory).")

    def read_back(self, directory: Path) -> Series:
        """Every scalar the closed tracker wrote, read with the backend's own reader."""
        raise NotImplementedError(f"{type(self).__name__} must define read_back(directory).")

    def _series(self, directory: Path, name: str) -> list[tuple[int, float]]:
        series = self.read_back(directory)
        assert name in series, f"read_back found no series {name!r}; it found {sorted(series)}."
        return sorted((int(s), float(v)) for s, v in series[name])

    def test_scalars_read_back(self, tmp_path: Path) -> None:
        tracker = self.tracker(tmp_path)
        written = {step: {"loss": 1.0 / step, "train/lr": 0.5 * step} for step in (1, 2, 3, 5)}
        for step, scalars in written.items():
            tracker.log(scalars, step=step)
        tracker.close()
        for name in ("loss", "train/lr"):
            got = self._series(tmp_path, name)
            expected = [(step, scalars[name]) for step, scalars in written.items()]
            assert [s for s, _ in got] == [s for s, _ in expected], (
                f"{name!r} read back at steps {[s for s, _ in got]}, written at {[s for s, _ in expected]}.")
            for (step, value), (_, want) in zip(got, expected, strict=True):
                assert math.isclose(value, want, rel_tol=self.rtol), (
                    f"{name!r} at step {step} read back as {value}, written as {want}.")

    def test_one_step_logged_twice_keeps_both(self, tmp_path: Path) -> None:
        """A run logs a step's validation and its training scalars in two calls (in either order at
        the last step): a tracker keyed by step alone kept one call and lost the other's names."""
        tracker = self.tracker(tmp_path)
        tracker.log({"val/loss": 0.75}, step=2)
        tracker.log({"loss": 0.5, "train/lr": 0.1}, step=2)
        tracker.log({"loss": 0.25, "train/lr": 0.2}, step=3)
        tracker.log({"val/loss": 0.125}, step=3)
        tracker.close()
        for name, expected in (("val/loss", [(2, 0.75), (3, 0.125)]), ("loss", [(2, 0.5), (3, 0.25)])):
            got = self._series(tmp_path, name)
            assert got == expected, (
                f"{name!r} read back as {got}, logged as {expected}: log may be called more than once for a "
                "step, each call with names of its own, and every call's names must be kept.")

    def test_non_finite_values_are_logged(self, tmp_path: Path) -> None:
        tracker = self.tracker(tmp_path)
        tracker.log({"loss": 1.0}, step=1)
        tracker.log({"loss": float("nan")}, step=2)
        tracker.log({"loss": float("inf")}, step=3)
        tracker.log({"loss": float("-inf")}, step=4)
        tracker.log({"loss": 0.5}, step=5)
        tracker.close()
        got = dict(self._series(tmp_path, "loss"))
        assert got.get(1) == 1.0 and got.get(5) == 0.5, (
            f"The finite values around non-finite ones did not arrive: read back {got}.")
        if self.non_finite == "dropped":
            return
        assert 2 in got and math.isnan(got[2]), f"NaN at step 2 read back as {got.get(2)}."
        largest = sys.float_info.max if self.non_finite == "clipped" else math.inf
        assert got.get(3) == largest, f"+inf at step 3 read back as {got.get(3)}, expected {largest}."
        assert got.get(4) == -largest, f"-inf at step 4 read back as {got.get(4)}, expected {-largest}."

    def test_log_does_not_block_the_step(self, tmp_path: Path) -> None:
        tracker = self.tracker(tmp_path)
        seconds = []
        try:
            for step in range(1, 65):
                began = time.perf_counter()
                tracker.log({"loss": 1.0 / step, "train/lr": 0.001}, step=step)
                seconds.append(time.perf_counter() - began)
        finally:
            tracker.close()
        median = statistics.median(seconds)
        assert median <= self.log_budget, (
            f"log() took {median * 1e3:.2f} ms per call (median of 64), over the {self.log_budget * 1e3:g} ms a "
            "step can wait: write from a thread of the tracker's own (dew.tracking.background.Channel).")
        assert len(self._series(tmp_path, "loss")) == 64, "Not every logged step read back after close()."

    def test_close_twice_is_safe(self, tmp_path: Path) -> None:
        tracker = self.tracker(tmp_path)
        tracker.log({"loss": 2.0}, step=1)
        tracker.close()
        tracker.close()
        assert self._series(tmp_path, "loss") == [(1, 2.0)]

    def test_close_without_logging_is_safe(self, tmp_path: Path) -> None:
        tracker = self.tracker(tmp_path)
        tracker.close()
        tracker.close()
