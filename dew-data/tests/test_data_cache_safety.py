"""The TokenWindows cache stays in its own directory and serves only its own, intact output.

Each test plants what another user of a shared cache directory could: a
symlink at the temporary name the writer used to predict, a file with the
cache's right name but other windows, a symlink at the cache's name. The
windows read back are checked against the bytes packed by hand.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dew.data import TokenWindows
from dew.data.window_cache import StaleCacheWarning
from test_data_token_windows import DOCS, packed_bytes

LENGTH = 9


@pytest.fixture
def files(tmp_path) -> list[str]:
    paths = []
    for i, doc in enumerate(DOCS):
        path = tmp_path / "txt" / f"{i:02d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(doc, encoding="utf-8")
        paths.append(str(path))
    return paths


def _cache_name(files: list[str], scratch: Path) -> str:
    """The file name the honest writer gives these inputs (found by building it elsewhere)."""
    TokenWindows(files=files, length=LENGTH, cache_dir=str(scratch)).windows()
    (name,) = [p.name for p in scratch.glob("token-windows-*.npy")]
    return name


def _victim(tmp_path: Path) -> tuple[Path, bytes]:
    victim = tmp_path / "elsewhere" / "precious.npy"
    victim.parent.mkdir()
    np.save(victim, np.full((3, LENGTH + 1), 7, np.int32))
    return victim, victim.read_bytes()


def test_a_symlink_at_the_old_predictable_temporary_name_is_not_followed(tmp_path, files):
    name = _cache_name(files, tmp_path / "scratch")
    victim, before = _victim(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    predictable = (shared / name).with_suffix(f".{os.getpid()}.tmp.npy")
    predictable.symlink_to(victim)
    windows = TokenWindows(files=files, length=LENGTH, cache_dir=str(shared)).windows()
    np.testing.assert_array_equal(windows, packed_bytes(DOCS, LENGTH))
    assert victim.read_bytes() == before  # nothing was written through the link
    cached = shared / name
    assert cached.is_file() and not cached.is_symlink()
    assert not [p for p in shared.iterdir() if p.name.endswith(".tmp")]  # no temporary left


def test_a_planted_file_with_the_right_name_is_rejected_and_rebuilt(tmp_path, files):
    scratch = tmp_path / "scratch"
    name = _cache_name(files, scratch)
    shared = tmp_path / "shared"
    shared.mkdir()
    # Another user copies the honest record and plants other windows under the right name.
    np.save(shared / name, np.zeros((5, LENGTH + 1), np.int32))
    record = Path(name).with_suffix(".json").name
    (shared / record).write_bytes((scratch / record).read_bytes())
    with pytest.warns(StaleCacheWarning, match="contents differ from the digest"):
        windows = TokenWindows(files=files, length=LENGTH, cache_dir=str(shared)).windows()
    np.testing.assert_array_equal(windows, packed_bytes(DOCS, LENGTH))
    # Rebuilt in place: the next load is served from the cache, silently.
    again = TokenWindows(files=files, length=LENGTH, cache_dir=str(shared)).windows()
    assert isinstance(again, np.memmap)
    np.testing.assert_array_equal(again, packed_bytes(DOCS, LENGTH))


def test_a_planted_file_without_a_record_is_rejected(tmp_path, files):
    name = _cache_name(files, tmp_path / "scratch")
    shared = tmp_path / "shared"
    shared.mkdir()
    np.save(shared / name, np.zeros((5, LENGTH + 1), np.int32))
    with pytest.warns(StaleCacheWarning, match="is missing"):
        windows = TokenWindows(files=files, length=LENGTH, cache_dir=str(shared)).windows()
    np.testing.assert_array_equal(windows, packed_bytes(DOCS, LENGTH))


def test_a_symlink_at_the_cache_name_is_neither_read_nor_written_through(tmp_path, files):
    name = _cache_name(files, tmp_path / "scratch")
    victim, before = _victim(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / name).symlink_to(victim)
    with pytest.warns(StaleCacheWarning, match="symbolic link"):
        windows = TokenWindows(files=files, length=LENGTH, cache_dir=str(shared)).windows()
    np.testing.assert_array_equal(windows, packed_bytes(DOCS, LENGTH))
    assert victim.read_bytes() == before
    assert not (shared / name).is_symlink()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_a_cache_file_owned_by_another_user_is_rejected(tmp_path, files):
    shared = tmp_path / "shared"
    name = _cache_name(files, shared)  # an honest cache, then handed to another user
    for path in shared.iterdir():
        os.chown(path, 65534, 65534)
    with pytest.warns(StaleCacheWarning, match="belongs to user id 65534"):
        windows = TokenWindows(files=files, length=LENGTH, cache_dir=str(shared)).windows()
    np.testing.assert_array_equal(windows, packed_bytes(DOCS, LENGTH))
    assert (shared / name).stat().st_uid == os.geteuid()


def test_the_key_follows_the_contents_not_the_size_and_time(tmp_path, files):
    cache = tmp_path / "cache"
    reader = TokenWindows(files=files, length=LENGTH, cache_dir=str(cache))
    reader.windows()
    first = Path(files[0])
    stamp = first.stat()
    edited = DOCS[0].upper()  # same length in bytes, other text
    first.write_text(edited, encoding="utf-8")
    os.utime(first, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert first.stat().st_size == stamp.st_size and first.stat().st_mtime_ns == stamp.st_mtime_ns
    np.testing.assert_array_equal(reader.windows(), packed_bytes([edited, *DOCS[1:]], LENGTH))
