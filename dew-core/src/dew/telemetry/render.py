"""Turning what a run reports into files a person can open.

Previews become PNG (images), GIF (videos) or UTF-8 text files; a scalar
journal becomes one PNG plot per metric, drawn with matplotlib's Agg canvas
without touching pyplot's global state. Every tracker that stores files uses
these renderers, so a preview looks the same in every sink.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dew.errors import DewError, RunFileWriteError
from dew.telemetry.artifacts import Artifact

__all__ = [
    "NON_FINITE",
    "LinkedJournalError",
    "append_lines",
    "gif_bytes",
    "TornJournalError",
    "cut_torn_tail",
    "grid_columns",
    "image_grid",
    "journal_rows",
    "open_journal",
    "pictured",
    "plot_journal",
    "plot_series",
    "png_bytes",
    "preview_bytes",
    "preview_columns",
    "preview_suffix",
    "read_scalars",
    "safe_name",
    "write_file",
    "write_preview",
]

# The journal's spelling of non-finite floats, and back.
NON_FINITE = {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}


# A sample's control characters (a byte-level model writes any byte) as the Unicode symbols that
# picture them: raw, they make a page a binary file to grep and are invisible in a browser or a terminal.
_CONTROL_PICTURES = {code: 0x2400 + code for code in range(32) if chr(code) not in "\n\t"} | {0x7F: 0x2421}


def pictured(text: str) -> str:
    r"""A model's text with its control characters (other than newline and tab) as the symbols that picture them.

    >>> pictured("a\x10b\tc") == "a\u2410b\tc"
    True
    """
    return text.translate(_CONTROL_PICTURES)


def write_file(path: str | os.PathLike[str], data: bytes) -> Path:
    """data as the file path, written beside it and renamed into place; return path.

    A link planted at path is replaced, never written through (a sample
    directory that names a file outside it cannot make dew overwrite that
    file), and a reader never sees half a file.
    """
    import tempfile

    path = Path(path)
    handle, written = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(written, 0o666 & ~mask)
        os.replace(written, path)
    except BaseException:
        Path(written).unlink(missing_ok=True)
        raise
    return path


def safe_name(name: str) -> str:
    """name as a file name: path separators and odd characters become ``_``."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name.replace("/", "__")).strip("._")
    return cleaned or "unnamed"


def grid_columns(count: int) -> int:
    """How many columns image_grid tiles a batch of count images into (a near-square grid)."""
    return math.ceil(math.sqrt(count))


def preview_columns(artifact: Artifact) -> int:
    """The width, in cells, of a labelled preview's grid: as given, else as image_grid tiles it."""
    if artifact.columns is not None:
        return artifact.columns
    return grid_columns(len(artifact.labels))


def image_grid(pixels: np.ndarray) -> np.ndarray:
    """One (H, W, C) uint8 image: a single image as is, a batch tiled into a near-square grid."""
    array = np.asarray(pixels)
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim == 3:
        return array
    if array.ndim != 4:
        raise ValueError(f"An image preview is (H, W, C) or (N, H, W, C); got shape {array.shape}.")
    count, height, width, channels = array.shape
    columns = grid_columns(count)
    rows = math.ceil(count / columns)
    grid = np.zeros((rows * height, columns * width, channels), np.uint8)
    for index in range(count):
        r, c = divmod(index, columns)
        grid[r * height:(r + 1) * height, c * width:(c + 1) * width] = array[index]
    return grid


def _pil_image(frame: np.ndarray):
    from PIL import Image

    if frame.shape[-1] == 1:
        return Image.fromarray(frame[..., 0], mode="L")
    if frame.shape[-1] not in (3, 4):
        raise ValueError(
            f"A preview image has 1, 3 or 4 channels; got {frame.shape[-1]} (shape {frame.shape})."
        )
    return Image.fromarray(frame)


def png_bytes(pixels: np.ndarray) -> bytes:
    """PNG encoding of an image preview's pixels (a batch becomes a grid)."""
    buffer = io.BytesIO()
    _pil_image(image_grid(pixels)).save(buffer, format="PNG")
    return buffer.getvalue()


def gif_bytes(frames: np.ndarray, fps: int = 8) -> bytes:
    """Animated GIF encoding of a (T, H, W, C) video preview."""
    array = np.asarray(frames)
    if array.ndim != 4:
        raise ValueError(f"A video preview is (T, H, W, C); got shape {array.shape}.")
    images = [_pil_image(frame) for frame in array]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:],
                   duration=max(1, 1000 // fps), loop=0)
    return buffer.getvalue()


def preview_suffix(artifact: Artifact) -> str:
    """The file suffix a preview is written with."""
    return {"image": ".png", "video": ".gif", "text": ".txt"}[artifact.kind]


def preview_bytes(artifact: Artifact) -> bytes:
    """The file content of a preview."""
    if artifact.kind == "text":
        return str(artifact.data).encode("utf-8")
    if artifact.kind == "image":
        return png_bytes(np.asarray(artifact.data))
    return gif_bytes(np.asarray(artifact.data))


def write_preview(artifact: Artifact, directory: str | Path, step: int) -> Path:
    """Write one preview as ``directory/<name>/step_<step><suffix>``; return its path. It is written
    beside and renamed into place, so a write that fails (a full disk) leaves no empty sample."""
    folder = Path(directory) / safe_name(artifact.name)
    folder.mkdir(parents=True, exist_ok=True)
    return write_file(folder / f"step_{int(step):08d}{preview_suffix(artifact)}", preview_bytes(artifact))


# -- scalar journals -----------------------------------------------------------


class TornJournalError(DewError, ValueError):
    """A journal line other than the last is not JSON: the file was damaged, not cut short."""


class LinkedJournalError(DewError):
    """A journal of a run's folder is a symbolic link: dew writes journals only as the folder's own
    files, so a folder someone shared cannot make it append to (or cut) a file elsewhere."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(
            f"{path} is a symbolic link (to {os.readlink(path)}), and dew writes a run's journals only "
            f"as files of the run's own folder: a link there would have it append to, or cut back, "
            f"the file it points at. Replace the link with a copy of that file "
            f"(cp --remove-destination \"$(readlink -f {path})\" {path}), or remove it.")


def open_journal(journal: str | Path, *, append: bool = True) -> io.FileIO:
    """journal opened unbuffered for appending (created if missing), or for reading and writing
    (append=False; FileNotFoundError when missing); never through a symbolic link
    (LinkedJournalError)."""
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT) if append else os.O_RDWR
    try:
        descriptor = os.open(journal, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError:
        if os.path.islink(journal):
            raise LinkedJournalError(Path(journal)) from None
        raise
    return io.FileIO(descriptor, "ab" if append else "rb+")


def cut_torn_tail(journal: str | Path) -> None:
    """Drop a last line a crash cut short (no newline after it) before more lines are appended.

    What that line described was undone with the crash; left in place, the next line a resumed run
    appends would be glued to it, and the journal would read as damaged in its middle.

    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "scalars.jsonl"
    >>> _ = path.write_text('{"step": 1}\\n{"step": 2, "lo')
    >>> cut_torn_tail(path); path.read_text()
    '{"step": 1}\\n'
    """
    try:
        handle = open_journal(journal, append=False)
    except FileNotFoundError:
        return
    with handle:
        end = handle.seek(0, os.SEEK_END)
        if end == 0:
            return
        handle.seek(end - 1)
        if handle.read(1) == b"\n":
            return
        position = end
        while position > 0:  # back to the last newline, a block at a time
            start = max(0, position - 65536)
            handle.seek(start)
            at = handle.read(position - start).rfind(b"\n")
            if at >= 0:
                handle.truncate(start + at + 1)
                return
            position = start
        handle.truncate(0)


def append_lines(journal: Path, lines: Sequence[str]) -> None:
    """Append whole lines to journal in one write (making its folder); a write the disk refuses is
    cut back to the lines before it and raised as RunFileWriteError, so no line is left torn."""
    data = "".join(line + "\n" for line in lines).encode()
    try:
        journal.parent.mkdir(parents=True, exist_ok=True)
        with open_journal(journal) as handle:
            size = os.fstat(handle.fileno()).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[handle.write(view):]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(handle.fileno(), size)
                raise
    except OSError as error:
        raise RunFileWriteError(journal, error, f"its {len(lines)} new line(s) were not kept, the lines "
                                "before them are whole") from error


def journal_rows(journal: str | Path, *, strict: bool = True) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL journal, read a line at a time, skipping a last line cut short by a crash
    or a full disk (no newline after it). A damaged line before it raises TornJournalError, or is
    skipped when not strict (a reader that can do without it).

    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "scalars.jsonl"
    >>> _ = path.write_text('{"step": 1}\\n{"step": 2, "lo')
    >>> list(journal_rows(path))
    [{'step': 1}]
    """
    for _, row in _placed_rows(journal, strict=strict):
        yield row


def _placed_rows(journal: str | Path, *, strict: bool) -> Iterator[tuple[int, dict[str, Any]]]:
    """journal_rows, each with the byte offset its line starts at."""
    offset = 0
    with open(journal, "rb") as handle:  # lines end at \n alone
        for number, raw in enumerate(handle, start=1):
            at, offset = offset, offset + len(raw)
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                if not strict or not line.endswith("\n"):  # the last line, a write that never finished
                    continue
                where = "at its end" if error.pos >= len(line.rstrip("\n")) else f"at character {error.pos + 1}"
                raise TornJournalError(
                    f"{journal}, line {number}, is not JSON ({error.msg} {where}); the journal was damaged. "
                    f"Mend that line, or remove it (sed -i '{number}d' {journal}) to read the rest without "
                    "it.") from error
            if not isinstance(row, dict):
                if not strict:
                    continue
                raise TornJournalError(f"{journal}, line {number}, is a JSON {type(row).__name__}, not a journal "
                                       "row (an object); the journal was damaged or written by something else.")
            yield at, row


def _number(value: Any) -> float | None:
    if isinstance(value, str):
        return NON_FINITE.get(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _fit_starts(journal: Path) -> list[tuple[int, int | None]]:
    """Each fit of the run as (the step it started from, the byte offset in journal its rows begin at,
    or None where its record does not say), fit by fit in the order they ran, as the records journal
    beside journal has them (two fits from step 0, the first failed before its first checkpoint, are two)."""
    records = journal.with_name("records.jsonl")
    if not records.is_file():
        return []
    fits = []
    for row in journal_rows(records, strict=False):
        if row.get("type") != "run_started":
            continue
        start, at = row.get("record", {}).get("start", row.get("step")), row.get("scalars_at")
        if type(start) is int:
            fits.append((start, at if type(at) is int else None))
    return fits


def read_scalars(journal: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every metric of a scalar journal as (steps, values), in step order, one value a step.

    A resumed run goes back to its checkpoint and trains the steps after it again: what an
    earlier fit logged past a later fit's start was undone with it (a fit killed at 450 after its
    checkpoint at 400, resumed from there) and is dropped. The records journal beside it says where
    each fit started, and where in this journal its rows begin; a journal whose fits do not say
    where their rows begin (written before they did) drops the undone rows where the steps go back.
    """
    journal = Path(journal)
    fits = _fit_starts(journal)
    placed = [(start, at) for start, at in fits if at is not None]
    marks = [at for _, at in placed]
    if len(placed) < len(fits) or marks != sorted(marks) or (marks and marks[-1] > journal.stat().st_size):
        return _ordered(_series_by_going_back(journal, [start for start, _ in fits]))
    series: dict[str, dict[int, float]] = {}
    for at, row in _placed_rows(journal, strict=True):
        step = _step_of(row, journal)
        if any(start < step for start, begins in placed if begins > at):
            continue  # logged by a fit a later one resumed from before this step
        _add(series, row, step)
    return _ordered(series)


def _series_by_going_back(journal: Path, starts: list[int]) -> dict[str, dict[int, float]]:
    """A journal's values step by step where its fits do not say where their rows begin: where the
    steps go back, the rows logged past the latest earlier fit start are dropped."""
    series: dict[str, dict[int, float]] = {}
    newest = None
    for row in journal_rows(journal):
        step = _step_of(row, journal)
        if newest is not None and step < newest:  # a fit resumed from a step before the newest logged
            resumed_from = max((start for start in starts[1:] if start < step), default=None)
            if resumed_from is not None:
                for values in series.values():
                    for undone in [logged for logged in values if logged > resumed_from]:
                        del values[undone]
        newest = step
        _add(series, row, step)
    return series


def _step_of(row: dict[str, Any], journal: Path) -> int:
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise TornJournalError(f"{journal} holds a row whose step is {step!r}, not a whole number: {row!r}; "
                               "the journal was damaged or written by something else.")
    return step


def _add(series: dict[str, dict[int, float]], row: dict[str, Any], step: int) -> None:
    """row's numbers into series at step (a later value for a step replaces an earlier one)."""
    for name, value in row.items():
        number = _number(value) if name != "step" else None
        if number is not None:
            series.setdefault(name, {})[step] = number


def _ordered(series: dict[str, dict[int, float]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    ordered = {name: sorted(values.items()) for name, values in series.items() if values}  # all undone: none
    return {name: (np.asarray([step for step, _ in pairs], np.int64), np.asarray([value for _, value in pairs], np.float64))
            for name, pairs in ordered.items()}


def plot_series(name: str, steps: np.ndarray, values: np.ndarray, path: str | Path) -> Path:
    """Draw one metric against the step into a PNG at path (Agg canvas, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6.4, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    finite = np.isfinite(values)
    shown = np.where(finite, values, np.nan)  # gaps where the value was not finite
    axes.plot(steps, shown, marker="." if len(steps) <= 50 else None, linewidth=1.5)
    bad = ~finite
    if bad.any():
        low = np.nanmin(shown) if finite.any() else 0.0
        axes.plot(steps[bad], np.full(bad.sum(), low), "x", color="red", label="not finite")
        axes.legend(loc="best")
    axes.set_title(name)
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(True, alpha=0.3)
    if finite.any() and np.all(shown[finite] > 0) and np.nanmax(shown) / np.nanmin(shown) > 100:
        axes.set_yscale("log")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def plot_journal(journal: str | Path, directory: str | Path) -> list[Path]:
    """One PNG per metric of a scalar journal, in directory; the journal is only read."""
    journal = Path(journal)
    if not journal.exists():
        return []
    return [plot_series(name, steps, values, Path(directory) / f"{safe_name(name)}.png")
            for name, (steps, values) in sorted(read_scalars(journal).items())]
