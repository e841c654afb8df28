"""``dew report RUN_DIR``: a LocalTracker journal as PNG plots and one HTML page."""

from __future__ import annotations

import hashlib
import math
import re
import subprocess
import sys
from html.parser import HTMLParser

import numpy as np
import pytest
from PIL import Image

from dew.cli import main
from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import Goodput
from dew.tracking.local import LocalTracker


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
    frames = np.zeros((3, 8, 8, 3), np.uint8)
    frames[1, :, :, 1] = 255
    tracker.artifact(Artifact("clip", "video", frames), 40)
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
    # loss and val/loss share one chart; lr is the learning-rate chart; goodput has its bar;
    # the 16-pixel image and the 8-pixel clip are shown enlarged (copies beside the page)
    assert sources == sorted(["plots/loss.png", "plots/learning_rate.png", "plots/goodput.png",
                              "previews/samples/step_00000040/whole.png",
                              "previews/clip/step_00000040/whole.gif"])
    for source in sources:
        with Image.open(page_path.parent / source) as image:
            assert image.format == ("GIF" if source.endswith(".gif") else "PNG")
    # each enlargement is the preview the run wrote, every pixel a square block (nearest neighbour)
    for source, original in (("previews/samples/step_00000040/whole.png", "previews/samples/step_00000040.png"),
                             ("previews/clip/step_00000040/whole.gif", "previews/clip/step_00000040.gif")):
        with Image.open(page_path.parent / source) as big, Image.open(run / original) as small:
            factor = big.width // small.width
            assert factor * small.width >= 384 and big.size == (small.width * factor, small.height * factor)
            for frame in range(getattr(small, "n_frames", 1)):
                big.seek(frame)
                small.seek(frame)
                pixels = np.asarray(small.convert("RGB"))
                assert np.array_equal(np.asarray(big.convert("RGB")),
                                      pixels.repeat(factor, 0).repeat(factor, 1))
    with Image.open(run / "report/plots/loss.png") as plot:
        assert plot.size == (640, 360)
        # the curve is drawn in matplotlib's first colour (tab:blue, #1f77b4)
        pixels = np.asarray(plot.convert("RGB")).reshape(-1, 3)
        assert np.sum(np.all(np.abs(pixels.astype(int) - [31, 119, 180]) < 30, axis=1)) > 200
        # val/loss (one point) is drawn in the second colour (tab:orange, #ff7f0e) beside it
        assert np.sum(np.all(np.abs(pixels.astype(int) - [255, 127, 14]) < 30, axis=1)) > 10
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


def _recipe_run(directory, learning_rate, scale):
    from dew.telemetry.records import RunStarted

    tracker = LocalTracker(directory)
    tracker.artifact(RunStarted(config={"model": {"name": "causal_transformer", "num_layers": 2},
                                        "optimizer": {"learning_rate": learning_rate}},
                                start=0, steps=30), 0)
    for step in range(1, 31):
        noise = 0.3 * math.sin(step * 1.7)  # a ragged curve, for the smoothing to show
        tracker.log({"train/loss": scale * math.exp(-step / 10) + noise,
                     "train/step_time": 0.01, "evaluation/batches": 5}, step)
    tracker.artifact(Goodput(1.0, 5.0, 3.0, compile_seconds=1.5), 30)
    tracker.close()


def test_several_runs_overlay_in_one_colour_each_with_the_recipe_side_by_side(tmp_path):
    from dew.cli.report import render_report

    for name, lr, scale in (("a", 1e-3, 2.0), ("b", 3e-3, 1.0)):
        _recipe_run(tmp_path / name, lr, scale)
    page_path = render_report([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    page = Page()
    page.feed(page_path.read_text())
    # a constant that is no step time (a count of batches) gets no chart, only its table row
    assert sorted(page.images) == ["plots/goodput.png", "plots/loss.png", "plots/step_time.png"]
    assert "<td>evaluation/batches</td><td>30</td><td>5</td>" in page_path.read_text()
    # and the page says why its chart is missing, where a person looks for the charts
    assert ("No chart for evaluation/batches: each held one value at every logged step (the Last values table "
            "gives it).") in page_path.read_text()
    with Image.open(tmp_path / "out/plots/loss.png") as plot:
        pixels = np.asarray(plot.convert("RGB")).reshape(-1, 3).astype(int)

    def count(rgb, tolerance=30):
        return int(np.sum(np.all(np.abs(pixels - rgb) < tolerance, axis=1)))

    # run a in tab:blue, run b in tab:orange, each bold (smoothed) over faint raw values:
    # the faint line is the colour blended three quarters into the white background
    for rgb in ([31, 119, 180], [255, 127, 14]):
        faint = [round(255 - 0.25 * (255 - c)) for c in rgb]
        assert count(rgb) > 150 and count(faint, 12) > 50
    text = page_path.read_text()
    # the recipe table has a column per run and marks the field that differs
    assert "<th>a</th><th>b</th>" in text
    assert "<tr class='differs'><td>optimizer.learning_rate</td><td>0.001</td><td>0.003</td>" in text
    assert "<tr><td>model.num_layers</td><td>2</td><td>2</td></tr>" in text


def test_two_runs_previews_of_one_name_and_step_are_each_shown_from_their_own_run(tmp_path):
    """The enlarged cells were written to previews/NAME/step_N for every run: the second run's
    overwrote the first's, and both runs' sections showed the second run's pictures."""
    from dew.cli.report import render_report

    for name, channel in (("a", 0), ("b", 2)):
        tracker = LocalTracker(tmp_path / name)
        tracker.log({"loss": 1.0}, 1)
        pixels = np.zeros((8, 16, 3), np.uint8)
        pixels[..., channel] = 255
        tracker.artifact(Artifact("samples", "image", pixels, labels=("x", "y"), columns=2), 1)
        tracker.close()
    page_path = render_report([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    page = Page()
    page.feed(page_path.read_text())
    cells = [source for source in page.images if source.startswith("previews/")]
    assert len(cells) == 4 and len(set(cells)) == 4
    for source in cells:  # run a's cells red, run b's blue, as each run drew them
        with Image.open(page_path.parent / source) as cell:
            red, _, blue = np.asarray(cell.convert("RGB")).reshape(-1, 3).mean(axis=0)
        assert (red, blue) == ((255, 0) if cells.index(source) < 2 else (0, 255)), source


def test_a_report_of_many_runs_gives_each_its_own_colour_and_puts_the_legend_under_the_chart(tmp_path):
    """Runs 1 and 11 were drawn in one colour (ten colours, repeated), and a legend of dozens of lines
    covered the curves and ran off the image."""
    import re

    from dew.cli.report import render_report

    folders = []
    for index in range(12):
        tracker = LocalTracker(tmp_path / f"r{index:02d}")
        for step in range(1, 13):
            tracker.log({"loss": 1.0 + index + 1 / step}, step)
        tracker.close()
        folders.append(tmp_path / f"r{index:02d}")
    page_path = render_report(folders, tmp_path / "out")
    listed = re.findall(r"<li><span style='color:(#[0-9a-f]{6})'>", page_path.read_text())
    assert len(listed) == 12 and len(set(listed)) == 12
    with Image.open(tmp_path / "out/plots/loss.png") as plot:
        assert plot.height > 360  # grown for the legend beneath the axes
        pixels = np.asarray(plot.convert("RGB")).reshape(-1, 3).astype(int)
    for color in listed:  # every run's colour is drawn
        rgb = np.asarray([int(color[i:i + 2], 16) for i in (1, 3, 5)])
        assert np.sum(np.all(np.abs(pixels - rgb) < 12, axis=1)) > 20, color


def test_a_run_named_twice_is_drawn_once_and_a_samples_control_bytes_are_pictured(tmp_path, capsys):
    """runs/a and runs/./a were two runs of one label; a byte-level sample's control bytes went raw
    into the page (grep called it binary); a missing folder was said to hold no journal."""
    from dew.cli.report import render_report

    tracker = LocalTracker(tmp_path / "a")
    tracker.log({"loss": 1.0}, 1)
    tracker.artifact(Artifact("sample", "text", "def\x0c f\x19():\n\treturn"), 1)
    tracker.close()
    page = render_report([tmp_path / "a", tmp_path / "." / "a"], tmp_path / "out").read_text()
    assert page.startswith("<!doctype html><html><head><meta charset='utf-8'><title>dew report</title>")
    assert "<h1>dew run " in page  # one run: no list of runs to tell apart
    assert "def\u240c f\u2419():\n\treturn" in page and "\x0c" not in page and "\x19" not in page
    for missing, said in ((tmp_path / "nowhere", "does not exist"), (tmp_path / "a" / "scalars.jsonl", "is a file")):
        assert main(["report", str(missing)]) == 2
        assert f"{str(missing)!r} {said}. Point dew report at" in capsys.readouterr().err


def test_the_goodput_bar_of_a_resumed_run_sums_its_fits_and_counts_redone_steps_as_lost(tmp_path):
    """The bar showed the last fit alone; its preemption part was always 0, though a resume from an
    older checkpoint trains the steps after it again."""
    from dew.cli.report import load_run
    from dew.cli.run_page import missing_charts
    from dew.telemetry.records import RunStarted

    tracker = LocalTracker(tmp_path)
    for start, end, steps_s, wall in ((0, 20, 10.0, 12.0), (15, 30, 6.0, 7.0), (30, 40, 4.0, 5.0)):
        tracker.artifact(RunStarted(config={}, start=start, steps=40), start)
        tracker.log({"train/loss": 1.0}, end)
        tracker.artifact(Goodput(0.5, wall, steps_s, compile_seconds=0.5), end)
    tracker.artifact(RunStarted(config={}, start=40, steps=50), 40)  # a fit killed before its end
    tracker.close()
    run = load_run(tmp_path)
    parts = run.goodput
    # the first fit trained steps 1-20 in 10 s; the second went back to step 15: a quarter of it was lost
    assert parts["steps"] == pytest.approx(10.0 * 15 / 20 + 6.0 + 4.0)
    assert parts["preemption"] == pytest.approx(10.0 * 5 / 20)
    assert parts["compile"] == pytest.approx(1.5)
    assert sum(parts.values()) == pytest.approx(12.0 + 7.0 + 5.0)  # every fit's wall time, once
    assert any("the latest has not" in note for note in missing_charts([run]))


REPORT_REFUSED = """
import resource, signal, sys
from dew.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
sys.exit(main(["report", sys.argv[1], "--out", sys.argv[2]]))
"""


def test_a_report_the_disk_refuses_is_one_line_and_keeps_the_page_drawn_before(tmp_path, capsys):
    """A chart or page write the disk refused printed a traceback, and a redraw over an earlier
    report had already cut its charts short (they were written in place)."""
    run, out = tmp_path / "run", tmp_path / "out"
    _run(run)
    assert main(["report", str(run), "--out", str(out)]) == 0
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    done = subprocess.run([sys.executable, "-c", REPORT_REFUSED, str(run), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith(f"dew report: The report could not be written to {out} (")
    assert "the page it held before is kept" in done.stderr and "Traceback" not in done.stderr
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # nothing half-drawn beside it
    mine = tmp_path / "mine"  # a folder holding others' files gets the page among them, as before
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    assert main(["report", str(run), "--out", str(mine)]) == 0
    assert (mine / "notes.txt").read_text() == "kept" and (mine / "index.html").is_file()
    # but not where its own entries' names hold a user's page and figures, which it replaced whole
    theirs = tmp_path / "theirs"
    (theirs / "plots").mkdir(parents=True)
    (theirs / "plots" / "figure.png").write_bytes(b"mine")
    (theirs / "index.html").write_text("<p>my page</p>")
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(theirs)]) == 2
    err = capsys.readouterr().err
    assert "holds index.html, plots that dew report did not write" in err and err.count("\n") == 1, err
    assert (theirs / "index.html").read_text() == "<p>my page</p>" and (theirs / "plots" / "figure.png").is_file()


def test_the_goodput_bar_draws_every_part_of_the_wall_time_a_record_names(tmp_path, monkeypatch):
    """An RL fit's rollout and reward seconds were in its Goodput record but not among the bar's parts: a
    GRPO run's bar left out 38% of its wall time and put its share in steps at 3% where the console said 1.7%."""
    from matplotlib.axes import Axes

    from dew.telemetry.charts import GOODPUT_PARTS, plot_goodput

    record = Goodput(first_step_seconds=1.0, wall_seconds=10.0, step_seconds=2.0, compile_seconds=1.0,
                     data_seconds=0.5, checkpoint_seconds=0.5, eval_seconds=0.5, lost_seconds=0.5,
                     rollout_seconds=3.0, reward_seconds=1.0)
    assert {"steps", *record.badput} == {part for part, _ in GOODPUT_PARTS}
    drawn: list[float] = []
    texts: list[str] = []
    real_barh, real_text = Axes.barh, Axes.text
    monkeypatch.setattr(Axes, "barh", lambda self, y, width, *a, **k: (drawn.append(float(np.sum(width))),
                                                                       real_barh(self, y, width, *a, **k))[1])
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **k: (texts.append(s), real_text(self, x, y, s, *a, **k))[1])
    plot_goodput({"grpo": {"steps": record.step_seconds, **record.badput}}, tmp_path / "goodput.png")
    assert math.isclose(sum(drawn), record.wall_seconds) and texts == [" 20% in steps"]


def test_the_sample_printed_at_the_end_of_a_run_pictures_its_control_bytes_as_the_page_does():
    """A byte-level model's sample went to the terminal with its raw control bytes, which the terminal
    acts on (or hides), where the report pictures them."""
    import io
    from types import SimpleNamespace

    import jax

    from dew.recipes.run import show_sample

    class Sampling:
        def preview(self, variables, key):
            return Artifact("sample", "text", "def\x0c f\x19():\n\treturn")

    out = io.StringIO()
    state = SimpleNamespace(averaged=None, params={}, rng=jax.random.key(0), step=3)
    show_sample(Sampling(), state, out=out)  # type: ignore[arg-type]
    assert out.getvalue() == "Sample (sample):\ndef\u240c f\u2419():\n\treturn\n"


def test_a_loss_scale_a_name_clash_a_kept_step_and_a_row_without_its_keys(tmp_path, capsys):
    """train/loss_scale was drawn on the loss chart (its 10 to 1e4 flattening the loss); two metrics
    whose names one file name spells (custom metric, custom_metric) and a metric named goodput wrote
    over each other's chart and the wall-time bar; --out inside a kept step wrote the page among its
    checkpoint; and a preview or record row lacking a key ended in a KeyError's traceback."""
    import json

    run = tmp_path / "run"
    tracker = LocalTracker(run)
    for step in range(1, 6):
        tracker.log({"train/loss": 1.0 / step, "train/loss_scale": 2.0 ** (10 + step), "custom metric": step,
                     "custom_metric": -step, "train/goodput": 0.5 + step / 10}, step)
    tracker.artifact(Goodput(1.5, 10.0, 8.0, compile_seconds=1.0), 5)
    tracker.close()
    assert main(["report", str(run)]) == 0
    page = Page()
    page.feed((run / "report" / "index.html").read_text())
    assert len(page.images) == len(set(page.images)) == 6, page.images  # each chart a file of its own
    assert {"plots/loss.png", "plots/loss_scale.png", "plots/goodput.png"} <= set(page.images), page.images
    clashing = sorted(source for source in page.images if "custom" in source or "goodput-" in source)
    assert clashing == ["plots/custom_metric-2.png", "plots/custom_metric.png", "plots/goodput-2.png"], clashing
    with Image.open(run / "report/plots/goodput.png") as bar, Image.open(run / "report/plots/goodput-2.png") as line:
        assert bar.size != line.size or not np.array_equal(np.asarray(bar), np.asarray(line))
    capsys.readouterr()

    (tmp_path / "kept" / "4" / "state").mkdir(parents=True)
    (tmp_path / "kept" / "run.json").write_text("{}")
    for out in (tmp_path / "kept" / "4", tmp_path / "kept" / "4" / "state" / "page"):
        assert main(["report", str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "lies in step 4 kept in the run" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in (tmp_path / "kept" / "4").iterdir()) == ["state"]
    assert not list((tmp_path / "kept" / "4" / "state").iterdir())

    for journal, row, said in (("previews.jsonl", {"step": 2, "name": "sample"}, "lacks 'kind', 'path'"),
                               ("records.jsonl", {"step": 2, "foo": 1}, "lacks 'type'"),
                               ("records.jsonl", {"step": "2", "type": "goodput"}, "has the step '2', no whole number")):
        broken = tmp_path / f"broken-{journal}"
        broken.mkdir(exist_ok=True)
        (broken / "scalars.jsonl").write_bytes((run / "scalars.jsonl").read_bytes())
        (broken / journal).write_text(json.dumps(row) + "\n")
        assert main(["report", str(broken)]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_metric_that_went_non_finite_is_charted_with_its_steps_marked(tmp_path, capsys):
    """A grad norm of 0 then NaN was left off the page as 'one value at every logged step', and a loss
    whose last steps were NaN or infinite simply ended: the steps that made them are the ones to see."""
    run = tmp_path / "run"
    tracker = LocalTracker(run)
    for step in range(1, 8):
        tracker.log({"train/loss": 1.0 / step if step < 5 else float("nan" if step % 2 else "inf"),
                     "train/grad_norm": 0.0 if step == 1 else float("nan")}, step)
    tracker.close()
    assert main(["report", str(run)]) == 0
    page = Page()
    page.feed((run / "report" / "index.html").read_text())
    assert {"plots/loss.png", "plots/grad_norm.png"} <= set(page.images), page.images
    for chart in ("loss", "grad_norm"):
        with Image.open(run / "report" / "plots" / f"{chart}.png") as image:
            pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
        assert np.sum(np.all(np.abs(pixels - [255, 0, 0]) < 40, axis=1)) > 20, chart  # the red marks


def test_the_goodput_legend_lies_inside_its_image(tmp_path, monkeypatch):
    """Seven entries in one row ran past the image's right edge: 'other', the grey part, had no label."""
    from dew.telemetry import charts

    saved = []
    real = charts._save
    monkeypatch.setattr(charts, "_save", lambda figure, path: (saved.append(figure), real(figure, path))[1])
    record = Goodput(first_step_seconds=1.0, wall_seconds=10.0, step_seconds=2.0, compile_seconds=1.0,
                     data_seconds=0.5, checkpoint_seconds=0.5, eval_seconds=0.5, lost_seconds=0.5,
                     rollout_seconds=3.0, reward_seconds=1.0)
    charts.plot_goodput({"run": {"steps": record.step_seconds, **record.badput}}, tmp_path / "goodput.png")
    figure = saved[0]
    renderer = figure.canvas.get_renderer()
    legend = figure.axes[0].get_legend()
    box, frame = legend.get_window_extent(renderer), figure.bbox
    assert box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1 and box.y1 <= frame.y1 + 1, (box, frame)
    assert len(legend.get_texts()) == sum(1 for value in (record.step_seconds, *record.badput.values()) if value)
