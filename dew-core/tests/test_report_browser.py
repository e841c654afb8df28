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
        expected |= {"plots/learning_rate.png", "../previews/samples/step_00000040.png",
                     "../previews/clip/step_00000040.gif"}
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
