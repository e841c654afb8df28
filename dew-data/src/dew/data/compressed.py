"""Data files read through their compression: gzip, bzip2, xz and zstd, by their first bytes.

``open_data_file`` streams a file's bytes decompressed (a corpus published as ``.jsonl.zst`` or
``.json.gz`` is read as it is, never unpacked to disk) and names a damaged one; ``format_suffix``
is the suffix that says what the decompressed bytes hold.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dew.data.errors import MalformedRecordError
from dew.data.magic import compression_of

__all__ = ["COMPRESSED_SUFFIXES", "format_suffix", "open_data_file"]


class _ZstdFrames(io.RawIOBase):
    """A zstd file's bytes as they are decompressed, frame after frame (``zstd`` run on a stream
    writes several). zstandard's own stream reader ends quietly where a cut file ends, even
    inside a frame; here that is an EOFError, as gzip's reader raises, and zstandard's own error
    an OSError, as gzip's BadGzipFile is."""

    CHUNK = 1 << 16

    def __init__(self, path: Path) -> None:
        import zstandard

        super().__init__()
        self._file = path.open("rb")
        self._frame = zstandard.ZstdDecompressor().decompressobj
        self._error = zstandard.ZstdError
        self._decompressor = self._frame()
        self._pending, self._leftover, self._inside = b"", b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            data = self._leftover or self._file.read(self.CHUNK)
            self._leftover = b""
            if not data:
                if self._inside:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            if self._decompressor.eof:  # the next frame
                self._decompressor = self._frame()
            try:
                self._pending = self._decompressor.decompress(data)
            except self._error as error:
                raise OSError(str(error)) from None
            self._inside = not self._decompressor.eof
            if self._decompressor.eof:
                self._leftover = self._decompressor.unused_data
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


def _zstd_file(path: Path) -> io.BufferedIOBase:
    return io.BufferedReader(_ZstdFrames(path))


# Compressions read as they stream, by their files' first bytes (the corpora published as
# .jsonl.zst, .json.gz, ...).
# Each compression known by its first bytes (dew.data.magic), with what streams it.
_STREAMED: dict[str, Callable[[Path], io.BufferedIOBase]] = {
    "gzip": gzip.GzipFile, "bzip2": bz2.BZ2File, "xz": lzma.LZMAFile, "zstd": _zstd_file}
# Containers of several files, not one stream: the command that opens them.
_UNREAD: dict[str, str] = {"zip": "unzip"}
# The suffixes of those compressions, with the command that unpacks such a file.
COMPRESSED_SUFFIXES = {".gz": "gunzip -k", ".bz2": "bunzip2 -k", ".xz": "unxz -k", ".zst": "zstd -d -k"}


# a stream cut short, or not its format (gzip's BadGzipFile, bz2's "Invalid data stream" and the
# zstd reader's errors are OSErrors)
_DAMAGE = (EOFError, OSError, zlib.error, lzma.LZMAError)


class _Decompressed(io.BufferedIOBase):
    """A compressed file's stream whose damage (cut short, or not the compression its first bytes
    claim) is a MalformedRecordError naming the file, not the decompressor's bare EOFError."""

    def __init__(self, stream: io.BufferedIOBase, path: Path, compression: str) -> None:
        super().__init__()
        self._stream, self._path, self._compression = stream, path, compression

    def _damaged(self, error: Exception) -> MalformedRecordError:
        return MalformedRecordError(
            f"{os.fspath(self._path)!r} is a damaged {self._compression} file ({error}): it was cut short "
            "or written wrongly. Fetch or compress it again, or leave it out of the data.")

    def readable(self) -> bool:
        return True

    def _through(self, call: Callable[[int | None], bytes], size: int | None) -> bytes:
        try:
            return call(size)
        except _DAMAGE as error:
            raise self._damaged(error) from None

    def read(self, size: int | None = -1) -> bytes:
        return self._through(self._stream.read, size)

    def readline(self, size: int | None = -1) -> bytes:
        return self._through(self._stream.readline, size)

    def close(self) -> None:
        self._stream.close()
        super().close()


def open_data_file(path: Path) -> io.BufferedIOBase:
    """A data file's bytes, decompressed as they are read when it is gzip, bzip2, xz or zstd
    (a damaged one is a MalformedRecordError naming it).

    A zip file is refused (MalformedRecordError) with the command that unpacks it.
    """
    with path.open("rb") as handle:
        head = handle.read(6)
    name = compression_of(head)
    if name in _STREAMED:
        return _Decompressed(_STREAMED[name](path), path, name)
    if name in _UNREAD:
        raise MalformedRecordError(
            f"{os.fspath(path)!r} is {name}-compressed, which dew does not read; unpack it "
            f"({_UNREAD[name]} {os.fspath(path)!r}) and point the data at what it holds."
        )
    return path.open("rb")


def format_suffix(path: Path) -> str:
    """The suffix that names a file's format, under a compression's (``a.jsonl.gz`` is ``.jsonl``)."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    if len(suffixes) > 1 and suffixes[-1] in COMPRESSED_SUFFIXES:
        return suffixes[-2]
    return path.suffix.lower()
