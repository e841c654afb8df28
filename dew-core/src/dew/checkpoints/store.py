"""Where Checkpoints keeps its steps: one directory, its Orbax manager, and housekeeping.

A step is committed when its directory has its plain number as name (Orbax
renames ``N.orbax-checkpoint-tmp`` to ``N`` as the last act of a save); in a
bucket, where there is no rename, when ``commit_success.txt`` is present.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import orbax.checkpoint as ocp
from etils import epath

from dew.checkpoints.errors import (
    CheckpointDirectoryError,
    CheckpointPathEncodingError,
    PositionShareMismatchError,
)
from dew.checkpoints.manifest import Positions
from dew.data.base import DataPartition, is_global_position

if TYPE_CHECKING:
    from dew.checkpoints.manager import _Pending

__all__ = ["PRUNED", "TMP", "Location", "Store", "read_position", "remove_half_written", "remove_step", "rmtree", "store_path"]

_LOG = logging.getLogger("dew.checkpoints")
TMP = ".orbax-checkpoint-tmp"
PRUNED = ".dew-pruned"  # a kept step being removed: renamed first, so readers see it gone at once

Location: TypeAlias = Path | epath.Path
"""Where checkpoints live: a local path, or a bucket's (``gs://...``) as etils reads it."""


@dataclass
class Store:
    """One directory and the Orbax manager that writes into it."""

    directory: Location
    local: bool
    per_process: bool = False  # a pool's local store: this process's own folder, its own shards
    manager: ocp.CheckpointManager | None = None
    pending: _Pending | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def step_path(self, step: int) -> Location:
        return self.directory / str(step)

    def committed(self) -> list[int]:
        if not self.directory.exists():
            return []
        bucket = str(self.directory).startswith("gs://")
        if not bucket and not self.directory.is_dir():
            raise CheckpointDirectoryError(self.directory, NotADirectoryError(errno.ENOTDIR, "Not a directory"))
        steps = [
            int(entry.name) for entry in self.directory.iterdir()
            if entry.name.isdigit() and entry.is_dir()
            and (not bucket or (entry / "commit_success.txt").exists())
        ]
        return sorted(steps)


def store_path(directory: str | os.PathLike) -> Location:
    text = os.fspath(directory)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes the file system holds as they are (Python's surrogate escapes)
        raise CheckpointPathEncodingError(text) from None
    if "://" in text:
        return epath.Path(text)
    return Path(os.path.abspath(os.path.expanduser(text)))


def read_position(step: int, data: Positions, partition: DataPartition) -> bytes | None:
    """This process's data position from a step's saved positions (one every share reads, if global)."""
    saved = data.decoded()
    if all(value is None for value in saved.values()):
        return None
    if data.shares == partition.shares and partition.share in saved:
        return saved[partition.share]
    anyone = next((value for value in saved.values() if is_global_position(value)), None)
    if anyone is not None:
        return anyone
    raise PositionShareMismatchError(step, partition.share, partition.shares, sorted(saved), data.shares)


def remove_half_written(directory: Location) -> None:
    """Delete the steps a writer left unfinished, saving or removing them (only the directory's
    writer may call this)."""
    for entry in directory.iterdir():
        if TMP in entry.name or entry.name.endswith(PRUNED):
            _LOG.info("Removing the half-written checkpoint %s.", entry)
            rmtree(entry)


def rmtree(path: Location) -> None:
    """Remove path and what it holds; a link alone, never what it points at (a shared run's step
    may link to another folder of the reader's)."""
    if isinstance(path, Path):
        if path.is_symlink():
            path.unlink()
            return
        shutil.rmtree(path, ignore_errors=False)
    else:
        path.rmtree()



def remove_step(store: Store, step: int) -> None:
    """Remove a committed step. A local one first leaves its numbered name in one rename, so a
    reader of a live run never finds half of it (it finds the step gone, and reads a newer one);
    what a kill leaves of it goes with the half-written steps (remove_half_written)."""
    path = store.step_path(step)
    if not isinstance(path, Path):  # a bucket has no rename in one step: removed in place
        rmtree(path)
        return
    gone = path.with_name(f".{step}{PRUNED}")
    os.rename(path, gone)
    rmtree(gone)
