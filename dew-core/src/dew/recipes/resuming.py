"""The lines a resumable run prints about its folder: where it is, and the command that continues it.

Kept apart from dew.recipes.folder (which reads run folders through the
recipe schema) so that the run itself, below the schema, can print them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from pathlib import Path

__all__ = ["resume_command", "resuming_line", "shown", "trained_for"]


def shown(path: str | os.PathLike[str]) -> str:
    """path as a person types it here: relative to the working directory when inside it."""
    path = Path(path)
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def resume_command(directory: str | os.PathLike[str]) -> str:
    """The command that continues the run in directory, ready to paste.

    >>> resume_command("/somewhere/else/runs/tiny lm")
    "dew train --resume '/somewhere/else/runs/tiny lm'"
    """
    return f"dew train --resume {shlex.quote(shown(directory))}"


def resuming_line(directory: str | os.PathLike[str], resumed_at: int, steps: int, trained_for: int | None) -> str:
    """The one line a run that found its folder's checkpoints prints: it resumes (or is done),
    and how to start fresh instead."""
    where = shown(directory)
    before = "" if trained_for is None or trained_for == steps else \
        f" (its checkpoints trained with trainer.steps={trained_for})"
    fresh = (f"to start fresh instead, set trainer.checkpoint_dir to a new folder or remove {where}")
    if resumed_at >= steps:
        return (f"{where} already holds step {resumed_at}{before}, at or past trainer.steps={steps}: "
                f"nothing to train; to train further, {resume_command(directory)} "
                f"trainer.steps=N; {fresh}.")
    return f"Resuming {where} at step {resumed_at}{before}, to step {steps}; {fresh}."


def trained_for(directory: str | os.PathLike[str], steps_per_epoch: int | None) -> int | None:
    """The trainer.steps the run.json in directory trained with (None when unreadable)."""
    from dew.training.config import RUN_FILE, TrainerConfig

    try:
        saved = json.loads((Path(str(directory)) / RUN_FILE).read_text())
        return TrainerConfig(**saved["trainer"]).total_steps(steps_per_epoch)
    except Exception:  # noqa: BLE001 - an unreadable old recipe only shortens the line
        return None
