"""Local Arrow, Parquet and JSONL shards read as one column of rows, by global row number.

A corpus kept as Hugging Face datasets keep it (``save_to_disk`` folders of
``.arrow`` files, ``.parquet`` exports, ``.jsonl`` dumps) is read here with
pyarrow directly, never through a loading script, and never whole:

- Arrow files are memory-mapped (IPC file or stream format), so their pages
  are the operating system's to keep or drop;
- Parquet files are read one row group at a time (the last two stay cached),
  so a file's row groups, not the file, bound the memory (datasets and
  pyarrow write groups of a few hundred MB at most);
- JSONL files are indexed once by line offset (16 bytes a row), then read by
  seeking to the rows asked for.

``Shards(files, column)`` numbers the rows of all files in the order given;
``values(start, stop)`` returns the column's values of rows ``[start, stop)``.
A file without the column fails when it is opened, naming the file, the
column and the columns it has. Shards pickle as their paths, so a Grain
worker reopens them instead of copying data.

>>> import json, tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\\n" for t in "xyz"))
>>> shards = Shards(expand_shards(str(folder)), "text")
>>> len(shards), shards.values(1, 3)
(3, ['y', 'z'])
"""

from __future__ import annotations

import codecs
import fnmatch
import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.data.compressed import COMPRESSED_SUFFIXES, format_suffix
from dew.data.errors import (
    EmptyDatasetError,
    MalformedRecordError,
    MissingFileError,
    MissingKeyError,
    UnreadableFileError,
)
from dew.data.sources import expand_files, not_json_lines

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["SHARD_SUFFIXES", "Shards", "expand_shards", "open_shard", "reading_table", "sampled_digest"]

_JSON = (".jsonl", ".json", ".ndjson")
SHARD_SUFFIXES = (".parquet", ".arrow", *_JSON)
_WHITESPACE = np.asarray([9, 10, 13, 32], np.uint8)
_SCAN = 1 << 24  # bytes read at a time while indexing a JSONL file


def sampled_digest(path: Path, *, reads: int = 16, read: int = 1 << 12) -> str:
    """A short digest of a file's size and bytes: all of them in a file of up to reads x read
    bytes, else reads evenly spaced reads of read bytes, the first and the last among them. It
    reads 64 KiB of a file however large, so it sees most edits in place, not every one."""
    import hashlib

    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        if size <= reads * read:
            digest.update(handle.read())
        else:
            for i in range(reads):
                handle.seek((size - read) * i // (reads - 1))
                digest.update(handle.read(read))
    return digest.hexdigest()[:12]


def expand_shards(patterns: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Paths, globs and folders to shard files, in order.

    A folder ``save_to_disk`` wrote lists its Arrow files in ``state.json``;
    any other folder contributes its ``.parquet``, ``.arrow`` and ``.jsonl``
    files, sorted by name.
    """
    if isinstance(patterns, str | os.PathLike):
        patterns = [patterns]
    files: list[Path] = []
    for pattern in patterns:
        path = Path(os.fspath(pattern)).expanduser()
        if path.is_dir():
            files.extend(_folder_shards(path))
        else:
            files.extend(expand_files(os.fspath(pattern)))
    for path in files:
        unpack = COMPRESSED_SUFFIXES.get(path.suffix.lower())
        if unpack and format_suffix(path) in SHARD_SUFFIXES:
            raise MissingFileError(
                f"{os.fspath(path)!r} is compressed; shards are read at any row, which a compressed "
                f"stream cannot do. Unpack it ({unpack} {os.fspath(path)!r}) and name the file it leaves."
            )
        if path.suffix.lower() not in SHARD_SUFFIXES:
            raise MissingFileError(
                f"{os.fspath(path)!r} is not a shard this reader knows; it reads "
                f"{', '.join(SHARD_SUFFIXES)} files. Convert it, or leave it out of the pattern."
            )
    return files


# What datasets' save_to_disk writes beside the data: never rows.
_DATASETS_METADATA = frozenset({"state.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json"})


def _folder_shards(folder: Path) -> list[Path]:
    splits = folder / "dataset_dict.json"
    if splits.is_file():  # a DatasetDict's save_to_disk: one folder per split
        names = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise MissingFileError(
            f"The folder {os.fspath(folder)!r} holds a dataset's splits ({', '.join(names) or 'none'}), "
            f"each in its own folder. Pass the split to read, e.g. "
            f"{os.fspath(folder / next((n for n in names if n.startswith('train')), names[0] if names else 'train'))!r}."
        )
    state = folder / "state.json"
    if state.is_file():  # datasets' save_to_disk: the data files, in order
        listed = json.loads(state.read_text(encoding="utf-8")).get("_data_files", [])
        files = [folder / entry["filename"] for entry in listed if "filename" in entry]
        if files:
            return files
    files = sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix.lower() in SHARD_SUFFIXES and p.name not in _DATASETS_METADATA
    )
    if not files:
        raise MissingFileError(
            f"The folder {os.fspath(folder)!r} holds no {', '.join(SHARD_SUFFIXES)} file. Pass the "
            f"folder datasets' save_to_disk wrote, or the data files themselves."
        )
    _refuse_several_splits(folder, files)
    return files


# A hub dataset's shard (train-00000-of-00002.parquet, train_sft-00001-of-00003-<hash>.parquet) and
# a datasets cache's file (parquet-train.arrow, json-test-00000-of-00002.arrow) name their split.
_HUB_SHARD = re.compile(r"^(?P<split>[^-]+)-\d+-of-\d+")
_CACHE_FILE = re.compile(r"^[^-]+-(?P<split>[^-]+?)(-\d+-of-\d+)?\.arrow$")
# Otherwise a split's word, as datasets finds it in a file name: delimited by - . _ space or digits.
_SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                "val": "validation", "dev": "validation", "test": "test", "testing": "test", "eval": "test",
                "evaluation": "test"}


def _split_of(path: Path, cache: bool) -> str | None:
    """The split a data file's name says it belongs to (None: it names none)."""
    if cache and (found := _CACHE_FILE.match(path.name)):
        return found["split"]
    if found := _HUB_SHARD.match(path.name):
        return found["split"]
    words = [w for w in re.split(r"[-._ \d]+", path.name[: -len(path.suffix)].lower()) if w in _SPLIT_WORDS]
    return _SPLIT_WORDS[words[0]] if len(set(map(_SPLIT_WORDS.get, words))) == 1 else None


def _refuse_several_splits(folder: Path, files: Sequence[Path]) -> None:
    """MissingFileError when a folder's files belong to more than one split (a hub dataset's
    data/ folder, a datasets cache folder): read whole, a run would train on its test split too."""
    cache = (folder / "dataset_info.json").is_file()
    splits: dict[str, list[Path]] = {}
    for path in files:
        split = _split_of(path, cache)
        if split is not None:
            splits.setdefault(split, []).append(path)
    if len(splits) < 2:
        return

    def pattern(split: str) -> str:
        """A glob of the split's files in the folder (their names, where no glob takes them alone)."""
        first = splits[split][0].name
        end = first.lower().find(split.lower()) + len(split) if split.lower() in first.lower() else 0
        glob = first[:end] + (first[end] if first[end:end + 1] in ("-", "_", " ") else "") + "*" + splits[split][0].suffix
        matched = [p for p in files if fnmatch.fnmatchcase(p.name, glob)]
        return glob if matched == splits[split] else ", ".join(p.name for p in splits[split])

    named = "; ".join(f"{split}: {pattern(split)}" for split in sorted(splits))
    chosen = next((name for name in sorted(splits) if name.startswith("train")), sorted(splits)[0])
    raise MissingFileError(
        f"The folder {os.fspath(folder)!r} holds the files of {len(splits)} splits ({named}); read whole, "
        f"the run would train on all of them. Pass the files of the split to read, e.g. "
        f"{os.fspath(folder / pattern(chosen))!r} (a glob of every file reads them all, when they are one corpus).")


def _missing_column(path: Path, column: str, present: Sequence[str]) -> MissingKeyError:
    return MissingKeyError(
        f"The shard {os.fspath(path)!r} has no column {column!r}; its columns are "
        f"{list(present)}. Name the column that holds it with the reader's field for {column!r} (a ..._key "
        "field: dew describe READER lists them), or give the reader the files of its own format."
    )


@contextmanager
def reading_table(path: str | os.PathLike[str], kind: str) -> Iterator[None]:
    """Name the file when pyarrow cannot read it as kind (Parquet, Arrow): its own error names none,
    and a ValueError out of the data was taken for a refusal of the recipe's data fields."""
    import pyarrow as pa

    try:
        yield
    except pa.ArrowException as error:  # ArrowInvalid, ArrowIOError, ...: the file, not the recipe
        said = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise UnreadableFileError(
            f"{os.fspath(path)!r} cannot be read as a {kind} file ({said}): it may be cut short (a copy or "
            f"download that stopped), or another format under a {kind} name. Write it again (or give its "
            "real suffix), or leave it out of the files.") from error


class _Parquet:
    """A Parquet file, read a row group at a time (the last two kept)."""

    def __init__(self, path: Path, column: str, optional: bool = False) -> None:
        import pyarrow.parquet as pq

        self.path, self.column = path, column
        with reading_table(path, "Parquet"):
            self.file = pq.ParquetFile(path)  # buffered reads: only the row groups in use stay in memory
        names = self.file.schema_arrow.names
        self.absent = column not in names
        if self.absent and not optional:
            raise _missing_column(path, column, names)
        metadata = self.file.metadata
        sizes = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.rows = int(self.starts[-1])
        self.groups: OrderedDict[int, pa.ChunkedArray] = OrderedDict()

    def _group(self, index: int) -> pa.ChunkedArray:
        if index not in self.groups:
            if len(self.groups) >= 2:
                self.groups.popitem(last=False)
            with reading_table(self.path, "Parquet"):
                self.groups[index] = self.file.read_row_group(index, columns=[self.column]).column(0)
        self.groups.move_to_end(index)
        return self.groups[index]

    def where(self, row: int) -> str:
        return f"row {row + 1} of {os.fspath(self.path)!r}"  # counted from 1, as lines are

    def values(self, start: int, stop: int) -> list[Any]:
        if self.absent:
            return [None] * (stop - start)
        out: list[Any] = []
        group = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            begin, end = int(self.starts[group]), int(self.starts[group + 1])
            take = min(stop, end) - start
            out.extend(self._group(group).slice(start - begin, take).to_pylist())
            start += take
            group += 1
        return out


class _Arrow:
    """An Arrow IPC file (file or stream format), memory-mapped: nothing is copied until read."""

    def __init__(self, path: Path, column: str, optional: bool = False) -> None:
        import pyarrow as pa

        self.path, self.column = path, column
        source = pa.memory_map(os.fspath(path), "r")
        with reading_table(path, "Arrow"):
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_stream(source).read_all()
        self.rows = table.num_rows
        self.data = table.column(column) if column in table.column_names else None
        if self.data is None and not optional:
            raise _missing_column(path, column, table.column_names)

    def where(self, row: int) -> str:
        return f"row {row + 1} of {os.fspath(self.path)!r}"  # counted from 1, as lines are

    def values(self, start: int, stop: int) -> list[Any]:
        if self.data is None:
            return [None] * (stop - start)
        return self.data.slice(start, stop - start).to_pylist()


class _Jsonl:
    """A JSON-lines file, indexed by the byte offsets of its non-blank lines."""

    def __init__(self, path: Path, column: str, optional: bool = False) -> None:
        self.path, self.column, self.optional = path, column, optional
        self.begins, self.ends = _line_index(path)
        self.rows = len(self.begins)
        if self.rows and not optional:
            first = self._parse(self._read(0, 1)[0], 0)
            if column not in first:
                raise _missing_column(path, column, sorted(first))

    def _read(self, start: int, stop: int) -> list[bytes]:
        with open(self.path, "rb") as handle:
            handle.seek(int(self.begins[start]))
            blob = handle.read(int(self.ends[stop - 1] - self.begins[start]))
        base = int(self.begins[start])
        return [blob[int(b) - base:int(e) - base] for b, e in zip(self.begins[start:stop], self.ends[start:stop],
                                                                 strict=True)]

    def _line(self, row: int) -> int:
        """The 1-based line number of a row (counted only when an error needs it)."""
        with open(self.path, "rb") as handle:
            return handle.read(int(self.begins[row])).count(b"\n") + 1

    def where(self, row: int) -> str:
        return f"line {self._line(row)} of {os.fspath(self.path)!r}"

    def _parse(self, line: bytes, row: int) -> dict[str, object]:
        if row == 0 and (wrong := not_json_lines(self.path, line.decode("utf-8", "replace"))):
            raise wrong
        try:
            record = json.loads(line)
        except UnicodeDecodeError as error:
            raise MalformedRecordError(
                f"Line {self._line(row)} of {os.fspath(self.path)!r} is not UTF-8 text ({error.reason}, byte "
                f"{line[error.start]:#04x} at column {error.start + 1}); write the file as UTF-8."
            ) from None
        except json.JSONDecodeError as error:
            raise MalformedRecordError(
                f"Line {self._line(row)} of {os.fspath(self.path)!r} is not valid JSON ({error.msg}); "
                f"each line of a JSONL file must be one JSON object."
            ) from None
        if not isinstance(record, dict):
            raise MalformedRecordError(
                f"Line {self._line(row)} of {os.fspath(self.path)!r} holds a {type(record).__name__}, "
                f"not a JSON object; each line of a JSONL file must be one."
            )
        return record

    def values(self, start: int, stop: int) -> list[Any]:
        out = []
        for row, line in enumerate(self._read(start, stop), start):
            record = self._parse(line, row)
            if self.column not in record and not self.optional:
                raise MissingKeyError(
                    f"Line {self._line(row)} of {os.fspath(self.path)!r} has no key {self.column!r} "
                    f"(it has {sorted(record)}). Name the key that holds the data."
                )
            out.append(record.get(self.column))
        return out


def _line_index(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets where each non-blank line of path begins and ends (newline excluded).

    One pass in chunks: the newlines' offsets, and how many non-whitespace
    bytes come before each, so a line holding only whitespace is left out.
    """
    ends, solid = [], []
    offset = total = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_SCAN):
            data = np.frombuffer(chunk, np.uint8)
            solid_bytes = ~np.isin(data, _WHITESPACE)
            if offset == 0 and chunk.startswith(codecs.BOM_UTF8):  # a byte-order mark is no text
                solid_bytes[:3] = False
            counted = np.cumsum(solid_bytes, dtype=np.int32)
            newlines = np.flatnonzero(data == 10)
            ends.append(newlines.astype(np.int64) + offset)
            solid.append(counted[newlines].astype(np.int64) + total)
            offset += len(data)
            total += int(counted[-1])
    stops = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    before = np.concatenate(solid) if solid else np.zeros(0, np.int64)
    if offset and (len(stops) == 0 or stops[-1] != offset - 1):  # a last line without a newline
        stops, before = np.append(stops, offset), np.append(before, total)
    begins = np.concatenate([[0], stops[:-1] + 1]).astype(np.int64) if len(stops) else stops
    keep = np.diff(np.concatenate([[0], before])) > 0
    return begins[keep], stops[keep]


def open_shard(path: Path, column: str, optional: bool = False) -> _Parquet | _Arrow | _Jsonl:
    """The reader for one shard file, by its suffix (optional: a missing column reads as None)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _Parquet(path, column, optional)
    if suffix == ".arrow":
        return _Arrow(path, column, optional)
    return _Jsonl(path, column, optional)


class Shards:
    """One column of several shard files, as rows numbered across the files in order.

    With optional, a file or record without the column reads as None instead of failing.
    """

    def __init__(self, files: Sequence[str | os.PathLike[str]], column: str, *, optional: bool = False) -> None:
        self.files = tuple(Path(f) for f in files)
        self.column = column
        self.optional = optional
        if not self.files:
            raise EmptyDatasetError("No shard files were given; pass at least one path, glob or folder.")
        self._open()

    def _open(self) -> None:
        self.shards = [open_shard(path, self.column, self.optional) for path in self.files]
        self.starts = np.concatenate([[0], np.cumsum([s.rows for s in self.shards], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def values(self, start: int, stop: int) -> list[Any]:
        """The column's values of rows [start, stop), across file boundaries."""
        out: list[Any] = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            begin, end = int(self.starts[shard]), int(self.starts[shard + 1])
            take = min(stop, end) - start
            if take > 0:
                out.extend(self.shards[shard].values(start - begin, start - begin + take))
            start += max(take, 0)
            shard += 1
        return out

    def file_digests(self) -> list[tuple[str, str]]:
        """(file, sampled_digest) of each file, in order: what a position saved over them keeps."""
        return [(os.fspath(path), sampled_digest(path)) for path in self.files]

    def where(self, row: int) -> str:
        """Where a row is, for messages: its line of a JSONL file, else its row of the file."""
        shard = int(np.searchsorted(self.starts, row, side="right")) - 1
        return self.shards[shard].where(row - int(self.starts[shard]))

    def __getstate__(self) -> tuple[tuple[Path, ...], str, bool]:
        return self.files, self.column, self.optional

    def __setstate__(self, state: tuple[tuple[Path, ...], str, bool]) -> None:
        self.files, self.column, self.optional = state
        self._open()

    def __repr__(self) -> str:
        return f"Shards({len(self.files)} files, column={self.column!r}, rows={len(self)})"
