"""How a data file's compression is known by its first bytes, whatever its name says.

The readers of dew-data decompress what they can stream; an evaluation task (dew-core) reads
plain JSONL and names a compressed file instead of calling it text that is not UTF-8.

>>> compression_of(b"\\x1f\\x8b\\x08..."), compression_of(b'{"question": 1}')
('gzip', None)
"""

from __future__ import annotations

__all__ = ["COMPRESSIONS", "compression_of"]

COMPRESSIONS: dict[bytes, str] = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"PK\x03\x04": "zip",  # a container of several files, not one stream
}


def compression_of(head: bytes) -> str | None:
    """The compression whose magic bytes head begins with (None: none of them)."""
    return next((name for magic, name in COMPRESSIONS.items() if head.startswith(magic)), None)
