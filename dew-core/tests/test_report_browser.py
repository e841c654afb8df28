"""`dew report`'s page opened in a real headless Chromium: every chart and preview loads and
the page is drawn (not blank). Chromium comes from the system's package (Debian's
`chromium`, which .ci/run installs); the test skips only when there is none."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dew.cli.report import render_report

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-extensions"]

# Appended to a copy of the page: once everything has loaded, write each image's
# source and decoded width into the DOM, which --dump-dom then prints.
PROBE = """<script>
window.addEventListener('load', () => {
  const found = [...document.images].map(i => [i.getAttribute('src'), i.complete, i.naturalWidth]);
  const out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
});
</script>"""


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no Chromium on this machine: install Debian's `chromium` package "
                    "(.ci/run does) to run the browser test of dew report")
    return found


def _browser(chromium: str, tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    return subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *arguments],
                          capture_output=True, text=True, timeout=180)


def _runs(tmp_path: Path) -> list[Path]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from test_report import _recipe_run, _run
    finally:
        sys.path.pop(0)
    _run(tmp_path / "one")  # previews (an image and a text), goodput, a non-finite loss
    for name, lr, scale in (("a", 1e-3, 2.0), ("b", 3e-3, 1.0)):
        _recipe_run(tmp_path / name, lr, scale)
    return [tmp_path / "one", tmp_path / "a", tmp_path / "b"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["one run", "two runs overlaid"])
def test_headless_chromium_loads_every_chart_and_preview(tmp_path, which):
    chromium = _chromium()
    one, a, b = _runs(tmp_path)
    page = render_report(one) if which == "one run" else render_report([a, b], tmp_path / "both")
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    result = _browser(chromium, tmp_path, "--virtual-time-budget=10000", "--dump-dom",
                      probe.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r"<pre id=\"probe\">(.*?)</pre>", result.stdout, re.S)
    assert found, f"the probe did not run; Chromium printed:\n{result.stdout[-2000:]}"
    images = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    expected = {"plots/loss.png", "plots/goodput.png"}
    if which == "one run":
        expected |= {"plots/learning_rate.png", "previews/samples/step_00000040/whole.png",
                     "previews/clip/step_00000040/whole.gif"}  # small previews, shown enlarged
    else:
        expected |= {"plots/step_time.png"}
    assert {src for src, _, _ in images} == expected
    for src, complete, width in images:
        assert complete and width > 0, f"{src} did not load in the browser"
        with Image.open(page.parent / src) as decoded:
            assert width == decoded.width  # the browser decoded the very file we wrote

    # A screenshot of the page itself: the charts are painted, in their colours.
    shot = tmp_path / "shot.png"
    result = _browser(chromium, tmp_path, "--window-size=1400,1800", f"--screenshot={shot}",
                      page.as_uri())
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    with Image.open(shot) as image:
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
    assert len(np.unique(pixels, axis=0)) > 200  # not a blank page
    for rgb in ([31, 119, 180], [44, 160, 44]):  # curves (tab:blue) and the goodput bar (green)
        assert np.sum(np.all(np.abs(pixels - rgb) < 20, axis=1)) > 500


# What a person sees, read back from the rendered page: once everything has loaded, the probe
# writes the page's headings in order, each image's size as drawn, the preview captions and
# labels, the samples' text, the notes on missing charts and the recipe tables into the DOM.
SEEN = """<script>
window.addEventListener('load', () => {
  const text = (nodes) => [...nodes].map(n => n.textContent.trim());
  const seen = {
    headings: [...document.querySelectorAll('h2')].map(h => h.id || h.textContent),
    images: [...document.images].map(i => ({src: i.getAttribute('src'), loaded: i.complete && i.naturalWidth > 0,
                                            natural: i.naturalWidth, width: i.getBoundingClientRect().width,
                                            height: i.getBoundingClientRect().height, alt: i.alt})),
    steps: text(document.querySelectorAll('figure.shot > figcaption, figure.sample > figcaption')),
    labels: text(document.querySelectorAll('figcaption.label')),
    samples: text(document.querySelectorAll('figure.sample pre')),
    notes: text(document.querySelectorAll('p.missing')),
    set: [...document.querySelectorAll('#recipe-set tr')].slice(1).map(r => text(r.cells)),
    full: document.querySelector('#recipe-full') ? {
      open: document.querySelector('#recipe-full').open,
      shown: document.querySelector('#recipe-full table').checkVisibility()} : null,
  };
  const out = document.createElement('pre');
  out.id = 'seen';
  out.textContent = JSON.stringify(seen);
  document.body.appendChild(out);
});
</script>"""


def rendered(page: Path, tmp_path: Path) -> dict:
    """The page as headless Chromium draws it (see SEEN); skips without Chromium."""
    chromium = _chromium()
    probe = page.with_name("seen.html")
    probe.write_text(page.read_text().replace("</body>", SEEN + "</body>"))
    result = _browser(chromium, tmp_path, "--window-size=1400,2000", "--virtual-time-budget=10000",
                      "--dump-dom", probe.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r"<pre id=\"seen\">(.*?)</pre>", result.stdout, re.S)
    assert found, f"the probe did not run; Chromium printed:\n{result.stdout[-2000:]}"
    import html

    return json.loads(html.unescape(found.group(1)))


def _previewed_run(directory: Path) -> None:
    """A journal with what a diffusion and a language model show: a labelled 2 x 3 grid of
    8-pixel digits, a labelled grid of two clips, and a text sample, at two steps."""
    from dew.telemetry.artifacts import Artifact
    from dew.tracking.local import LocalTracker

    tracker = LocalTracker(directory)
    for step in (10, 20):
        tracker.log({"train/loss": 1.0 / step, "throughput/tokens_per_second": 1000.0 + step,
                     "throughput/steps_per_second": 2.0, "train/step_time": 0.5}, step)
        tracker.log({"val/loss": 1.5 / step}, step)
        cells = np.zeros((6, 8, 8, 1), np.uint8)
        for index in range(6):
            cells[index, :, index] = 255  # cell i holds a vertical bar at column i
        tracker.artifact(Artifact("samples", "image", cells, labels=tuple(f"class {i}" for i in range(6))), step)
        clips = np.zeros((3, 8, 16, 1), np.uint8)  # two 8x8 clips side by side, three frames
        for frame in range(3):  # each clip brightens or darkens from frame to frame
            clips[frame, :, :8], clips[frame, :, 8:] = 40 + 60 * frame, 200 - 60 * frame
        tracker.artifact(Artifact("clips", "video", clips, labels=("class 0", "class 1"), columns=2), step)
        tracker.artifact(Artifact("sample", "text", f"def __init__(self): # step {step}"), step)
    tracker.close()


@pytest.mark.slow
def test_the_page_leads_with_previews_drawn_large_with_their_labels(tmp_path):
    run = tmp_path / "run"
    _previewed_run(run)
    seen = rendered(render_report(run), tmp_path)
    assert seen["headings"][:2] == ["previews", "charts"]  # the model's work before the curves
    # a 2 x 3 grid of 8-pixel images: six cells, each drawn at least 96 pixels wide, labelled
    cells = [i for i in seen["images"] if "/samples/step_00000020/cell_" in i["src"]]
    assert len(cells) == 6 and all(i["loaded"] and i["width"] >= 96 and i["height"] >= 96 for i in cells)
    assert seen["labels"] == [f"class {i}" for i in range(6)] * 2 + ["class 0", "class 1"] * 2
    clip = next(i for i in seen["images"] if i["src"].endswith("clips/step_00000020/cell_001.gif"))
    assert clip["loaded"] and clip["width"] >= 96
    from PIL import Image

    with Image.open(run / "report" / clip["src"]) as gif:
        assert gif.n_frames == 3  # still a clip, every frame enlarged
    with Image.open(run / "report" / cells[2]["src"]) as cell:  # cell 2 is the bar at column 2
        pixels = np.asarray(cell.convert("L"))
        factor = cell.width // 8
        assert pixels[:, 2 * factor:3 * factor].min() == 255 and pixels[:, :2 * factor].max() == 0
    assert seen["steps"].count("step 20") == 3 and seen["steps"].count("step 10") == 3
    assert "def __init__(self): # step 20" in seen["samples"]
    # throughput in its units, one chart each; validation beside training on the loss chart
    charts = {Path(i["src"]).name for i in seen["images"] if i["src"].startswith("plots/")}
    assert {"loss.png", "tokens_per_second.png", "steps_per_second.png", "step_time.png"} <= charts
    assert "throughput.png" not in charts
    assert seen["notes"] == ["No goodput bar: a fit writes where its wall time went when it ends or is "
                             "stopped, and this one did neither (it failed or was killed, or is still running)."]


@pytest.mark.slow
def test_a_short_runs_page_says_why_charts_are_missing(tmp_path):
    from dew.telemetry.records import RunStarted
    from dew.tracking.local import LocalTracker

    run = tmp_path / "short"
    tracker = LocalTracker(run)
    tracker.artifact(RunStarted(config={"trainer": {"steps": 3, "log_every": 3}}, start=0, steps=3), 0)
    tracker.log({"train/loss": 2.5}, 3)  # one logged step: no rate can be drawn yet
    tracker.close()
    seen = rendered(render_report(run), tmp_path)
    assert seen["notes"][0] == ("No throughput or step-time chart: each is a rate between two logged "
                                "steps, and the run logged one (step 3) (it logs every 3 steps and at "
                                "its last, step 3).")
    empty = tmp_path / "empty"
    tracker = LocalTracker(empty)
    tracker.artifact(RunStarted(config={"trainer": {"steps": 50, "log_every": 100}}, start=0, steps=50), 0)
    tracker.close()
    seen = rendered(render_report(empty), tmp_path)
    # log_every=100 over 50 steps: the fit logs every 5 (dew.training.cadence.log_interval), as said here
    assert seen["notes"] == ["No charts: the journal holds no logged step yet (it logs every 5 steps and "
                             "at its last, step 50); the run stopped, or is still running, before its "
                             "first log."]
    assert not [i for i in seen["images"] if i["src"].startswith("plots/")]
