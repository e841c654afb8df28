"""What the commands share: the RUN argument, argument types, and refusals in one line.

A RUN is a run folder or an exported model directory; ``dew.recipes.opening``
rebuilds either for inference.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from dew.errors import DewError

__all__ = ["RunFolderOutError", "add_run_argument", "amount", "expected", "note_if_training", "positive", "refuse_run_folder",
           "refused", "seconds"]


def refused(command: str, error: BaseException | str) -> int:
    """Print error on stderr as `dew COMMAND: message`, with the notes dew added to it (where a path
    came from), each on a line of its own; return 2, a refusal's exit code."""
    from dew.cli import error_notes

    notes = error_notes(error) if isinstance(error, BaseException) else []
    print("\n".join([f"dew {command}: {error}", *notes]), file=sys.stderr)
    return 2


class RunFolderOutError(DewError, ValueError):
    """A command was asked to write its output into a run's folder or one of its kept steps."""


def refuse_run_folder(out: Path, named: str, what: str) -> None:
    """Refuse an output folder (named as the command line names it: "--out", "OUT") that is a run's
    folder or one of its kept steps: what (the samples, the export) would sit among the files dew
    resumes, generates and exports from, a step's checked by their hashes."""
    from dew.recipes.resuming import step_kept_in_run
    from dew.training.config import RUN_FILE

    step = step_kept_in_run(out)
    if (out / RUN_FILE).is_file():
        where = f"the run folder {out}"
    elif step is not None:
        where = f"step {step} of the run {out.parent}"
    else:
        return
    raise RunFolderOutError(f"{named} is {where}, among the files dew resumes, generates and exports from; "
                            f"write {what} to a folder of their own.")


def note_if_training(command: str, *folders: str | Path) -> None:
    """Say on stderr which of the run folders a live process is still training (it holds the writer's
    lease): what the command read is the run as of its newest committed step, not its end."""
    from dew.checkpoints.lease import holder_of, is_gone

    for folder in map(Path, folders):
        holder = holder_of(folder) if folder.is_dir() else None
        if holder is not None and not is_gone(holder):
            print(f"dew {command}: note: {folder} is still being trained ({holder.describe()}): this read it as "
                  f"of its newest committed step; run dew {command} again once the training ends.", file=sys.stderr)


def expected(error: BaseException) -> bool:
    """An error a command reports in one line: dew's own (its message says what to do) or bad input.
    A closed pipe is not one: dew.cli.main ends the command quietly with 141."""
    if isinstance(error, BrokenPipeError):
        return False
    return type(error).__module__.split(".")[0] == "dew" or isinstance(error, ValueError | OSError)


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count of tokens, batches or steps), so
    0 or a negative is refused at the command line rather than read as "the default"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def amount(text: str) -> float:
    """An argparse type: a finite number above 0 (megabytes, milliseconds, FLOP/s), so 0, a negative
    or NaN is refused at the command line rather than clamped or read as "the default"."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):  # NaN fails it too
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0")
    return value


def seconds(least: float, inclusive: bool) -> Callable[[str], float]:
    """An argparse type: a number of seconds of at least (or above) least."""
    def read(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not (value >= least if inclusive else value > least):  # NaN fails either comparison
            raise argparse.ArgumentTypeError(f"{text} is not {'at least' if inclusive else 'more than'} {least:g} "
                                             "seconds")
        return value
    return read


def add_run_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", type=Path,
                        help="a run directory (it holds run.json) or an exported model directory")
