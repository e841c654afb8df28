"""``dew report RUN_DIR [RUN_DIR ...]``: LocalTracker runs as one static page of charts."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dew.cli.runs import note_if_training
from dew.errors import DewError

if TYPE_CHECKING:
    from dew.cli.run_page import RunData as RunPageData

__all__ = ["NoJournalError", "ReportOutError", "ReportWriteError", "add_arguments", "journal_folder", "load_run",
           "render_report", "run"]


class NoJournalError(DewError, FileNotFoundError):
    """The directory holds no LocalTracker journal to report on."""


class ReportWriteError(DewError, OSError):
    """The page or a chart could not be written: a full disk, a read-only folder."""


class ReportOutError(DewError, FileExistsError):
    """The page's folder (--out) is a file, or lies under one: the page is a folder of files."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", metavar="RUN_DIR", type=Path, nargs="+",
                        help="a LocalTracker directory (it holds scalars.jsonl); give several "
                             "to overlay their curves")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the page and its charts (default: the first "
                             "RUN_DIR's report/)")


def run(args: argparse.Namespace) -> int:
    try:
        page = render_report(args.run_dirs, args.out)
    except DewError as error:  # one line: what is wrong and what to do
        print(f"dew report: {error}", file=sys.stderr)
        return 2
    note_if_training("report", *args.run_dirs)
    for run_dir in map(Path, args.run_dirs):  # a journal read elsewhere is said: it may be another run's
        logs = journal_folder(run_dir)
        if logs.resolve() != run_dir.resolve():
            print(f"dew report: the journal of {run_dir} was read from {logs}, where its recipe's local tracker "
                  "wrote it.", file=sys.stderr)
    print(f"Wrote {page}")
    return 0


def _rows(path: Path, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The journal's rows, each refused (TornJournalError, one line) when it lacks one of keys or its
    step is no whole number: the page reads them all (a KeyError's traceback, where a row lacked one)."""
    if not path.exists():
        return []
    from dew.telemetry.render import TornJournalError, journal_rows

    rows = list(journal_rows(path))
    for row in rows:
        missing = [key for key in ("step", *keys) if key not in row]
        step = row.get("step")
        if missing or isinstance(step, bool) or not isinstance(step, int):
            what = f"lacks {', '.join(map(repr, missing))}" if missing else f"has the step {step!r}, no whole number"
            raise TornJournalError(f"{path} holds a row that {what}: {json.dumps(row)[:200]}; the journal was damaged "
                                   "or written by something else. Remove that line to report the rest.")
    return rows


def _labels(directories: Sequence[Path]) -> list[str]:
    """Each run's name: its folder, with parents added until the names differ."""
    parts = [d.absolute().parts for d in directories]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in directories]


def journal_folder(run_dir: Path) -> Path:
    """Where run_dir's journal is: the folder itself, else the first folder its recipe's local tracker
    wrote to (trackers.0.directory outside the run folder) that holds one, else run_dir."""
    from dew.recipes.resuming import tracker_folders
    from dew.tracking.local import LocalTracker

    written = [run_dir, *tracker_folders(run_dir)]
    return next((d for d in written if (d / LocalTracker.SCALARS).exists() or (d / LocalTracker.RECORDS).exists()),
                run_dir)


def load_run(run_dir: str | Path, label: str | None = None) -> RunPageData:
    """A run's scalars, records and preview index, read (never written) from its directory."""
    from dew.cli.run_page import RunData
    from dew.telemetry.render import read_scalars
    from dew.tracking.local import LocalTracker
    from dew.training.rollout_journal import ROLLOUTS, kept_rollouts

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is a file" if run_dir.exists() else "does not exist"
        raise NoJournalError(f"{str(run_dir)!r} {what}. Point dew report at the directory a LocalTracker wrote "
                             "(a shipped recipe's run folder).")
    logs = journal_folder(run_dir)
    journal, records_path = logs / LocalTracker.SCALARS, logs / LocalTracker.RECORDS
    if not journal.exists() and not records_path.exists():
        from dew.recipes.resuming import the_run_folder

        raise NoJournalError(
            f"{str(run_dir)!r} holds no {LocalTracker.SCALARS} or {LocalTracker.RECORDS}. "
            f"Point dew report at the directory a LocalTracker wrote.{the_run_folder(run_dir)}"
        )
    return RunData(
        directory=logs, label=label or run_dir.name,  # the previews' paths start where they were written
        series=read_scalars(journal) if journal.exists() else {},
        records=tuple(_rows(records_path, ("type",))),
        previews=tuple(_rows(logs / LocalTracker.PREVIEWS, ("name", "kind", "path"))),
        rollouts=kept_rollouts(run_dir, batches=False) if (run_dir / ROLLOUTS).is_file() else None,
    )


def render_report(run_dirs: str | Path | Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Write ``index.html`` and its charts for one run or several overlaid; return the page.

    out defaults to the first run's ``report`` folder. The runs are only read.
    """
    from dew.cli.run_page import write_page
    from dew.pretrained.writing import fresh_beside, swap_in

    if isinstance(run_dirs, str | Path):
        run_dirs = [run_dirs]
    directories: list[Path] = []
    for given in map(Path, run_dirs):  # a run given twice (runs/a and runs/./a) is drawn once
        if all(os.path.realpath(given) != os.path.realpath(seen) for seen in directories):
            directories.append(given)
    if not directories:
        raise ValueError("dew report needs at least one run directory.")
    runs = [load_run(d, label) for d, label in zip(directories, _labels(directories), strict=True)]
    out = Path(out) if out is not None else directories[0] / "report"
    _check_out(out)
    existed, paged = out.exists(), (out / "index.html").is_file()
    try:
        # Drawn beside out, then swapped in: a write the disk refuses leaves the page out held whole, and
        # nothing planted in out (a link named index.html or plots) is written through. Others' files in
        # out travel into the new folder as they are.
        others = [entry.name for entry in out.iterdir() if entry.name not in _PAGE_ENTRIES] if existed else []
        out.parent.mkdir(parents=True, exist_ok=True)
        fresh = fresh_beside(out)
        try:
            write_page(runs, fresh)
            swap_in(fresh, out, carry=others)
        except BaseException:
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        return out / "index.html"
    except OSError as error:
        from dew.errors import out_of_space

        kept = ("the page it held before is kept" if paged else "what it held is kept" if existed
                else "nothing was left there")
        full = "Free space on its disk, or give" if out_of_space(error) else "Give"
        raise ReportWriteError(
            f"The report could not be written to {out} ({error.strerror or error}); {kept}. {full} --out a "
            "folder this process can write.") from None


_PAGE_ENTRIES = frozenset({"index.html", "plots", "previews"})  # what write_page puts in its folder


def _refuse_others_page(out: Path) -> None:
    """Refuse an out whose index.html, plots or previews are not an earlier report's: the page replaces
    those entries whole (a user's own index.html and the figures beside it were overwritten). A link
    of those names is replaced, never followed, so its target is lost to no one."""
    if not out.is_dir() or out.is_symlink():
        return
    held = sorted(entry.name for entry in out.iterdir() if entry.name in _PAGE_ENTRIES and not entry.is_symlink())
    from dew.cli.run_page import PAGE_START

    page = out / "index.html"
    try:
        ours = not page.is_symlink() and page.is_file() and page.read_bytes()[:len(PAGE_START)] == PAGE_START.encode()
    except OSError:
        ours = False
    if held and not ours:
        raise ReportOutError(f"--out {str(out)!r} holds {', '.join(held)} that dew report did not write, which its page "
                             "would replace; give --out a folder of its own (by default the first run's report/).")


def _check_out(out: Path) -> None:
    """Refuse an out that is a file or lies under one: the page is written as a folder (index.html
    beside its charts), which cannot be made there; or a link, which a shared run folder could
    point at a folder of the reader's own, to have its page written over that folder's files."""
    from dew.recipes.resuming import kept_step_around
    from dew.training.config import RUN_FILE

    if out.is_symlink():
        raise ReportOutError(f"The report's folder {str(out)!r} is a symbolic link (to {os.readlink(out)}); dew "
                             "report writes its page only into a real folder. Give --out the folder it points "
                             "to if that is where the page belongs, or a new folder.")
    if (out / RUN_FILE).is_file():  # a run's own folder: the page and its charts would sit among its steps
        raise ReportOutError(f"--out {str(out)!r} is a run's folder (it holds {RUN_FILE}); dew report would write "
                             "its page among that run's checkpoints. Give --out a folder of its own (by default "
                             "the first run's report/).")
    step = kept_step_around(out)
    if step is not None:  # a kept step's files are checked by their hashes, and it was swapped whole
        raise ReportOutError(f"--out {str(out)!r} lies in step {step.name} kept in the run {str(step.parent)!r}; dew "
                             "report would write its page among that step's checkpoint files. Give --out a folder "
                             "of its own (by default the first run's report/).")
    _refuse_others_page(out)
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                what = "is a file" if path == out else f"lies under {str(path)!r}, a file"
                raise ReportOutError(f"The report's folder {str(out)!r} {what}; dew report writes a folder "
                                     "(index.html and its charts): give --out a new folder or an existing one.")
            return
