"""The writer's lease: at most one process writes a checkpoint directory at a time.

The lease is a small JSON file in the directory (``.dew-writer.json``) naming
its holder: host, process id and the process's start time (with the boot it
started in). It is created with ``O_EXCL``, so two processes cannot both
create it; on one host the whole take-over is also serialized by ``flock`` on
the directory, so two processes recovering the same stale lease cannot both
win.

A lease is stale when its holder is provably gone: it names this host and its
process is dead, or a live process with that id started at another time (the
id was reused). A lease held from another host cannot be checked from here
and is never taken over; the refusal says which file to delete when that
process is known to be gone.

Several Checkpoints objects of one process may write the same directory (a
script that saves, then builds a second Trainer on the same directory): the
lease belongs to the process, and is counted, so the file goes away when the
last of them closes. In a bucket (``gs://``) there is no exclusive create; the
lease there is advisory (checked, then written).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dew.checkpoints.errors import CheckpointDirectoryError, CheckpointLeaseHeldError

if TYPE_CHECKING:
    from dew.checkpoints.store import Location

__all__ = ["LEASE", "Holder", "acquire", "holder_of", "release"]

_LOG = logging.getLogger("dew.checkpoints")
LEASE = ".dew-writer.json"
_UNREADABLE_GRACE_S = 5.0  # a lease file still unreadable after this long was torn by a crash
_held: dict[str, int] = {}  # directory -> how many objects of this process hold its lease
_held_lock = threading.Lock()


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: host, process id and the process's start time ("" where unknown)."""

    host: str
    pid: int
    start: str

    def describe(self) -> str:
        started = f", started {self.start}" if self.start else ""
        return f"process {self.pid} on host {self.host!r}{started}"


def _start_time(pid: int) -> str:
    """The boot id and start tick of pid from /proc ("" where /proc is not there), None-safe."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    # The command name may hold spaces and parentheses; the fields after its last ")" are fixed.
    fields = stat[stat.rindex(")") + 2:].split()
    return f"{boot}/{fields[19]}"


def this_process() -> Holder:
    """The Holder describing the calling process."""
    return Holder(host=socket.gethostname(), pid=os.getpid(), start=_start_time(os.getpid()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def is_gone(holder: Holder) -> bool:
    """True when holder is provably no longer running (only decidable on its own host)."""
    if holder.host != socket.gethostname():
        return False
    if not _alive(holder.pid):
        return True
    now = _start_time(holder.pid)
    return bool(holder.start and now and now != holder.start)


def holder_of(directory: Location) -> Holder | None:
    """The holder named by directory's lease file; None when there is none or it cannot be read."""
    try:
        data = json.loads((directory / LEASE).read_text())
        return Holder(host=str(data["host"]), pid=int(data["pid"]), start=str(data["start"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _local(directory: Location) -> bool:
    return isinstance(directory, Path)


@contextlib.contextmanager
def _serialized(directory: Location):
    """Hold an exclusive flock on directory (local paths), so a take-over is one act per host."""
    if not _local(directory):
        yield
        return
    import fcntl

    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the flock


def _create(directory: Location, me: Holder) -> bool:
    """Write the lease naming me if there is none; False when a lease file already exists."""
    payload = json.dumps({**asdict(me), "taken": time.time()}).encode()
    path = directory / LEASE
    if not _local(directory):
        if path.exists():
            return False
        path.write_bytes(payload)
        return True
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError as error:
        raise CheckpointDirectoryError(directory, error) from error
    try:
        os.write(descriptor, payload)
        os.fsync(descriptor)
    except OSError as error:  # a full disk: leave no empty lease behind
        os.close(descriptor)
        path.unlink(missing_ok=True)
        raise CheckpointDirectoryError(directory, error) from error
    os.close(descriptor)
    return True


def _age(path: Location) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except (OSError, AttributeError):
        return 0.0


def acquire(directory: Location) -> None:
    """Take (or join, within this process) the writer's lease of directory, creating directory.

    Raises CheckpointLeaseHeldError naming the holder when another live process
    holds it. A stale lease (its holder gone) is replaced, with a warning.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointDirectoryError(directory, error) from error
    me = this_process()
    key = str(directory)
    with _held_lock, _serialized(directory):
        for _ in range(50):
            if _create(directory, me):
                _held[key] = 1
                return
            holder = holder_of(directory)
            if holder == me:
                _held[key] = _held.get(key, 0) + 1
                return
            path = directory / LEASE
            if holder is None:
                if path.is_dir():  # not a lease a writer is between creating and filling, nor dew's to remove
                    raise CheckpointDirectoryError(directory, IsADirectoryError(errno.EISDIR, "a folder", str(path)))
                if _age(path) < _UNREADABLE_GRACE_S:
                    time.sleep(0.1)  # its writer may be between creating and filling it
                    continue
                _LOG.warning("Replacing the unreadable writer's lease %s.", path)
            elif is_gone(holder):
                _LOG.warning("Recovering the writer's lease of %s from %s, which is no longer running.",
                             directory, holder.describe())
            else:
                raise CheckpointLeaseHeldError(directory, path, holder)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        raise CheckpointLeaseHeldError(directory, directory / LEASE, holder_of(directory))


def release(directory: Location) -> None:
    """Drop this process's hold on directory's lease; the file goes when the last holder lets go."""
    key = str(directory)
    with _held_lock:
        count = _held.get(key, 0)
        if count > 1:
            _held[key] = count - 1
            return
        _held.pop(key, None)
        if count == 0:
            return
        if holder_of(directory) == this_process():
            try:
                (directory / LEASE).unlink()
            except OSError as error:
                if error.errno != errno.ENOENT:
                    _LOG.warning("Could not remove the writer's lease %s: %s", directory / LEASE, error)


def holds(directory: Location) -> bool:
    """True when this process holds directory's lease."""
    with _held_lock:
        return _held.get(str(directory), 0) > 0
