"""LocalTracker's journal, the fan-out, TensorBoard read back through its own reader,
and what a person is told about unknown or missing trackers."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

import numpy as np
import pytest
from PIL import Image

from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import Goodput, RunStarted
from dew.tracking.background import TrackerWriteError
from dew.tracking.composite import TrackerFailedError, Trackers
from dew.tracking.local import LocalTracker
from dew.tracking.protocol import NotAReportError

IMAGE = np.arange(2 * 4 * 5 * 3, dtype=np.uint8).reshape(2, 4, 5, 3)  # two 4x5 RGB images
TEXT = "dew trains jax models.\nsecond line ü"


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_local_journal_rows_spell_non_finite_values(tmp_path):
    tracker = LocalTracker(tmp_path)
    tracker.log({"loss": 0.5, "grad/norm": np.float32(2.0)}, step=1)
    tracker.log({"loss": float("nan"), "up": math.inf, "down": -math.inf}, step=2)
    tracker.close()
    raw = (tmp_path / "scalars.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in raw] == [
        {"step": 1, "loss": 0.5, "grad/norm": 2.0},
        {"step": 2, "loss": "NaN", "up": "+Inf", "down": "-Inf"},
    ]
    assert all("NaN" not in line.replace('"NaN"', "") for line in raw)  # strict JSON


def test_local_records_and_previews_arrive_as_files(tmp_path):
    tracker = LocalTracker(tmp_path)
    goodput = Goodput(2.0, 10.0, 7.0, compile_seconds=1.5, data_seconds=0.5,
                      checkpoint_seconds=0.25, eval_seconds=0.25, lost_seconds=float("inf"))
    tracker.artifact(RunStarted({"lr": 1e-3}, 0, 100, {"data": 1}, 1), step=0)
    tracker.artifact(goodput, step=100)
    tracker.artifact(Artifact("samples", "image", IMAGE), step=100)
    tracker.artifact(Artifact("text/sample", "text", TEXT), step=100)
    with pytest.raises(NotAReportError, match="Artifact or a record"):
        tracker.artifact({"loss": 1.0}, step=1)
    tracker.close()

    records = _lines(tmp_path / "records.jsonl")
    assert [r["type"] for r in records] == ["run_started", "goodput"]
    assert records[0] == {"step": 0, "type": "run_started", "record": {
        "config": {"lr": 1e-3}, "start": 0, "steps": 100, "mesh": {"data": 1}, "processes": 1, "folder": None},
        "scalars_at": 0}  # where the fit's scalar rows begin in scalars.jsonl (none logged before it)
    assert records[1]["record"]["lost_seconds"] == "+Inf"
    assert records[1]["record"]["fraction"] == pytest.approx(0.7)

    previews = {row["name"]: row for row in _lines(tmp_path / "previews.jsonl")}
    png = Image.open(tmp_path / previews["samples"]["path"])
    grid = np.asarray(png)
    # two images side by side in a 1x2 grid, pixels unchanged
    np.testing.assert_array_equal(grid[:, :5], IMAGE[0])
    np.testing.assert_array_equal(grid[:, 5:], IMAGE[1])
    assert (tmp_path / previews["text/sample"]["path"]).read_text(encoding="utf-8") == TEXT


def test_plot_reads_the_journal_and_never_changes_it(tmp_path):
    tracker = LocalTracker(tmp_path, plots=True)
    for step in range(1, 21):
        tracker.log({"loss": 1.0 / step, "lr": 0.1}, step=step)
    tracker.log({"loss": float("nan")}, step=21)
    tracker.flush()  # the tracker thread writes rows a batch at a time
    # A row appended by someone else appears in the plot: plot() reads the file.
    with open(tmp_path / "scalars.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 22, "extra": 3.0}) + "\n")
    before = hashlib.sha256((tmp_path / "scalars.jsonl").read_bytes()).hexdigest()
    paths = tracker.plot()
    assert sorted(p.name for p in paths) == ["extra.png", "loss.png", "lr.png"]
    assert hashlib.sha256((tmp_path / "scalars.jsonl").read_bytes()).hexdigest() == before
    for path in paths:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (640, 360)
            # something was drawn: more than a blank canvas
            assert len(np.unique(np.asarray(image.convert("L")))) > 10
    for path in paths:
        path.unlink()
    tracker.close()  # plots=True draws again on close
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "extra.png", "loss.png", "lr.png"]


class Failing:
    def __init__(self, message):
        self.message = message
        self.closed = False

    def log(self, scalars, step):
        raise RuntimeError(self.message)

    def artifact(self, value, step):
        raise RuntimeError(self.message)

    def close(self):
        self.closed = True
        raise RuntimeError(self.message)


def test_fan_out_reaches_every_sink_and_raises_the_first_failure(tmp_path):
    first, second = LocalTracker(tmp_path / "a"), LocalTracker(tmp_path / "b")
    broken, also_broken = Failing("sink one is down"), Failing("sink two is down")
    fan = Trackers(broken, first, also_broken, second)
    with pytest.raises(TrackerFailedError, match="sink one is down") as caught:
        fan.log({"loss": 1.25}, step=3)
    assert any("sink two is down" in note for note in caught.value.__notes__)
    # A tracker's own error is named with its class and step (a plugin's bug printed a traceback
    # that blamed dew); what it raised stays the cause.
    assert str(caught.value).startswith(f"The tracker {Failing.__module__}.Failing failed in log at step 3: "
                                        "RuntimeError: sink one is down. Fix it")
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="sink one is down"):
        fan.artifact(Artifact("note", "text", "hi"), step=3)
    with pytest.raises(RuntimeError, match="sink one is down"):
        fan.close()
    assert broken.closed and also_broken.closed
    for directory in (tmp_path / "a", tmp_path / "b"):
        assert _lines(directory / "scalars.jsonl") == [{"step": 3, "loss": 1.25}]
        assert (directory / "previews" / "note" / "step_00000003.txt").read_text() == "hi"


def test_local_video_preview_is_an_animated_gif(tmp_path):
    frames = np.zeros((3, 4, 4, 3), np.uint8)
    for index in range(3):
        frames[index, :, :, index] = 255  # red, green, blue
    tracker = LocalTracker(tmp_path)
    tracker.artifact(Artifact("clip", "video", frames), step=7)
    tracker.close()
    with Image.open(tmp_path / "previews/clip/step_00000007.gif") as gif:
        assert gif.n_frames == 3
        for index in range(3):
            gif.seek(index)
            np.testing.assert_array_equal(np.asarray(gif.convert("RGB")), frames[index])


# -- a full disk under the tracking directory ----------------------------------

FULL_DISK = """
import json, os, resource, signal, sys
from dew.tracking.background import TrackerWriteError
from dew.tracking.local import LocalTracker

directory, limit = sys.argv[1], int(sys.argv[2])
if limit:  # no tmpfs: a file-size limit makes writes fail the same way (EFBIG)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
tracker = LocalTracker(directory)
error = None
for step in range(1, 100_000):
    try:
        tracker.log({f"metric/{i:03d}": step + i / 7 for i in range(40)}, step=step)
        if step % 50 == 0:
            tracker.flush()
    except TrackerWriteError as caught:
        error = caught
        break
try:
    tracker.close()
except TrackerWriteError as caught:
    error = error or caught
print(json.dumps({"error": str(error), "step": step}))
"""


def _tmpfs(path, size):
    """path as a small tmpfs when this process may mount one (root), else None."""
    import subprocess

    path.mkdir()
    if os.geteuid() != 0:
        return None
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    return path if done.returncode == 0 else None


def test_a_full_disk_names_the_journal_and_leaves_it_readable(tmp_path):
    import subprocess
    import sys

    from dew.cli.report import render_report
    from dew.telemetry.render import journal_rows

    disk = tmp_path / "disk"
    mounted = _tmpfs(disk, "64k")
    try:
        run = disk / "run"
        result = subprocess.run(
            [sys.executable, "-c", FULL_DISK, str(run), "0" if mounted else str(64 * 1024)],
            capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        outcome = json.loads(result.stdout)
        journal = run / "scalars.jsonl"
        assert str(journal) in outcome["error"]  # the message names the file
        assert ("No space left" if mounted else "File too large") in outcome["error"]
        raw = journal.read_bytes()
        assert raw.endswith(b"\n")  # the failed write was cut back to the last whole row
        rows = list(journal_rows(journal))
        assert len(rows) == raw.count(b"\n") and rows[0]["step"] == 1
        assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
        page = render_report(run, tmp_path / "page")  # dew report reads it
        assert page.exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)


FULL_PREVIEW = """
import resource, signal, sys
from pathlib import Path
from dew.telemetry.artifacts import Artifact
from dew.telemetry.render import write_preview

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # a disk that fills 1000 bytes into a file
try:
    write_preview(Artifact("sample", "text", "x" * 5000), Path(sys.argv[1]), 20)
except OSError as error:
    print("refused:", error.strerror)
"""


def test_a_preview_the_disk_cannot_hold_leaves_no_cut_or_empty_sample(tmp_path):
    """The preview file was written in place: a write that failed left a cut (or empty) step_00000020.txt
    that looked like a real sample, though previews.jsonl never listed it."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", FULL_PREVIEW, str(tmp_path / "previews")],
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "refused: File too large", result.stdout + result.stderr
    assert [p.name for p in (tmp_path / "previews").rglob("*") if p.is_file()] == []


def test_readers_skip_a_torn_last_line_and_refuse_a_damaged_middle(tmp_path):
    from dew.cli.report import render_report
    from dew.telemetry.render import TornJournalError, journal_rows

    tracker = LocalTracker(tmp_path)
    for step in range(1, 4):
        tracker.log({"loss": 1.0 / step}, step=step)
    tracker.close()
    journal = tmp_path / "scalars.jsonl"
    whole = journal.read_text()
    journal.write_text(whole + '{"step": 4, "lo')  # a writer killed mid-line
    assert [row["step"] for row in journal_rows(journal)] == [1, 2, 3]
    assert render_report(tmp_path, tmp_path / "page").exists()
    journal.write_text('{"step": 1, "lo\n' + whole)
    with pytest.raises(TornJournalError, match=r"scalars.jsonl, line 1"):
        list(journal_rows(journal))
    # Rows that parse but are no journal's: named, and `dew report` says so in one line (status 2).
    from dew.cli import main

    for bad, said in (('{"train/loss": 1}', "whose step is None"), ('{"step": "x"}', "whose step is 'x'"),
                      ("[1, 2]", "line 4, is a JSON list")):
        journal.write_text(whole + bad + "\n")
        with pytest.raises(TornJournalError, match=re.escape(said)):
            render_report(tmp_path, tmp_path / "page")
        assert main(["report", str(tmp_path), "--out", str(tmp_path / "page")]) == 2


def test_a_local_tracker_told_not_to_stop_warns_and_counts_what_it_lost(tmp_path):
    from dew.tracking.background import TrackerWarning

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    tracker = LocalTracker(blocked / "run", stop_on_failure=False, close_timeout=0.5)
    with pytest.warns(TrackerWarning) as seen:
        for step in range(1, 4):
            tracker.log({"loss": 1.0}, step=step)  # never raises
        tracker.close()
    messages = [str(w.message) for w in seen]
    assert any(str(blocked / "run") in m and "retrying" in m for m in messages)
    assert any("3 reports (steps 1 to 3)" in m for m in messages)


# -- synchronous reports (the spec's words) ----------------------------------------------------


def test_a_local_tracker_writes_synchronous_reports(tmp_path):
    # The spec (dew.training): "LocalTracker	Writes synchronous reports in a tracking directory."
    # So the row is in the journal when log() returns, without a flush or close; a preview
    # and a record are there when artifact() returns.
    tracker = LocalTracker(tmp_path)
    for step in range(1, 4):
        tracker.log({"loss": 1.0 / step, "bad": float("inf")}, step=step)
        rows = (tmp_path / "scalars.jsonl").read_text().splitlines()
        assert json.loads(rows[-1]) == {"step": step, "loss": 1.0 / step, "bad": "+Inf"}
        assert len(rows) == step
    tracker.artifact(Artifact("sample", "text", "hello"), step=3)
    previews = (tmp_path / "previews.jsonl").read_text().splitlines()
    assert json.loads(previews[-1])["name"] == "sample"
    assert (tmp_path / json.loads(previews[-1])["path"]).read_text() == "hello"
    tracker.close()


def test_a_local_tracker_that_cannot_write_raises_from_the_call_that_failed(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    tracker = LocalTracker(blocked / "run")
    with pytest.raises(TrackerWriteError, match=str(blocked / "run")):
        tracker.log({"loss": 1.0}, step=1)


def test_a_journal_that_is_a_link_is_refused_and_what_it_points_at_is_untouched(tmp_path):
    # A run folder someone shared, its journals swapped for links: a resume appended rows to the
    # file a link named and first cut it back to its last newline (a whole file, without one).
    from dew.data.base import DataPartition
    from dew.telemetry.render import LinkedJournalError
    from dew.training.ledger import RecordLedger

    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"first line\nsecret without a newline")
    run = tmp_path / "run"
    run.mkdir()
    (run / "scalars.jsonl").symlink_to(outside)
    (run / "ledger.jsonl").symlink_to(outside)
    tracker = LocalTracker(run)
    with pytest.raises(TrackerWriteError, match="LinkedJournalError: .*scalars.jsonl is a symbolic link"):
        tracker.log({"loss": 1.0}, step=1)
    tracker.close()
    with pytest.raises(LinkedJournalError, match="ledger.jsonl is a symbolic link"):
        RecordLedger(run).opened(0, None, DataPartition(0, 1))
    assert outside.read_bytes() == b"first line\nsecret without a newline"
    # The run folder itself may be a link (a larger disk): its journals are its own files.
    (tmp_path / "linked").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real").mkdir()
    tracker = LocalTracker(tmp_path / "linked")
    tracker.log({"loss": 1.0}, step=1)
    tracker.close()
    assert json.loads((tmp_path / "real/scalars.jsonl").read_text())["step"] == 1
