"""``dew report RUN_DIR``: a LocalTracker's journal as PNG plots and one HTML page."""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from pathlib import Path
from typing import Any

__all__ = ["NoJournalError", "add_arguments", "render_report", "run"]


class NoJournalError(FileNotFoundError):
    """The directory holds no LocalTracker journal to report on."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="a LocalTracker directory (it holds scalars.jsonl)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the page and plots (default: RUN_DIR/report)")


def run(args: argparse.Namespace) -> int:
    try:
        page = render_report(args.run_dir, args.out)
    except NoJournalError as error:
        print(f"dew report: {error}", file=sys.stderr)
        return 2
    print(f"Wrote {page}")
    return 0


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    from dew.telemetry.render import journal_rows

    return list(journal_rows(path))


def _contained(run_dir: Path, name: Any) -> Path | None:
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


def _number(value: float) -> str:
    return f"{value:.6g}" if math.isfinite(value) else str(value)


def render_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Plot every metric of run_dir's journal and write ``index.html`` beside the plots.

    Returns the page's path. The journal is only read.
    """
    from dew.telemetry.render import plot_journal, read_scalars, safe_name
    from dew.training.trackers import LocalTracker

    run_dir = Path(run_dir)
    journal = run_dir / LocalTracker.SCALARS
    records_path = run_dir / LocalTracker.RECORDS
    if not journal.exists() and not records_path.exists():
        raise NoJournalError(
            f"{str(run_dir)!r} holds no {LocalTracker.SCALARS} or {LocalTracker.RECORDS}. "
            "Point dew report at the directory a LocalTracker wrote."
        )
    out = Path(out) if out is not None else run_dir / "report"
    plots = plot_journal(journal, out / "plots")
    series = read_scalars(journal) if journal.exists() else {}
    records = _rows(records_path)
    previews = _rows(run_dir / LocalTracker.PREVIEWS)

    parts = [f"<h1>dew run {html.escape(str(run_dir.absolute()))}</h1>"]
    if series:
        parts.append("<h2>Last values</h2><table><tr><th>metric</th><th>step</th>"
                     "<th>value</th><th>min</th><th>max</th></tr>")
        for name, (steps, values) in sorted(series.items()):
            finite = values[[math.isfinite(v) for v in values]]
            low = _number(float(finite.min())) if len(finite) else "-"
            high = _number(float(finite.max())) if len(finite) else "-"
            parts.append(f"<tr><td>{html.escape(name)}</td><td>{int(steps[-1])}</td>"
                         f"<td>{_number(float(values[-1]))}</td><td>{low}</td><td>{high}</td></tr>")
        parts.append("</table>")
    if plots:
        parts.append("<h2>Metrics</h2><div class='grid'>")
        for path in plots:
            relative = path.relative_to(out).as_posix()
            parts.append(f"<img src='{html.escape(relative)}' alt='{html.escape(path.stem)}'>")
        parts.append("</div>")
    if previews:
        parts.append("<h2>Previews</h2>")
        for row in previews:
            source = _contained(run_dir, row["path"])
            label = f"{html.escape(row['name'])} at step {int(row['step'])}"
            if source is None:
                refused = f"(refused: {row['path']!r} lies outside the run directory)"
                parts.append(f"<h3>{label}</h3><p>{html.escape(refused)}</p>")
            elif row["kind"] == "text":
                text = source.read_text(encoding="utf-8") if source.is_file() else "(missing)"
                parts.append(f"<h3>{label}</h3><pre>{html.escape(text)}</pre>")
            else:
                link = Path("..") / row["path"] if out == run_dir / "report" else source
                parts.append(f"<h3>{label}</h3><img class='preview' "
                             f"src='{html.escape(Path(link).as_posix())}' alt='{label}'>")
    if records:
        parts.append("<h2>Records</h2>")
        for row in records:
            body = json.dumps(row.get("record", row), indent=1)
            parts.append(f"<h3 id='{safe_name(row['type'])}-{int(row['step'])}'>"
                         f"{html.escape(row['type'])} at step {int(row['step'])}</h3>"
                         f"<pre>{html.escape(body)}</pre>")
    style = ("body{font-family:sans-serif;margin:2em;max-width:1400px}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}"
             ".grid{display:flex;flex-wrap:wrap;gap:8px}.grid img{width:480px}"
             "img.preview{image-rendering:pixelated;max-width:512px;min-width:128px}"
             "pre{background:#f6f6f6;padding:8px;overflow:auto}")
    page = out / "index.html"
    out.mkdir(parents=True, exist_ok=True)
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>dew report</title>"
        f"<style>{style}</style></head><body>" + "\n".join(parts) + "</body></html>\n",
        encoding="utf-8",
    )
    return page
