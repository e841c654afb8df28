"""``dew report`` reads preview files only from inside the run directory.

A hostile journal names files outside the run (``../x``, an absolute path, a
symlink that leaves the run); none of their contents reaches the page, nor
any link to them, and the previews the run itself wrote still do.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dew.cli import main
from dew.telemetry.artifacts import Artifact
from dew.tracking.local import LocalTracker
from test_report import Page

SECRET = "TOPSECRET-do-not-render"


@pytest.fixture
def hostile_run(tmp_path):
    outside = tmp_path / "home"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    (outside / "secret.png").write_bytes(b"\x89PNG not really")
    run = tmp_path / "runs" / "run"
    tracker = LocalTracker(run)
    tracker.log({"loss": 1.0}, 1)
    tracker.artifact(Artifact("story", "text", "the run's own text"), 1)
    pixels = np.zeros((4, 4, 3), np.uint8)
    tracker.artifact(Artifact("samples", "image", pixels), 1)
    tracker.close()
    (run / "previews" / "link.txt").symlink_to(outside / "secret.txt")
    hostile = [
        {"step": 2, "name": "dotdot", "kind": "text", "path": "../../home/secret.txt"},
        {"step": 2, "name": "absolute", "kind": "text", "path": str(outside / "secret.txt")},
        {"step": 2, "name": "symlink", "kind": "text", "path": "previews/link.txt"},
        {"step": 2, "name": "image_out", "kind": "image", "path": str(outside / "secret.png")},
        {"step": 2, "name": "image_up", "kind": "image", "path": "../../home/secret.png"},
    ]
    with open(run / LocalTracker.PREVIEWS, "a", encoding="utf-8") as handle:
        for row in hostile:
            handle.write(json.dumps(row) + "\n")
    return run, outside


@pytest.mark.parametrize("elsewhere", [False, True], ids=["default_out", "out_elsewhere"])
def test_report_refuses_preview_paths_outside_the_run(hostile_run, tmp_path, elsewhere):
    run, outside = hostile_run
    out = tmp_path / "pages" if elsewhere else run / "report"
    assert main(["report", str(run), "--out", str(out)]) == 0
    html_text = (out / "index.html").read_text()
    assert SECRET not in html_text
    page = Page()
    page.feed(html_text)
    text = "".join(page.text)
    assert "the run's own text" in text
    for name in ("dotdot", "absolute", "symlink", "image_out", "image_up"):
        assert f"{name} at step 2(refused:" in text.replace("\n", "")
    assert len(page.images) == 2  # the loss plot and the run's own image preview
    for source in page.images:
        assert "home" not in source and "secret" not in source
        assert (out / source).resolve().is_relative_to(tmp_path.resolve())
        assert (out / source).resolve().is_file()
    assert not [p for p in out.rglob("*") if SECRET in (p.read_text(errors="ignore") if p.is_file() else "")]


def test_a_report_folder_that_is_a_link_is_refused_and_its_target_untouched(hostile_run, tmp_path, capsys):
    # A shared run whose report/ links to a folder of the reader's own: the page was written over
    # that folder's index.html.
    run, outside = hostile_run
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("my own homepage")
    (site / "notes.txt").write_text("mine")
    (run / "report").symlink_to(site, target_is_directory=True)
    assert main(["report", str(run)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert sorted(p.name for p in site.iterdir()) == ["index.html", "notes.txt"]
    assert (site / "index.html").read_text() == "my own homepage"


def test_links_planted_in_a_report_folder_among_others_files_are_replaced_not_written_through(tmp_path):
    """report/ held a file of someone's (so the page was written in place) and links named index.html and
    plots: dew report wrote its page over the file index.html pointed at and its charts into plots' target."""
    run = tmp_path / "run"
    tracker = LocalTracker(run)
    for step in (1, 2):
        tracker.log({"loss": 1.0 / step}, step)
    tracker.close()
    (tmp_path / "victim.txt").write_text("precious")
    (tmp_path / "victimdir").mkdir()
    report = run / "report"
    report.mkdir()
    (report / "notes.txt").write_text("mine")
    (report / "index.html").symlink_to(tmp_path / "victim.txt")
    (report / "plots").symlink_to(tmp_path / "victimdir", target_is_directory=True)
    assert main(["report", str(run)]) == 0
    assert (tmp_path / "victim.txt").read_text() == "precious" and not list((tmp_path / "victimdir").iterdir())
    assert not (report / "index.html").is_symlink() and (report / "index.html").read_text().startswith("<!doctype")
    assert not (report / "plots").is_symlink() and (report / "plots" / "loss.png").is_file()
    assert (report / "notes.txt").read_text() == "mine"  # others' files stay


def test_hostile_journal_rows_are_refused_or_shown_as_unreadable_not_raised(tmp_path, capsys):
    """A preview path holding a NUL byte, a PNG declaring 30000 x 30000 pixels and a metric named with
    matplotlib's mathtext each ended dew report with a traceback."""
    import struct
    import zlib

    run = tmp_path / "run"
    tracker = LocalTracker(run)
    for step in (1, 2):
        tracker.log({"loss": 1.0 / step, "x$\\frac{$": float(step)}, step)
    tracker.close()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    (run / "previews").mkdir(exist_ok=True)
    (run / "previews" / "bomb.png").write_bytes(bomb)
    with open(run / LocalTracker.PREVIEWS, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"step": 2, "name": "nul", "kind": "text", "path": "a\u0000b"}) + "\n")
        handle.write(json.dumps({"step": 2, "name": "bomb", "kind": "image", "path": "previews/bomb.png"}) + "\n")
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    page = Page()
    page.feed((run / "report" / "index.html").read_text())
    text = "".join(page.text).replace("\n", "")
    assert "nul at step 2(refused:" in text and "step 2(unreadable: Image size (900000000 pixels)" in text
