"""``dew report RUN_DIR``: a LocalTracker journal as PNG plots and one HTML page."""

from __future__ import annotations

import hashlib
import math
import re
import subprocess
import sys
from html.parser import HTMLParser

import numpy as np
from PIL import Image

from dew.cli import main
from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import Goodput
from dew.training.trackers import LocalTracker


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_data(self, data):
        self.text.append(data)


def _run(directory):
    tracker = LocalTracker(directory)
    for step in range(1, 41):
        tracker.log({"loss": 2.0 * math.exp(-step / 10), "lr": 1e-3 * min(1.0, step / 10)}, step)
    tracker.log({"loss": float("inf")}, 41)
    tracker.log({"val/loss": 0.5}, 40)
    pixels = np.zeros((16, 16, 3), np.uint8)
    pixels[:, :8, 0] = 255
    tracker.artifact(Artifact("samples", "image", pixels), 40)
    tracker.artifact(Artifact("story", "text", "<once> upon a time"), 40)
    tracker.artifact(Goodput(1.5, 10.0, 8.0, compile_seconds=1.0), 41)
    tracker.close()


def test_report_renders_plots_and_one_page(tmp_path, capsys):
    run = tmp_path / "run"
    _run(run)
    journal = hashlib.sha256((run / "scalars.jsonl").read_bytes()).hexdigest()
    assert main(["report", str(run)]) == 0
    page_path = run / "report" / "index.html"
    assert str(page_path) in capsys.readouterr().out
    page = Page()
    page.feed(page_path.read_text())
    sources = sorted(page.images)
    assert sources == sorted(["plots/loss.png", "plots/lr.png", "plots/val__loss.png",
                              "../previews/samples/step_00000040.png"])
    for source in sources:
        with Image.open(page_path.parent / source) as image:
            assert image.format == "PNG"
    with Image.open(run / "report/plots/loss.png") as plot:
        assert plot.size == (640, 360)
        # the curve is drawn in matplotlib's first colour (tab:blue, #1f77b4)
        pixels = np.asarray(plot.convert("RGB")).reshape(-1, 3)
        assert np.sum(np.all(np.abs(pixels.astype(int) - [31, 119, 180]) < 30, axis=1)) > 200
    text = "".join(page.text)
    assert "<once> upon a time" in text  # escaped in the page, intact once parsed
    assert "goodput at step 41" in text and '"fraction": 0.8' in text
    # the last value of loss (+Inf) and of lr are in the table
    assert re.search(r"loss41inf", text.replace(" ", "")) and "0.001" in text
    assert hashlib.sha256((run / "scalars.jsonl").read_bytes()).hexdigest() == journal


def test_report_of_a_directory_without_a_journal_says_what_it_needs(tmp_path):
    result = subprocess.run([sys.executable, "-c", "import sys, dew.cli; sys.exit(dew.cli.main())",
                             "report", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "holds no scalars.jsonl" in result.stderr and "LocalTracker" in result.stderr
