"""What a fit writes beside its checkpoints: the recipe it was built from and the data ledger."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from dew.errors import RunFileWriteError
from dew.training.config import RUN_FILE
from dew.training.ledger import RecordLedger

if TYPE_CHECKING:
    from dew.checkpoints.manager import Checkpoints
    from dew.training.hooks import Saving

__all__ = ["SAMPLED", "claimed", "ledger_beside", "note_sample", "recipe_beside", "rollout_settings", "sampled_at",
           "write_recipe"]

SAMPLED = "sampled.json"  # the step whose end-of-run sample the run's trackers were given


@contextmanager
def claimed(checkpoints: Checkpoints | None) -> Iterator[None]:
    """Hold the run directory while inside: taken before training, so a second writer is refused
    now, not at the first save; let go again when the fit fails before its loop's Saving hook
    (which lets go of it however the loop ends) exists, so a notebook that keeps its Trainer
    holds no lease after a fit that failed to start. The fit's own error is the one raised."""
    if checkpoints is not None:
        checkpoints.acquire()
    try:
        yield
    except BaseException:
        if checkpoints is not None:
            with contextlib.suppress(Exception):
                checkpoints.close()  # a second close, after the loop's own, does nothing
        raise


def write_recipe(checkpoints: Checkpoints | None, recipe: Mapping[str, object] | None) -> None:
    """The run's recipe beside its checkpoints (run.json), as RunConfig.save writes it; only the
    pool's writer (process 0) writes it.

    A fit writes it once the state is placed, so a resume refused for a changed model or
    optimizer leaves the recipe the run was trained with; the file is replaced whole (written
    beside it, then renamed), so a full disk cannot leave half of it.
    """
    if checkpoints is None or recipe is None or jax.process_index() != 0:
        return
    _replace_recipe(Path(checkpoints.directory), json.dumps(recipe, indent=2) + "\n")


def _replace_recipe(target: Path, text: str) -> None:
    writing = target / f".{RUN_FILE}.writing"
    try:
        target.mkdir(parents=True, exist_ok=True)
        writing.write_text(text)
        os.replace(writing, target / RUN_FILE)
    except OSError as error:
        raise RunFileWriteError(target / RUN_FILE, error, "the recipe it held before, if any, is kept") from error
    finally:
        writing.unlink(missing_ok=True)


@contextmanager
def recipe_beside(checkpoints: Checkpoints | None, recipe: Mapping[str, object] | None, *, resumed: bool,
                  saving: Saving | None) -> Iterator[None]:
    """The fit's recipe beside its checkpoints while inside (write_recipe); a resumed fit that fails
    before saving kept a step writes back the recipe its checkpoints were trained with, so a resume
    whose overrides failed (a tracker it could not reach) leaves the run's recipe as it was."""
    before = None
    if resumed and checkpoints is not None and recipe is not None and jax.process_index() == 0:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            before = (Path(checkpoints.directory) / RUN_FILE).read_text()
    write_recipe(checkpoints, recipe)
    try:
        yield
    except BaseException:
        if before is not None and checkpoints is not None and (saving is None or saving.saved is None):
            with contextlib.suppress(RunFileWriteError):  # the fit's own error is the one to see
                _replace_recipe(Path(checkpoints.directory), before)
        raise


def ledger_beside(checkpoints: Checkpoints | None) -> RecordLedger | None:
    """The run's data ledger, beside its checkpoints (process 0 writes it for the pool)."""
    directory = _written_here(checkpoints)
    return None if directory is None else RecordLedger(directory, processes=jax.process_count())


def rollout_settings(recipe: Mapping[str, object] | None) -> str | None:
    """A digest of the recipe's objective section: what a journaled rollout was made with, so a
    resume whose objective changed samples again instead of replaying (None: no recipe)."""
    if recipe is None:
        return None
    section = json.dumps(recipe.get("objective"), sort_keys=True, default=str)
    return hashlib.sha256(section.encode()).hexdigest()[:32]


def sampled_at(checkpoints: Checkpoints | None) -> int | None:
    """The step whose end-of-run sample the run's trackers were given (note_sample), or None: none yet,
    a run without a local folder, or one written before dew noted it."""
    directory = None if checkpoints is None else checkpoints.directory
    if not isinstance(directory, Path):  # no run directory, or a bucket
        return None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return int(json.loads((directory / SAMPLED).read_text())["step"])
    return None


def note_sample(checkpoints: Checkpoints | None, step: int) -> None:
    """Note that the trackers were given the end-of-run sample of step, so a resume with nothing left
    to train gives it again only when they were not (a stop at the last step ends before it)."""
    directory = _written_here(checkpoints)
    if directory is not None:
        with contextlib.suppress(OSError):  # a note: at worst a later resume journals the sample again
            (directory / SAMPLED).write_text(json.dumps({"step": int(step)}) + "\n")


def _written_here(checkpoints: Checkpoints | None) -> Path | None:
    """The run directory when this process writes beside the checkpoints (process 0, a local folder);
    None without a run directory, on another process, or for a bucket (no appends there)."""
    directory = None if checkpoints is None else checkpoints.directory
    return directory if isinstance(directory, Path) and jax.process_index() == 0 else None
