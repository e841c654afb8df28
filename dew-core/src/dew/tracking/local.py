"""LocalTracker: a run's reports as JSONL journals and preview files in one directory."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dew.telemetry.records import RunStarted, is_record, previews_of, record_row
from dew.telemetry.render import cut_torn_tail, open_journal
from dew.tracking.background import Channel, Dropped, TrackerWriteError
from dew.tracking.protocol import Reported, check_reported
from dew.tracking.rows import scalar_row

__all__ = ["LocalTracker"]

# One encoder for every row: json.dumps with a keyword builds a fresh one per call.
_ROW = json.JSONEncoder(allow_nan=False, check_circular=False).encode


class LocalTracker:
    """Writes synchronous reports in a directory, one line per report.

    ``scalars.jsonl`` holds one row per ``log`` call, ``records.jsonl`` one
    row per record, ``previews.jsonl`` one row per preview file written under
    ``previews/``. A fit's ``run_started`` row says where its scalar rows
    begin (``scalars_at``, a byte offset), so a reader can drop what a fit
    logged past the step a later fit resumed from. Non-finite values are the strings ``NaN``, ``+Inf`` and
    ``-Inf``. ``plot()`` draws each metric from the journal into ``plots/``;
    nothing is kept in memory between calls.

    Synchronous: when ``log`` or ``artifact`` returns, its row is in the
    journal (one append to an open file; a preview's file is written first).
    A write that fails is truncated back to the last whole line, so a journal
    never holds half a row, and the call that failed raises TrackerWriteError
    naming the file, unless stop_on_failure is False: then it warns, keeps
    the reports and writes them with a later call once a pause has passed
    (``close`` gives up after close_timeout seconds, warning how many reports
    were lost). The remote trackers keep dew's background writer thread.

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

    def __init__(self, directory: str | Path, *, plots: bool = False,
                 stop_on_failure: bool = True, close_timeout: float = 30.0) -> None:
        self.directory = Path(directory)
        self.plots = plots
        # Each open journal and its length in bytes: the length is read once, at open, and
        # advanced by what this tracker writes, so an append is a single system call.
        self._handles: dict[str, tuple[io.FileIO, int]] = {}
        self._channel = Channel(self._send, f"LocalTracker at {self.directory}", synchronous=True,
                                stop_on_failure=stop_on_failure, close_timeout=close_timeout,
                                on_recover=self._recovered)

    def _append(self, journal: str, rows: list[Mapping[str, object]]) -> None:
        """Append rows to journal in one write; on failure cut the file back to whole lines."""
        data = "".join([_ROW(row) + "\n" for row in rows]).encode()
        opened = self._handles.get(journal)
        if opened is None:
            opened = self._open(journal)
        handle, size = opened
        view = memoryview(data)
        try:
            while view:
                view = view[handle.write(view):]
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(handle.fileno(), size)
            raise TrackerWriteError(
                f"LocalTracker could not write {len(rows)} rows to {self.directory / journal} "
                f"(the journal is kept as it was, {size} bytes): {error}") from error
        self._handles[journal] = (handle, size + len(data))

    def _open(self, journal: str) -> tuple[io.FileIO, int]:
        """Open journal for appending (creating the directory), with its present length."""
        path = self.directory / journal
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            cut_torn_tail(path)  # a line a crash cut short would swallow the first one appended
            handle = open_journal(path)  # kept open until close()
            opened = self._handles[journal] = (handle, os.fstat(handle.fileno()).st_size)
        except OSError as error:
            raise TrackerWriteError(f"LocalTracker could not open {path}: {error}") from error
        return opened

    def _length(self, journal: str) -> int:
        """journal's length in bytes as the next append finds it (a torn last line cut): 0 when missing."""
        if journal not in self._handles and not (self.directory / journal).is_file():
            return 0
        return (self._handles.get(journal) or self._open(journal))[1]

    def _send(self, items: list[tuple[str, Any, int]]) -> None:
        """The journals' rows and the preview files of items, in order (on the caller's thread)."""
        rows: dict[str, list[Mapping[str, object]]] = {}
        for kind, value, step in items:
            if kind == "log":
                rows.setdefault(self.SCALARS, []).append(scalar_row(value, step))
                continue
            if is_record(value):
                record = record_row(value, step)
                if isinstance(value, RunStarted):  # where this fit's scalar rows begin (dew report's reader)
                    record["scalars_at"] = self._length(self.SCALARS) + len(
                        "".join(_ROW(row) + "\n" for row in rows.get(self.SCALARS, [])).encode())
                rows.setdefault(self.RECORDS, []).append(record)
            for preview in previews_of(value):
                from dew.telemetry.render import preview_columns, write_preview

                try:
                    path = write_preview(preview, self.directory / "previews", step)
                except OSError as error:
                    raise OSError(f"LocalTracker could not write preview {preview.name!r} "
                                  f"under {self.directory / 'previews'}: {error}") from error
                row: dict[str, object] = {
                    "step": int(step), "name": preview.name, "kind": preview.kind,
                    "path": path.relative_to(self.directory).as_posix(),
                }
                if preview.labels:  # what each cell shows, and the grid's width
                    row["labels"] = list(preview.labels)
                    row["columns"] = preview_columns(preview)
                rows.setdefault(self.PREVIEWS, []).append(row)
        for journal, journal_rows in rows.items():
            self._append(journal, journal_rows)

    def _recovered(self, dropped: Dropped) -> None:
        from dew.telemetry.records import TrackerDropped

        record = TrackerDropped.of(dropped, str(self.directory))
        self._append(self.RECORDS, [record_row(record, dropped.last_step or 0)])

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._channel.submit(("log", dict(scalars), step))

    def artifact(self, value: Reported, step: int) -> None:
        check_reported(value)
        self._channel.submit(("artifact", value, step))

    def directories(self) -> list[str]:
        return [str(self.directory)]

    def flush(self) -> None:
        """Write any report a failed write left waiting; raise what failed (every other report
        is in its journal already)."""
        self._channel.flush()
        self._channel.check()

    def plot(self) -> list[Path]:
        """Draw every metric of the scalar journal into ``plots/``; return the PNG paths."""
        from dew.telemetry.render import plot_journal

        self.flush()
        return plot_journal(self.directory / self.SCALARS, self.directory / "plots")

    def close(self) -> None:
        try:
            self._channel.close()
        finally:
            handles, self._handles = self._handles, {}
            for handle, _ in handles.values():
                handle.close()
        if self.plots:
            self.plot()

    def __repr__(self) -> str:
        return f"LocalTracker({str(self.directory)!r}, plots={self.plots})"
