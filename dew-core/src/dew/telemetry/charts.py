"""Charts of a run page: several series on one set of axes, each drawn smoothed over its raw self.

Drawn with matplotlib's Agg canvas without pyplot's global state, like the
per-metric plots of :mod:`dew.telemetry.render`, so rendering a report never
opens a window or disturbs a notebook's figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = ["GOODPUT_PARTS", "Line", "plot_goodput", "plot_lines", "smooth"]


def smooth(values: np.ndarray, weight: float = 0.6) -> np.ndarray:
    """An exponential moving average corrected for its start, as TensorBoard smooths curves.

    Non-finite values are skipped (the average carries over them, and they stay
    non-finite in the output, so they show as gaps).

    >>> smooth(np.array([1.0, 1.0, 1.0])).tolist()
    [1.0, 1.0, 1.0]
    >>> smooth(np.array([0.0, 1.0, float("nan"), 1.0]), 0.5).round(3).tolist()
    [0.0, 0.667, nan, 0.857]
    """
    if not 0 <= weight < 1:
        raise ValueError(f"A smoothing weight is in [0, 1), got {weight}.")
    out = np.full(len(values), np.nan)
    average, seen = 0.0, 0
    for index, value in enumerate(np.asarray(values, np.float64)):
        if not np.isfinite(value):
            continue
        average = weight * average + (1 - weight) * value
        seen += 1
        out[index] = average / (1 - weight**seen)
    return out


@dataclass(frozen=True)
class Line:
    """One series of a chart: its legend label, steps, values and how it is drawn."""

    label: str
    steps: np.ndarray
    values: np.ndarray
    color: str
    style: str = "-"


# The parts of a fit's wall time, in the order the goodput bar stacks them, with colours.
GOODPUT_PARTS = (
    ("steps", "#2ca02c"),
    ("compile", "#9467bd"),
    ("data", "#ff7f0e"),
    ("checkpoint", "#1f77b4"),
    ("evaluation", "#17becf"),
    ("preemption", "#d62728"),
    ("rollout", "#e377c2"),
    ("reward", "#bcbd22"),
    ("other", "#7f7f7f"),
)


def _figure(height: float = 3.6,
            layout: Literal["constrained", "compressed", "tight"] | None = None) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, height), dpi=100, layout=layout)
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str | Path) -> Path:
    if figure.get_layout_engine() is None:
        figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def _plain(text: str) -> str:
    """A journal's name as matplotlib draws it literally: a $ would start mathtext, which a name such
    as ``x$\\frac{$`` breaks (and a label of _ alone would be left out of the legend)."""
    return text.replace("$", r"\$")


def plot_lines(title: str, lines: Sequence[Line], path: str | Path, weight: float = 0.6,
               smoothed: bool = True, log_y: bool | None = None) -> Path:
    """Every line on one chart: raw values faint, their smoothed curve bold in the same colour.

    A line of a few points, or any line when smoothed is False (a schedule, which
    has no noise to smooth away), is drawn raw only. log_y None turns the y axis
    logarithmic when every value is positive and they span 1000x or more (True
    asks for it whenever every value is positive: rates in different units).
    """
    from matplotlib.ticker import MaxNLocator

    # Many lines (a report of many runs): the legend goes under the chart, in columns, on a taller
    # figure, where inside it would cover the curves and run off the image.
    below = len(lines) > _LEGEND_INSIDE
    rows = -(-len(lines) // _LEGEND_COLUMNS)
    figure = _figure(height=3.6 + 0.17 * rows, layout="constrained") if below else _figure()
    axes = figure.add_subplot()
    shown_all = []
    for line in lines:
        values = np.where(np.isfinite(line.values), line.values, np.nan)
        shown_all.append(values[np.isfinite(values)])
        if len(values) <= 10 or not smoothed:
            axes.plot(line.steps, values, line.style, color=line.color,
                      marker="." if len(values) <= 10 else None, linewidth=1.5, label=_plain(line.label))
            continue
        axes.plot(line.steps, values, line.style, color=line.color, alpha=0.25, linewidth=1)
        axes.plot(line.steps, smooth(values, weight), line.style, color=line.color,
                  linewidth=1.8, label=_plain(line.label))
    axes.set_title(_plain(title))
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(True, alpha=0.3)
    finite = np.concatenate(shown_all) if shown_all else np.array([])
    positive = len(finite) > 0 and bool(np.all(finite > 0))
    if positive and (log_y or (log_y is None and finite.max() / finite.min() > 1000)):
        axes.set_yscale("log")
    # A NaN or an infinity is a gap in its line, and marked where it fell: the step that made it is
    # the one to look at (a line that ends there would read as a run that stopped logging).
    low = float(finite.min()) if len(finite) else 0.0
    marked = False
    for line in lines:
        bad = ~np.isfinite(line.values)
        if bad.any():
            axes.plot(np.asarray(line.steps)[bad], np.full(int(bad.sum()), low), "x", color="red",
                      markersize=7, label=None if marked else "not finite")
            marked = True
    if below:
        figure.legend(loc="outside lower center", ncol=_LEGEND_COLUMNS, fontsize="x-small", frameon=False)
    elif lines:
        axes.legend(loc="best", fontsize="small")
    return _save(figure, path)


_LEGEND_INSIDE = 8  # lines whose legend fits inside a chart's axes
_LEGEND_COLUMNS = 3


def plot_goodput(runs: Mapping[str, Mapping[str, float]], path: str | Path) -> Path:
    """One horizontal bar per run: its wall time split into steps and each cause of badput.

    runs maps a run's label to seconds by part (the names of GOODPUT_PARTS).
    """
    figure = _figure(height=1.8 + 0.5 * len(runs), layout="constrained")
    axes = figure.add_subplot()
    labels = list(runs)
    left = np.zeros(len(labels))
    for part, color in GOODPUT_PARTS:
        widths = np.array([float(runs[label].get(part, 0.0)) for label in labels])
        if not widths.any():
            continue
        axes.barh(labels, widths, left=left, color=color, label=part)
        left += widths
    for index, total in enumerate(left):
        steps = float(runs[labels[index]].get("steps", 0.0))
        if total > 0:
            axes.text(total, index, f" {100 * steps / total:.0f}% in steps", va="center",
                      fontsize="small")
    axes.set_xlim(0, max(left.max(initial=0.0) * 1.25, 1e-9))
    axes.set_xlabel("seconds of wall time")
    axes.invert_yaxis()
    # above the bars, so it never hides one; the legend's first entry is the good part
    axes.legend(loc="lower left", bbox_to_anchor=(0, 1.02), fontsize="small", ncol=4,  # 7 ran off the image
                frameon=False, title="goodput: where the wall time went", title_fontsize="medium",
                alignment="left")
    return _save(figure, path)
