"""What can go wrong with a checkpoint, each failure a class of its own.

Every message says what is wrong and what to do about it. All of them derive
from CheckpointError, so a caller can catch the family at once.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dew.errors import DewError

if TYPE_CHECKING:
    from dew.checkpoints.lease import Holder

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointDirectoryError",
    "CheckpointDirectoryNotSharedError",
    "CheckpointError",
    "CheckpointFromNewerDewError",
    "CheckpointLeaseHeldError",
    "CheckpointMetaMismatchError",
    "CheckpointNotFoundError",
    "CheckpointPathEncodingError",
    "CheckpointRemovedWarning",
    "CheckpointTreeMismatchError",
    "CheckpointWriteError",
    "LocalStepsOwnedError",
    "PositionShareMismatchError",
    "require_same_meta",
]


class CheckpointError(DewError):
    """Base class of dew's checkpoint failures."""


class CheckpointRemovedWarning(UserWarning):
    """A step this run wrote and committed is gone from its directory (removed by hand, or by another
    program) before the run's next save: the run goes on, and its next save writes a newer step."""


class CheckpointWriteError(CheckpointError):
    """An asynchronous save failed (full disk, unwritable directory, ...)."""

    def __init__(self, step: int, directory: object, cause: BaseException) -> None:
        self.step = step
        self.directory = str(directory)
        super().__init__(
            f"Saving checkpoint step {step} into {directory} failed: {type(cause).__name__}: "
            f"{_first_line(cause)}. The step was not committed; older steps are untouched. "
            f"{_write_advice(cause)}"
        )


def _write_advice(cause: BaseException) -> str:
    """What fixes a failed write, by the error it met (Orbax passes some on as text with the number)."""
    import errno

    said = f"{cause!r} {cause}"
    number = cause.errno if isinstance(cause, OSError) else None
    if number == errno.EFBIG or "File too large" in said or f"os_error_code='{errno.EFBIG}'" in said:
        return ("A file grew past the largest this process may write (ulimit -f) or its file system takes: "
                "raise the limit (ulimit -f unlimited) or write to another file system, then run again.")
    return "Free disk space or fix the directory's permissions, then run again."


class CheckpointCorruptedError(CheckpointError):
    """A committed step's files do not match what was written."""

    def __init__(self, step: int, file: object, reason: str, good: int | None = None,
                 *, searched: bool = False) -> None:
        self.step = step
        self.file = str(file)
        self.reason = reason
        self.good = good
        older = (
            f" The newest older good step is {good}: restore it with restore(..., step={good}) "
            "or build Checkpoints(..., fallback=True)."
            if good is not None
            else (" No older step is intact." if searched else "")
        )
        super().__init__(f"Checkpoint step {step} is corrupt: {file}: {reason}.{older}")

    def with_good(self, good: int | None) -> CheckpointCorruptedError:
        return CheckpointCorruptedError(self.step, self.file, self.reason, good, searched=True)


class CheckpointFromNewerDewError(CheckpointError):
    """A step's manifest is whole (its digest matches) but in a layout a newer dew writes.

    It is not damage: the step is neither set aside nor skipped for an older
    one, and nothing on disk is changed.
    """

    def __init__(self, step: int, file: object, what: str, written: Mapping[str, str] | None = None) -> None:
        from dew.versions import described

        self.step = step
        self.file = str(file)
        by = f" ({described(written)})" if written else ""
        super().__init__(
            f"Checkpoint step {step} was written by a newer dew{by}: {file} {what}, which this dew does not "
            "read. Nothing was changed. Upgrade dew (pip install -U dew-core, with the dew distributions "
            "installed beside it) to resume or read this run.")


class CheckpointTreeMismatchError(CheckpointError, ValueError):
    """The restore template's leaves differ from the saved ones.

    written is the dew that wrote the step, as its meta records it: when
    it is not this one, the message says so, since a difference in dew's own
    state then comes from that change rather than from the recipe.
    """

    def __init__(self, step: int, differences: Sequence[str], written: Mapping[str, str] | None = None) -> None:
        from dew.versions import described, installed, not_installed

        self.step = step
        self.differences = tuple(differences)
        shown = "; ".join(self.differences[:12])
        more = f"; and {len(self.differences) - 12} more" if len(self.differences) > 12 else ""
        other = "" if written is None or not not_installed(written) else (
            f" The step was written by {described(written)}, and this is {described(installed())}: a difference "
            "in dew's own state (a TrainState field) comes from that change, not from the recipe; resume "
            "it with the dew that wrote it.")
        super().__init__(
            f"Checkpoint step {step} does not fit the state being restored: {shown}{more}. "
            "Nothing was changed on disk. Resume with the model and optimizer the run was trained "
            f"with, or start a fresh run in a new directory.{other}"
        )


class CheckpointLeaseHeldError(CheckpointError):
    """Another process holds the writer's lease of the directory."""

    def __init__(self, directory: object, lease: object, holder: Holder | None) -> None:
        self.directory = str(directory)
        self.holder = holder
        who = holder.describe() if holder is not None else "a process whose lease file cannot be read"
        super().__init__(
            f"{directory} is being written by {who}: only one process writes a run's checkpoints. "
            "Stop that run, or give this one another directory. If that process is gone (a process on "
            f"another host cannot be checked from here), delete {lease} and run again."
        )


class LocalStepsOwnedError(CheckpointError):
    """The local checkpoint folder holds another run's local steps (a copy of a run resumed where the
    original started shares the original's)."""

    def __init__(self, local: object, owner: object, run: object) -> None:
        super().__init__(
            f"The local checkpoint folder {local} holds the local steps of the run in {owner}, not of this one "
            f"in {run}: a copy of a run resumed where the original started finds the original's local folder, "
            "and each would restore the other's newest steps. Give this run a local folder of its own "
            "(trainer.local_checkpoint_dir=...), or remove that run if it is gone for good.")


class CheckpointMetaMismatchError(CheckpointError, ValueError):
    """A configuration field saved with the checkpoint differs from the current one."""

    def __init__(self, step: int, fields: Mapping[str, tuple[object, object]]) -> None:
        self.step = step
        self.fields = dict(fields)
        shown = "; ".join(f"{name}: saved {old!r}, now {new!r}" for name, (old, new) in self.fields.items())
        super().__init__(
            f"Checkpoint step {step} was trained with a different configuration ({shown}). "
            "Resume with the saved values, or start a fresh run in a new directory."
        )


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested step (or any step) is not in the directory."""


class PositionShareMismatchError(CheckpointError, ValueError):
    """The saved data position belongs to a share this process does not read."""

    def __init__(self, step: int, share: int, shares: int, saved: Sequence[int], saved_shares: int) -> None:
        self.step = step
        super().__init__(
            f"Checkpoint step {step} holds the data positions of shares {list(saved)} of "
            f"{saved_shares}, but this process reads share {share} of {shares}. A share's own "
            "offset only resumes on the same share: restore with the saved data partition, or "
            "use a dataset whose position is a global record count (train_stream)."
        )


class CheckpointDirectoryError(CheckpointError):
    """The checkpoint directory cannot be made or written: it (or a folder above it) is a file,
    it is read-only, or its disk is full."""

    def __init__(self, directory: object, cause: OSError) -> None:
        self.directory = str(directory)
        reasons = {
            errno.ENOTDIR: "it, or a folder above it, is a file",
            errno.EEXIST: "it, or a folder above it, is a file",
            errno.EROFS: "its filesystem is read-only",
            errno.EACCES: "this process may not write there",
            errno.EPERM: "this process may not write there",
            errno.ENOSPC: "its disk is full",
            errno.EISDIR: f"{os.path.basename(str(cause.filename))} in it is a folder where dew keeps a file; "
                          "move that folder away",
        }
        reason = reasons.get(cause.errno or 0, f"{type(cause).__name__}: {_first_line(cause)}")
        super().__init__(
            f"The checkpoint directory {directory} cannot be used: {reason}. Nothing in it was changed. "
            "Point the run at a directory this process can create and write (trainer.checkpoint_dir, or "
            "Checkpoints(directory)), or free disk space, then run again."
        )


class CheckpointPathEncodingError(CheckpointError, ValueError):
    """The checkpoint directory's path holds bytes that are no UTF-8, which Orbax cannot open."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        super().__init__(
            f"The checkpoint directory {directory!r} names bytes that are no UTF-8 text (shown escaped), and "
            "Orbax's storage layer (TensorStore) opens only UTF-8 paths. Rename the folder (each part of its path "
            "in UTF-8) and give the new name; nothing in it was changed."
        )


class CheckpointDirectoryNotSharedError(CheckpointError):
    """Some processes of a pool cannot see what process 0 writes."""

    def __init__(self, directory: object, missing: Sequence[int]) -> None:
        self.missing = tuple(missing)
        super().__init__(
            f"Processes {list(self.missing)} cannot see the probe file process 0 wrote into "
            f"{directory}. Every process of a pool must read and write the same checkpoint "
            "directory: put it on a shared filesystem or in a bucket (gs://...)."
        )


def require_same_meta(step: int, saved: Mapping[str, object], current: Mapping[str, object],
                      fields: Sequence[str] | None = None) -> None:
    """Raise CheckpointMetaMismatchError naming every field whose saved value differs.

    fields limits the comparison (default: every key of current). A field
    the checkpoint lacks counts as different.
    """
    names = list(current) if fields is None else list(fields)
    current = json.loads(json.dumps(dict(current)))  # compare as saved: tuples become lists
    missing = object()
    differing = {
        name: (saved.get(name, "<absent>"), current.get(name))
        for name in names
        if saved.get(name, missing) != current.get(name)
    }
    if differing:
        raise CheckpointMetaMismatchError(step, differing)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or repr(error)
    return text.splitlines()[0][:500].rstrip(".")
