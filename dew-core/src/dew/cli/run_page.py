"""The page ``dew report`` writes: one or several LocalTracker runs as previews, charts and tables.

A static HTML file beside PNG charts: nothing runs in the browser and no
server is needed. What the model does comes first: the previews (text
samples, images drawn at a readable size with their labels, clips as GIFs)
by step. Then the charts, grouped by what they mean: losses (training and
validation on one chart), the learning rate, throughput in each of its
units, step time, then where the wall time went (goodput); every other
metric gets its own chart, its validation series beside its training one.
A run that journaled its rollouts (``rollouts.jsonl``: GRPO, PPO) shows
its sampled completions with their rewards, by step, after the previews.
A chart a run cannot have yet (a rate needs two logged steps) is named with
the reason. The recipe is shown as what the run sets, against the defaults,
with the full recipe folded away. Given several runs, each chart overlays
them in one colour per run.
"""

from __future__ import annotations

import html
import json
import math
import os
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from dew.training.rollout_journal import Kept

__all__ = ["PAGE_START", "RunData", "chart_groups", "contained", "flatten", "missing_charts", "write_page"]

LOCAL_PREVIEWS = "previews.jsonl"

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")


def colors(count: int) -> list[str]:
    """A colour for each of count runs (or metrics), no two alike: matplotlib's tab10 up to ten,
    then evenly spaced hues of its turbo map, so the eleventh run is not drawn as the first."""
    if count <= len(COLORS):
        return list(COLORS[:count])
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    turbo = colormaps["turbo"]
    return [to_hex(turbo(0.05 + 0.9 * index / (count - 1))) for index in range(count)]
STYLES = ("-", "--", ":", "-.")
# The charts that gather several metrics, in page order; throughput has one chart per unit.
THROUGHPUT = {"tokens_per_second": "tokens per second", "examples_per_second": "examples per second",
              "steps_per_second": "steps per second", "mfu": "model FLOPs utilization"}
GROUPS = ("loss", "learning rate", *THROUGHPUT.values(), "step time")
# The prefixes of a metric's split: validation and evaluation series chart beside training's.
SPLITS = ("train", "val", "eval", "validation", "val_ema", "eval_ema")
# How many of the latest steps of each preview the page shows.
PREVIEW_STEPS = 8
# How many of the latest journaled rollout steps, and completions of each, the page shows.
ROLLOUT_STEPS, ROLLOUT_ROWS = 8, 8
# Pictures narrower than these are drawn larger (nearest neighbour, so pixels stay sharp).
CELL_WIDTH, GRID_WIDTH = 96, 384

Series = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class RunData:
    """What the page shows of one run, read from its directory."""

    directory: Path
    label: str
    series: Series
    records: tuple[dict[str, Any], ...]
    previews: tuple[dict[str, Any], ...]
    rollouts: Kept | None = None  # the journaled rollouts' transcripts, of the steps the run kept

    @property
    def recipe(self) -> dict[str, Any]:
        """The configuration of the run's last RunStarted record that carries one."""
        for row in reversed(self.records):
            config = row.get("record", {}).get("config") if row.get("type") == "run_started" else None
            if config:
                return config
        return {}

    @property
    def goodput(self) -> dict[str, float] | None:
        """Seconds by part (steps, then each cause) of every fit that wrote its Goodput record (one
        that finished or was stopped on request), summed; None when none did.

        A fit resumed from a checkpoint older than where the fit before it stopped trains those
        steps again: the earlier fit's time in them (its share of that fit's step time) was lost,
        and is counted under preemption rather than steps.
        """
        fits: list[tuple[int | None, int | None, dict[str, Any] | None]] = []  # (start, end, record)
        for row in self.records:
            step = row.get("step") if isinstance(row.get("step"), int) else None
            if row.get("type") == "run_started":
                fits.append((step, None, None))
            elif row.get("type") == "goodput":
                start = fits.pop()[0] if fits and fits[-1][2] is None else None
                fits.append((start, step, row.get("record", {})))
        total: dict[str, float] = {}
        for index, (start, end, record) in enumerate(fits):
            if record is None:
                continue
            parts = {"steps": record.get("step_seconds", 0.0), **record.get("badput", {})}
            parts = {k: float(v) for k, v in parts.items() if isinstance(v, int | float)}
            resumed = next((later for later, _, _ in fits[index + 1:] if later is not None), None)
            if start is not None and end is not None and resumed is not None and resumed < end and start < end:
                lost = parts.get("steps", 0.0) * min(end - resumed, end - start) / (end - start)
                parts["steps"] = parts.get("steps", 0.0) - lost
                parts["preemption"] = parts.get("preemption", 0.0) + lost
            for key, value in parts.items():
                total[key] = total.get(key, 0.0) + value
        return total or None


def _kind(name: str) -> str:
    leaf = name.rsplit("/", 1)[-1]
    if "loss" in leaf and leaf != "loss_scale":  # a loss scaler's factor (10 to 1e4) is no loss
        return "loss"
    if leaf in ("lr", "learning_rate"):
        return "learning rate"
    if "step_time" in leaf:
        return "step time"
    if name.startswith("throughput/") or "per_second" in leaf:
        return THROUGHPUT.get(leaf, leaf.replace("_", " "))
    return ""


def _base(name: str) -> str:
    """A metric's name without its split: train/accuracy, val/accuracy and accuracy share one."""
    head, _, rest = name.partition("/")
    return rest if rest and head in SPLITS else name


def chart_groups(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Charts as (title, metrics): the grouped ones first, then one chart per other metric
    with its training and validation series together.

    >>> chart_groups(["val/loss", "train/loss", "train/lr", "val/accuracy", "accuracy"])
    [('loss', ['train/loss', 'val/loss']), ('learning rate', ['train/lr']), \
('accuracy', ['accuracy', 'val/accuracy'])]
    """
    grouped: dict[str, list[str]] = {title: [] for title in GROUPS}
    rest: dict[str, list[str]] = {}
    # training series before validation ones, so the first colour is the training loss
    for name in sorted(set(names), key=lambda n: (n.startswith(("val", "eval")), n)):
        kind = _kind(name)
        (grouped.setdefault(kind, []) if kind else rest.setdefault(_base(name), [])).append(name)
    return [(title, members) for title, members in grouped.items() if members] + sorted(
        rest.items())


def flatten(value: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, leaf) for every leaf of nested mappings (and lists of them, by index);
    other lists stay whole.

    >>> list(flatten({"model": {"name": "m", "layers": 2}, "seed": 0}))
    [('model.name', 'm'), ('model.layers', 2), ('seed', 0)]
    """
    from dew.recipes.defaults import flat_recipe

    return flat_recipe(value, prefix)


def _number(value: float) -> str:
    return f"{value:.6g}" if math.isfinite(value) else str(value)


def _charts(runs: Sequence[RunData], out: Path) -> list[Path]:
    """The grouped charts, the goodput bar, then one chart per other metric."""
    from dew.telemetry.charts import Line, plot_goodput, plot_lines
    from dew.telemetry.render import safe_name

    several = len(runs) > 1
    paths: list[Path] = []
    taken = {"goodput"}  # the wall-time bar's file; a metric named so gets another
    constant = _constant_charts(runs)
    for title, members in chart_groups(sorted({n for run in runs for n in run.series})):
        if title in constant:
            continue  # a constant (a count of evaluation batches): the table says it all
        if title not in GROUPS:  # past the grouped charts
            goodput = {run.label: run.goodput for run in runs if run.goodput}
            if goodput and not any(p.stem == "goodput" for p in paths):
                paths.append(plot_goodput(goodput, out / "plots" / "goodput.png"))
        lines = []
        palette = colors(len(runs) if several else len(members))
        for r, run in enumerate(runs):
            for m, name in enumerate(members):
                if name in run.series:
                    color = palette[r if several else m]
                    lines.append(Line(f"{run.label}: {name}" if several else name,
                                      *run.series[name], color,
                                      STYLES[m % len(STYLES)] if several else "-"))
        paths.append(plot_lines(title, lines, out / "plots" / f"{_free(safe_name(title), taken)}.png",
                                smoothed=title != "learning rate"))
    goodput = {run.label: run.goodput for run in runs if run.goodput}
    if goodput and not any(p.stem == "goodput" for p in paths):
        paths.append(plot_goodput(goodput, out / "plots" / "goodput.png"))
    return paths


def _free(stem: str, taken: set[str]) -> str:
    """stem, or stem-2, stem-3...: the first a chart has not taken (two metrics whose names differ only
    in what a file name cannot hold, "custom metric" and "custom_metric", drew into one file)."""
    name, number = stem, 1
    while name in taken:
        number += 1
        name = f"{stem}-{number}"
    taken.add(name)
    return name


def _text(text: str) -> str:
    """A model's text for the page: control characters pictured, then escaped."""
    from dew.telemetry.render import pictured

    return html.escape(pictured(text))


def _link(path: Path, out: Path) -> str:
    # Percent-encoded bytes: a name that is no UTF-8 (held in surrogates) still links to its file.
    return html.escape(urllib.parse.quote(os.fsencode(Path(os.path.relpath(path.resolve(), out.resolve())).as_posix())))


def contained(run_dir: Path, name: object) -> Path | None:
    """run_dir/name with every link resolved, or None when that leads outside run_dir.

    A journal is data, possibly written by someone else: a preview path such as
    ``../../home/me/.netrc``, an absolute path or a symlink out of the run must
    not put another file into the page.
    """
    if not isinstance(name, str) or not name:
        return None
    root = run_dir.resolve()
    try:
        target = (root / name).resolve()
    except (ValueError, OSError):  # a NUL byte in the name, or one the system refuses: no file of the run
        return None
    return target if target.is_relative_to(root) else None


def _frames(image: PILImage.Image) -> list[PILImage.Image]:
    from PIL import ImageSequence

    return [frame.copy() for frame in ImageSequence.Iterator(image)]


def _write_scaled(frames: list[PILImage.Image], factor: int, target: Path, duration: object) -> Path:
    """frames (one image, or a GIF's frames) enlarged factor times, nearest neighbour."""
    from PIL import Image

    scaled = [f.resize((f.width * factor, f.height * factor), Image.Resampling.NEAREST) for f in frames]
    target.parent.mkdir(parents=True, exist_ok=True)
    if len(scaled) == 1 and target.suffix == ".png":
        scaled[0].save(target, format="PNG")
    else:
        scaled[0].save(target, format="GIF", save_all=True, append_images=scaled[1:],
                       duration=duration or 125, loop=0)
    return target


def _factor(width: int, wanted: int) -> int:
    return max(1, math.ceil(wanted / max(width, 1)))


def _pictures(source: Path, row: Mapping[str, Any], into: Path) -> list[tuple[Path, str]]:
    """The files the page shows for an image or clip preview, each with its caption: the cells
    of a labelled grid one by one, or the whole picture; enlarged when small (under into, the
    run's own folder of the page's previews)."""
    from PIL import Image

    from dew.telemetry.render import safe_name

    folder = into / safe_name(str(row["name"])) / f"step_{int(row['step']):08d}"
    suffix = source.suffix
    with Image.open(source) as image:
        frames = _frames(image)
        duration = image.info.get("duration")
    width, height = frames[0].size
    labels = [str(label) for label in row.get("labels") or ()]
    columns = int(row.get("columns") or 0)
    if labels and columns > 0:
        rows = math.ceil(len(labels) / columns)
        cell_w, cell_h = width // columns, height // rows
        if cell_w > 0 and cell_h > 0:
            factor = _factor(cell_w, CELL_WIDTH)
            shown = []
            for index, label in enumerate(labels):
                r, c = divmod(index, columns)
                box = (c * cell_w, r * cell_h, (c + 1) * cell_w, (r + 1) * cell_h)
                cell = [frame.crop(box) for frame in frames]
                shown.append((_write_scaled(cell, factor, folder / f"cell_{index:03d}{suffix}",
                                            duration), label))
            return shown
    if width >= GRID_WIDTH // 2:
        return [(source, "")]  # large enough as it is
    return [(_write_scaled(frames, _factor(width, GRID_WIDTH), folder / f"whole{suffix}", duration), "")]


def _previews(runs: Sequence[RunData], out: Path) -> list[str]:
    parts = []
    for index, run in enumerate(runs):
        # Each run's enlarged pictures in a folder of its own: two runs' previews share names and steps.
        into = out / "previews" / (f"run_{index:03d}" if len(runs) > 1 else "")
        by_name: dict[str, list[dict[str, Any]]] = {}
        for row in run.previews:
            by_name.setdefault(row["name"], []).append(row)
        for name, rows in by_name.items():
            title = f"{name} ({run.label})" if len(runs) > 1 else name
            ordered = sorted(rows, key=lambda r: int(r["step"]))
            hidden = len(ordered) - PREVIEW_STEPS
            parts.append(f"<h3>{html.escape(title)}</h3>")
            if hidden > 0:
                parts.append(f"<p class='note'>The latest {PREVIEW_STEPS} steps; {hidden} earlier "
                             f"are listed in {LOCAL_PREVIEWS}.</p>")
            parts.append("<div class='strip'>")
            for row in ordered[-PREVIEW_STEPS:]:
                parts.append(_preview(run, name, row, out, into))
            parts.append("</div>")
    return parts


def _preview(run: RunData, name: str, row: Mapping[str, Any], out: Path, into: Path) -> str:
    """One preview at one step, as a figure captioned with its step."""
    source = contained(run.directory, row["path"])
    caption = f"step {int(row['step'])}"
    if source is None:
        refused = f"(refused: {row['path']!r} lies outside the run directory)"
        return (f"<figure><figcaption>{html.escape(name)} at {caption}</figcaption>"
                f"<p>{html.escape(refused)}</p></figure>")
    if not source.is_file():
        return f"<figure><figcaption>{caption}</figcaption><p>(missing: {html.escape(str(row['path']))})</p></figure>"
    if row["kind"] == "text":
        text = source.read_text(encoding="utf-8", errors="replace")
        return f"<figure class='sample'><figcaption>{caption}</figcaption><pre>{_text(text)}</pre></figure>"
    from PIL import Image

    try:
        pictures = _pictures(source, row, into)
    except (OSError, ValueError, Image.DecompressionBombError) as error:  # not an image after all, or one
        # declaring more pixels than Pillow decodes: say so, show nothing
        return f"<figure><figcaption>{caption}</figcaption><p>(unreadable: {html.escape(str(error))})</p></figure>"
    cells = "".join(
        f"<figure class='cell'><img class='preview' src='{_link(path, out)}' "
        f"alt='{html.escape(name)} at {caption}{(': ' + html.escape(label)) if label else ''}'>"
        + (f"<figcaption class='label'>{html.escape(label)}</figcaption>" if label else "")
        + "</figure>" for path, label in pictures)
    grid = "<div class='cells'>" + cells + "</div>" if len(pictures) > 1 else cells
    return f"<figure class='shot'><figcaption>{caption}</figcaption>{grid}</figure>"


def _rollouts(runs: Sequence[RunData]) -> list[str]:
    """Each run's latest journaled steps: the mean reward, then the first completions with theirs."""
    parts = []
    for run in runs:
        if run.rollouts is None:
            continue
        steps = [entry for entry in run.rollouts.entries if entry.transcript]
        if not steps:
            continue
        shown = steps[-ROLLOUT_STEPS:]
        if len(runs) > 1:
            parts.append(f"<h3>{html.escape(run.label)}</h3>")
        past = (f" {run.rollouts.past} journaled past the last checkpoint (step {run.rollouts.through}) are "
                "not shown: sampled ahead for a step the run did not take, or by steps no checkpoint kept."
                if run.rollouts.past else "")
        parts.append(f"<p class='note'>The latest {len(shown)} of {len(steps)} journaled steps, the first "
                     f"{ROLLOUT_ROWS} completions of each (all of them are in rollouts.jsonl; "
                     f"dew rescore scores them with another reward).{past}</p>")
        parts.append("<table class='rollouts'><tr><th>step</th><th>prompt</th><th>completion</th>"
                     "<th>reward</th></tr>")
        for entry in shown:
            rows = [(p, c, r) for round_ in entry.transcript
                    for p, c, r in zip(round_.get("prompts") or [],
                                       round_.get("episodes") or round_.get("completions") or [],
                                       round_.get("rewards") or [], strict=False)]
            rewards = [float(r) for _, _, r in rows]
            mean = _number(float(np.mean(rewards))) if rewards else "-"
            for index, (prompt, completion, reward) in enumerate(rows[:ROLLOUT_ROWS]):
                head = (f"<td rowspan='{min(len(rows), ROLLOUT_ROWS)}'>{entry.step + 1}<br>"  # steps done
                        f"<span class='note'>{len(rows)} sampled, mean {mean}</span></td>") if index == 0 else ""
                parts.append(f"<tr>{head}<td><pre>{_text(str(prompt))}</pre></td>"
                             f"<td><pre>{_text(str(completion))}</pre></td>"
                             f"<td>{_number(float(reward))}</td></tr>")
        parts.append("</table>")
    return ["<h2 id='rollouts'>Rollouts</h2>", *parts] if parts else []


def _cell(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return html.escape(text)


def _recipe(runs: Sequence[RunData]) -> list[str]:
    """What each run sets against the defaults, then the full recipe folded away."""
    from dew.recipes.defaults import defaults_of

    tables = [dict(flatten(run.recipe)) if run.recipe else {} for run in runs]
    keys = list(dict.fromkeys(key for table in tables for key in table))
    if not keys:
        return []
    defaults = []
    for run in runs:
        try:
            defaults.append(defaults_of(run.recipe) if run.recipe else {})
        except Exception:  # noqa: BLE001 - a recipe this dew cannot read: every field counts as set
            defaults.append({})
    several = len(runs) > 1
    head = "".join(f"<th>{html.escape(run.label)}</th>" for run in runs) if several else "<th>value</th>"

    def cells(key: str) -> list[str]:
        return [_cell(table[key]) if key in table else "" for table in tables]

    def sets(index: int, key: str) -> bool:
        return key in tables[index] and (key not in defaults[index]
                                         or defaults[index][key] != tables[index][key])

    chosen = [key for key in keys
              if any(sets(i, key) for i in range(len(runs))) or len(set(cells(key))) > 1]
    who = "each run sets" if several else "the run sets"
    parts = [f"<h2>Recipe</h2><p class='note'>The fields {who} ({len(chosen)} of {len(keys)}); "
             "every other field keeps its default. The full recipe is folded below.</p>",
             f"<table class='recipe' id='recipe-set'><tr><th>field</th>{head}<th>default</th></tr>"]
    for key in chosen:
        known = {_cell(d[key]) for d in defaults if key in d}
        default = known.pop() if len(known) == 1 else ("(none)" if not known else "(differs)")
        differs = " class='differs'" if len(set(cells(key))) > 1 else ""
        parts.append(f"<tr{differs}><td>{html.escape(key)}</td>"
                     + "".join(f"<td>{c}</td>" for c in cells(key))
                     + f"<td class='default'>{default}</td></tr>")
    parts.append("</table>")
    parts.append(f"<details id='recipe-full'><summary>The full recipe ({len(keys)} fields)</summary>"
                 f"<table class='recipe'><tr><th>field</th>{head}</tr>")
    for key in keys:
        differs = " class='differs'" if len(set(cells(key))) > 1 else ""
        parts.append(f"<tr{differs}><td>{html.escape(key)}</td>"
                     + "".join(f"<td>{c}</td>" for c in cells(key)) + "</tr>")
    parts.append("</table></details>")
    return parts


def _constant_charts(runs: Sequence[RunData]) -> list[str]:
    """The ungrouped charts left off the page: every series in them held one value throughout (a
    series that went NaN or infinite did not: its chart marks where)."""
    varying = {name for run in runs for name, (_, values) in run.series.items()
               if len(set(values[np.isfinite(values)].tolist())) > 1 or not np.all(np.isfinite(values))}
    return [title for title, members in chart_groups(sorted({n for run in runs for n in run.series}))
            if title not in GROUPS and not varying.intersection(members)]


def _started(run: RunData) -> dict[str, Any]:
    for row in reversed(run.records):
        if row.get("type") == "run_started":
            return dict(row.get("record") or {})
    return {}


def missing_charts(runs: Sequence[RunData]) -> list[str]:
    """Why a chart a person looks for is not on the page: one sentence per run and reason."""
    notes = []
    for run in runs:
        who = f"{run.label}: " if len(runs) > 1 else ""
        logged = sorted({int(s) for steps, _ in run.series.values() for s in steps})
        started = _started(run)
        trainer = (run.recipe.get("trainer") or {}) if isinstance(run.recipe, Mapping) else {}
        every, steps = trainer.get("log_every"), started.get("steps")
        if isinstance(every, int) and isinstance(steps, int) and every > 0:
            from dew.training.cadence import log_interval

            every = log_interval(steps, every)  # what the fit logged at: a run shorter than log_every logs more
        cadence = (f" (it logs every {'step' if every == 1 else f'{every} steps'} and at its last, step {steps})"
                   if every and steps else "")
        if not logged:
            notes.append(f"{who}No charts: the journal holds no logged step yet{cadence}; the run "
                         "stopped, or is still running, before its first log.")
            continue
        rates = [name for name in run.series if name.startswith("throughput/") or "step_time" in name]
        if not rates and len(logged) < 2:
            notes.append(f"{who}No throughput or step-time chart: each is a rate between two "
                         f"logged steps, and the run logged one (step {logged[0]}){cadence}.")
        if run.goodput is None:
            notes.append(f"{who}No goodput bar: a fit writes where its wall time went when it "
                         "ends or is stopped, and this one did neither (it failed or was killed, or is still "
                         "running).")
        elif _unended(run.records):
            notes.append(f"{who}The goodput bar counts the fits that ended; the latest has not (it was "
                         "killed, or is still running).")
    if constant := _constant_charts(runs):
        notes.append(f"No chart for {', '.join(constant)}: each held one value at every logged step "
                     "(the Last values table gives it).")
    return notes


def _unended(records: Sequence[dict[str, Any]]) -> bool:
    """Whether the latest fit of a journal wrote no Goodput record (it was killed, or runs still)."""
    kinds = [row.get("type") for row in records if row.get("type") in ("run_started", "goodput")]
    return bool(kinds) and kinds[-1] == "run_started"


def _last_values(runs: Sequence[RunData]) -> list[str]:
    if not any(run.series for run in runs):
        return []
    several = len(runs) > 1
    parts = ["<h2>Last values</h2><table><tr>" + ("<th>run</th>" if several else "")
             + "<th>metric</th><th>step</th><th>value</th><th>min</th><th>max</th></tr>"]
    for run in runs:
        for name, (steps, values) in sorted(run.series.items()):
            finite = values[np.isfinite(values)]
            low = _number(float(finite.min())) if len(finite) else "-"
            high = _number(float(finite.max())) if len(finite) else "-"
            label = f"<td>{html.escape(run.label)}</td>" if several else ""
            parts.append(f"<tr>{label}<td>{html.escape(name)}</td><td>{int(steps[-1])}</td>"
                         f"<td>{_number(float(values[-1]))}</td><td>{low}</td><td>{high}</td></tr>")
    parts.append("</table>")
    return parts


def _records(runs: Sequence[RunData]) -> list[str]:
    from dew.telemetry.render import safe_name

    rows = [(run, row) for run in runs for row in run.records]
    if not rows:
        return []
    parts = ["<h2>Records</h2>"]
    for run, row in rows:
        body = json.dumps(row.get("record", row), indent=1)
        where = f" ({html.escape(run.label)})" if len(runs) > 1 else ""
        parts.append(f"<details id='{safe_name(row['type'])}-{int(row['step'])}'><summary>"
                     f"{html.escape(row['type'])} at step {int(row['step'])}{where}</summary>"
                     f"<pre>{html.escape(body)}</pre></details>")
    return parts


PAGE_START = "<!doctype html><html><head><meta charset='utf-8'><title>dew report</title>"  # how dew's page begins


STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1400px;color:#222}"
    "table{border-collapse:collapse;margin-bottom:1em}td,th{border:1px solid #ccc;padding:2px 8px;"
    "text-align:left;vertical-align:top}tr.differs td{background:#fff3cd}td.default{color:#777}"
    ".grid{display:flex;flex-wrap:wrap;gap:8px}.grid img{width:560px}"
    ".strip{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}"
    ".cells{display:flex;flex-wrap:wrap;gap:6px;max-width:960px}"
    "figure{margin:0}figcaption{font-size:small;color:#555;text-align:center}"
    "figcaption.label{color:#222}img.preview{image-rendering:pixelated;display:block}"
    "pre{background:#f6f6f6;padding:8px;overflow:auto;max-width:640px;white-space:pre-wrap}"
    "p.note{color:#555}summary{cursor:pointer}"
)


def write_page(runs: Sequence[RunData], out: Path) -> Path:
    """Draw the charts into out/plots, the previews' enlargements into out/previews, and write
    out/index.html; return the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    if len(runs) == 1:
        parts = [f"<h1>dew run {html.escape(str(runs[0].directory.absolute()))}</h1>"]
    else:
        items = "".join(f"<li><span style='color:{color}'>&#9632;</span> "
                        f"{html.escape(run.label)}: {html.escape(str(run.directory.absolute()))}"
                        "</li>" for color, run in zip(colors(len(runs)), runs, strict=True))
        parts = [f"<h1>dew runs ({len(runs)})</h1><ul>{items}</ul>"]
    previews = _previews(runs, out)
    if previews:
        parts += ["<h2 id='previews'>Previews</h2>", *previews]
    parts += _rollouts(runs)
    charts = _charts(runs, out)
    parts.append("<h2 id='charts'>Charts</h2>")
    parts += [f"<p class='note missing'>{html.escape(note)}</p>" for note in missing_charts(runs)]
    if charts:
        parts.append("<div class='grid'>")
        parts += [f"<img src='{_link(path, out)}' alt='{html.escape(path.stem)}'>"
                  for path in charts]
        parts.append("</div>")
    parts += _recipe(runs) + _last_values(runs) + _records(runs)
    page = out / "index.html"
    page.write_text(
        PAGE_START + f"<style>{STYLE}</style></head><body>" + "\n".join(parts) + "</body></html>\n",
        encoding="utf-8",
        errors="backslashreplace",  # a run's folder named in bytes that are no UTF-8: shown escaped
    )
    return page
