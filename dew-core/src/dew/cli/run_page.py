"""The page ``dew report`` writes: one or several LocalTracker runs as charts, previews and tables.

A static HTML file beside PNG charts: nothing runs in the browser and no
server is needed. Metrics are grouped by what they mean, so the charts a
person looks for come first: losses (training and validation together), the
learning rate, throughput, step time, then where the wall time went (goodput);
every other metric gets its own chart. Given several runs, each chart overlays
them in one colour per run.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RunData", "chart_groups", "contained", "flatten", "write_page"]

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")
STYLES = ("-", "--", ":", "-.")
# The charts that gather several metrics, in page order.
GROUPS = ("loss", "learning rate", "throughput", "step time")

Series = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class RunData:
    """What the page shows of one run, read from its directory."""

    directory: Path
    label: str
    series: Series
    records: tuple[dict[str, Any], ...]
    previews: tuple[dict[str, Any], ...]

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
        """The last Goodput record as seconds by part (steps, then each cause), or None."""
        for row in reversed(self.records):
            if row.get("type") == "goodput":
                record = row.get("record", {})
                parts = {"steps": record.get("step_seconds", 0.0)}
                parts.update(record.get("badput", {}))
                return {k: float(v) for k, v in parts.items() if isinstance(v, int | float)}
        return None


def _kind(name: str) -> str:
    leaf = name.rsplit("/", 1)[-1]
    if "loss" in leaf:
        return "loss"
    if leaf in ("lr", "learning_rate"):
        return "learning rate"
    if "step_time" in leaf:
        return "step time"
    if "per_second" in leaf or (name.startswith("throughput/") and leaf != "mfu"):
        return "throughput"
    return ""


def _base(name: str) -> str:
    """A metric's name without its split: train/accuracy, val/accuracy and accuracy share one."""
    head, _, rest = name.partition("/")
    return rest if rest and head in ("train", "val", "eval", "validation") else name


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
        (grouped[kind] if kind else rest.setdefault(_base(name), [])).append(name)
    return [(title, members) for title, members in grouped.items() if members] + sorted(
        rest.items())


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) for every leaf of nested mappings; lists stay whole.

    >>> list(flatten({"model": {"name": "m", "layers": 2}, "seed": 0}))
    [('model.name', 'm'), ('model.layers', 2), ('seed', 0)]
    """
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            yield from flatten(inner, f"{prefix}{key}.")
    else:
        yield prefix[:-1], value


def _number(value: float) -> str:
    return f"{value:.6g}" if math.isfinite(value) else str(value)


def _charts(runs: Sequence[RunData], out: Path) -> list[Path]:
    """The grouped charts, the goodput bar, then one chart per other metric."""
    from dew.telemetry.charts import Line, plot_goodput, plot_lines
    from dew.telemetry.render import safe_name

    several = len(runs) > 1
    paths: list[Path] = []
    varying = {name for run in runs for name, (_, values) in run.series.items()
               if len(set(values[np.isfinite(values)].tolist())) > 1}
    for title, members in chart_groups(sorted({n for run in runs for n in run.series})):
        if title not in GROUPS and not varying.intersection(members):
            continue  # a constant (a count of evaluation batches): the table says it all
        if title not in GROUPS:  # past the grouped charts
            goodput = {run.label: run.goodput for run in runs if run.goodput}
            if goodput and not any(p.stem == "goodput" for p in paths):
                paths.append(plot_goodput(goodput, out / "plots" / "goodput.png"))
        lines = []
        for r, run in enumerate(runs):
            for m, name in enumerate(members):
                if name in run.series:
                    color = COLORS[(r if several else m) % len(COLORS)]
                    lines.append(Line(f"{run.label}: {name}" if several else name,
                                      *run.series[name], color,
                                      STYLES[m % len(STYLES)] if several else "-"))
        paths.append(plot_lines(title, lines, out / "plots" / f"{safe_name(title)}.png",
                                smoothed=title != "learning rate",
                                log_y=True if title == "throughput" else None))
    goodput = {run.label: run.goodput for run in runs if run.goodput}
    if goodput and not any(p.stem == "goodput" for p in paths):
        paths.append(plot_goodput(goodput, out / "plots" / "goodput.png"))
    return paths


def _link(path: Path, out: Path) -> str:
    return html.escape(Path(os.path.relpath(path.resolve(), out.resolve())).as_posix())


def contained(run_dir: Path, name: Any) -> Path | None:
    """run_dir/name with every link resolved, or None when that leads outside run_dir.

    A journal is data, possibly written by someone else: a preview path such as
    ``../../home/me/.netrc``, an absolute path or a symlink out of the run must
    not put another file into the page.
    """
    if not isinstance(name, str) or not name:
        return None
    root = run_dir.resolve()
    target = (root / name).resolve()
    return target if target.is_relative_to(root) else None


def _previews(runs: Sequence[RunData], out: Path) -> list[str]:
    parts = []
    for run in runs:
        by_name: dict[str, list[dict[str, Any]]] = {}
        for row in run.previews:
            by_name.setdefault(row["name"], []).append(row)
        for name, rows in by_name.items():
            title = f"{name} ({run.label})" if len(runs) > 1 else name
            parts.append(f"<h3>{html.escape(title)}</h3><div class='strip'>")
            for row in sorted(rows, key=lambda r: int(r["step"])):
                source = contained(run.directory, row["path"])
                caption = f"step {int(row['step'])}"
                if source is None:
                    refused = f"(refused: {row['path']!r} lies outside the run directory)"
                    parts.append(f"<figure><figcaption>{html.escape(name)} at {caption}"
                                 f"</figcaption><p>{html.escape(refused)}</p></figure>")
                    continue
                if row["kind"] == "text":
                    text = source.read_text(encoding="utf-8") if source.is_file() else "(missing)"
                    body = f"<pre>{html.escape(text)}</pre>"
                else:
                    body = (f"<img class='preview' src='{_link(source, out)}' "
                            f"alt='{html.escape(name)} at {caption}'>")
                parts.append(f"<figure>{body}<figcaption>{caption}</figcaption></figure>")
            parts.append("</div>")
    return parts


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return html.escape(text)


def _recipe(runs: Sequence[RunData]) -> list[str]:
    tables = [dict(flatten(run.recipe)) if run.recipe else {} for run in runs]
    keys = list(dict.fromkeys(key for table in tables for key in table))
    if not keys:
        return []
    head = "".join(f"<th>{html.escape(run.label)}</th>" for run in runs) if len(runs) > 1 \
        else "<th>value</th>"
    parts = ["<h2>Recipe</h2><table class='recipe'><tr><th>field</th>" + head + "</tr>"]
    for key in keys:
        cells = [_cell(table[key]) if key in table else "" for table in tables]
        differs = " class='differs'" if len(set(cells)) > 1 else ""
        parts.append(f"<tr{differs}><td>{html.escape(key)}</td>"
                     + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    parts.append("</table>")
    return parts


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


STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1400px;color:#222}"
    "table{border-collapse:collapse;margin-bottom:1em}td,th{border:1px solid #ccc;padding:2px 8px;"
    "text-align:left;vertical-align:top}tr.differs td{background:#fff3cd}"
    ".grid{display:flex;flex-wrap:wrap;gap:8px}.grid img{width:560px}"
    ".strip{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}"
    "figure{margin:0}figcaption{font-size:small;color:#555;text-align:center}"
    "img.preview{image-rendering:pixelated;max-width:512px;min-width:128px}"
    "pre{background:#f6f6f6;padding:8px;overflow:auto;max-width:640px;white-space:pre-wrap}"
    "summary{cursor:pointer}"
)


def write_page(runs: Sequence[RunData], out: Path) -> Path:
    """Draw the charts into out/plots and write out/index.html; return the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    if len(runs) == 1:
        parts = [f"<h1>dew run {html.escape(str(runs[0].directory.absolute()))}</h1>"]
    else:
        items = "".join(f"<li><span style='color:{COLORS[i % len(COLORS)]}'>&#9632;</span> "
                        f"{html.escape(run.label)}: {html.escape(str(run.directory.absolute()))}"
                        "</li>" for i, run in enumerate(runs))
        parts = [f"<h1>dew runs ({len(runs)})</h1><ul>{items}</ul>"]
    charts = _charts(runs, out)
    if charts:
        parts.append("<h2>Charts</h2><div class='grid'>")
        parts += [f"<img src='{_link(path, out)}' alt='{html.escape(path.stem)}'>"
                  for path in charts]
        parts.append("</div>")
    previews = _previews(runs, out)
    if previews:
        parts += ["<h2>Previews</h2>", *previews]
    parts += _recipe(runs) + _last_values(runs) + _records(runs)
    page = out / "index.html"
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>dew report</title>"
        f"<style>{STYLE}</style></head><body>" + "\n".join(parts) + "</body></html>\n",
        encoding="utf-8",
    )
    return page
