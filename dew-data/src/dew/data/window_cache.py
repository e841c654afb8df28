"""A cache of token windows on disk that only its writer's own, intact output can satisfy.

A cache directory may be shared (``/tmp``, a team folder), so neither its
names nor its files are trusted. Each array is written under a fresh
``tempfile`` name in the target directory, opened exclusively (a symlink
planted at a guessable name is never followed), then renamed into place; a
small JSON record beside it holds the key it was built for and the SHA-256 of
the array file. A cached file is used only when it is a regular file owned by
this user, its record names the same key, and its bytes still have the
recorded digest; anything else is ignored with a StaleCacheWarning and
rebuilt. The key itself is a digest of the inputs' contents (see
``content_digest``), the tokenizer and the window length, so text edited in
place under an unchanged size and modification time is not served stale.

>>> import tempfile, numpy as np
>>> folder = tempfile.mkdtemp()
>>> path = write(folder, "abc", np.arange(6, dtype=np.int32).reshape(2, 3))
>>> read(folder, "abc").tolist()
[[0, 1, 2], [3, 4, 5]]
>>> read(folder, "other") is None
True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np

__all__ = ["StaleCacheWarning", "cache_path", "content_digest", "read", "write"]

_FORMAT = 1


class StaleCacheWarning(UserWarning):
    """A cached file was ignored (wrong owner, not a plain file, or not what was recorded)."""


def content_digest(paths: Iterable[Path]) -> list[tuple[str, int, str]]:
    """(path, size, SHA-256 of the bytes) for each file, in the order given."""
    out = []
    for path in paths:
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        out.append((os.fspath(path), path.stat().st_size, digest))
    return out


def cache_path(directory: str | os.PathLike[str], key: str) -> Path:
    """Where the windows keyed key live in directory."""
    return Path(directory).expanduser() / f"token-windows-{key}.npy"


def _record_path(path: Path) -> Path:
    return path.with_suffix(".json")


def _file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _problem(path: Path, key: str) -> str | None:
    """Why the cached file at path cannot be trusted, or None when it can."""
    record_path = _record_path(path)
    for candidate in (path, record_path):
        try:
            info = candidate.lstat()
        except FileNotFoundError:
            return f"{candidate.name} is missing"
        if stat.S_ISLNK(info.st_mode):
            return f"{candidate.name} is a symbolic link"
        if not stat.S_ISREG(info.st_mode):
            return f"{candidate.name} is not a regular file"
        geteuid = getattr(os, "geteuid", None)  # POSIX only
        if geteuid is not None and info.st_uid != geteuid():
            return f"{candidate.name} belongs to user id {info.st_uid}, not to this user"
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "its record is unreadable"
    if not isinstance(record, dict) or record.get("format") != _FORMAT or record.get("key") != key:
        return "its record was written for other inputs"
    if record.get("sha256") != _file_digest(path):
        return "its contents differ from the digest recorded when it was written"
    return None


def read(directory: str | os.PathLike[str], key: str) -> np.ndarray | None:
    """The cached windows for key, memory-mapped, or None (with a warning when a file was refused)."""
    path = cache_path(directory, key)
    if not os.path.lexists(path) and not os.path.lexists(_record_path(path)):
        return None
    problem = _problem(path, key)
    if problem is None:
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            problem = f"it cannot be read as an array ({error})"
    warnings.warn(
        StaleCacheWarning(f"Ignoring the cached token windows {os.fspath(path)!r}: {problem}. "
                          "Rebuilding them from the inputs."),
        stacklevel=3,
    )
    return None


def _replace_with(target: Path, fill) -> None:
    """Write through a fresh, exclusive temporary file beside target, then rename it over target."""
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below, renamed or removed
        dir=target.parent, prefix=f".{target.name}.", suffix=".tmp", delete=False
    )
    try:
        with handle:
            fill(handle)
        os.replace(handle.name, target)  # replaces a planted symlink itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
        raise


def write(directory: str | os.PathLike[str], key: str, windows: np.ndarray) -> Path:
    """Store windows under key in directory (atomically, see the module docstring); return the path."""
    path = cache_path(directory, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()

    def array(handle) -> None:
        np.save(handle, np.ascontiguousarray(windows), allow_pickle=False)
        handle.flush()
        handle.seek(0)
        while chunk := handle.read(1 << 22):
            digest.update(chunk)

    _replace_with(path, array)
    record = json.dumps({"format": _FORMAT, "key": key, "sha256": digest.hexdigest(),
                         "shape": list(windows.shape)})
    _replace_with(_record_path(path), lambda handle: handle.write(record.encode("utf-8")))
    return path
