"""Record sources that train_stream reads, and where text comes from.

A record source is anything with ``len(source)`` and ``source[i]`` returning a
mapping of column name to numpy array (one record). A source that also has
``take(indices)`` returns the stacked columns of many records in one call,
which is how array-backed sources stay fast: a batch is one fancy index.

``stdlib_corpus`` lists the Python standard library's own ``.py`` files, a
corpus every machine with Python has, so the default recipe needs no download.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dew.data.errors import EmptyDatasetError, MissingFileError

__all__ = ["ArrayRecords", "RecordSource", "expand_files", "stdlib_corpus"]


@runtime_checkable
class RecordSource(Protocol):
    """Random access to records: ``len`` and ``source[i] -> {column: array}``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Mapping[str, Any]: ...


class ArrayRecords:
    """Records stored as equally long numpy arrays, one per column.

    Row ``i`` of every column is record ``i``. ``take`` gathers many rows with
    one fancy index per column. Memory-mapped columns pickle as their file
    name, so a worker process reopens the map instead of copying the data.

    >>> import numpy as np
    >>> records = ArrayRecords({"text": np.arange(6).reshape(3, 2)})
    >>> len(records), records.take(np.array([2, 0]))["text"].tolist()
    (3, [[4, 5], [0, 1]])
    """

    def __init__(self, columns: Mapping[str, np.ndarray]) -> None:
        if not columns:
            raise EmptyDatasetError("ArrayRecords needs at least one column; got none.")
        lengths = {name: len(array) for name, array in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(
                f"ArrayRecords' columns must hold the same number of rows; got {lengths}."
            )
        self.columns = dict(columns)
        self._length = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: array[index] for name, array in self.columns.items()}

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The stacked rows at indices (a fresh array per column, not a view)."""
        return {name: np.asarray(array[indices]) for name, array in self.columns.items()}

    def subset(self, indices: np.ndarray) -> ArrayRecords:
        """The records at indices, in that order, copied into memory."""
        return ArrayRecords({name: np.asarray(array[indices]) for name, array in self.columns.items()})

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_array_records, ({n: _picklable(a) for n, a in self.columns.items()},))

    def __repr__(self) -> str:
        shapes = {name: (array.shape, str(array.dtype)) for name, array in self.columns.items()}
        return f"ArrayRecords({shapes})"


def _picklable(array: np.ndarray) -> Any:
    if isinstance(array, np.memmap) and array.filename is not None and array.base is not None:
        return ("memmap", str(array.filename), array.offset, array.dtype.str, array.shape)
    return array


def _reopen(value: Any) -> np.ndarray:
    if isinstance(value, tuple) and value and value[0] == "memmap":
        _, filename, offset, dtype, shape = value
        return np.memmap(filename, mode="r", dtype=np.dtype(dtype), shape=shape, offset=offset)
    return value


def _rebuild_array_records(columns: dict[str, Any]) -> ArrayRecords:
    return ArrayRecords({name: _reopen(value) for name, value in columns.items()})


def expand_files(patterns: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Paths and globs to a list of files, in the order given (globs sorted).

    Raises MissingFileError naming the first path or glob that matches no file.
    """
    if isinstance(patterns, str | os.PathLike):
        patterns = [patterns]
    files: list[Path] = []
    for pattern in patterns:
        text = os.fspath(pattern)
        if glob.has_magic(text):
            matched = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
            if not matched:
                raise MissingFileError(
                    f"The glob {text!r} matches no file. Check the pattern and the directory "
                    f"it starts from ({Path(text).parent})."
                )
            files.extend(matched)
        else:
            path = Path(text)
            if not path.is_file():
                what = "is a directory, not a file" if path.is_dir() else "does not exist"
                raise MissingFileError(
                    f"The data file {text!r} {what}. Pass existing files or a glob such as "
                    f"'{path / '*.txt' if path.is_dir() else text}'."
                )
            files.append(path)
    if not files:
        raise EmptyDatasetError("No input files were given; pass at least one path or glob.")
    return files


def stdlib_corpus(limit_files: int | None = None) -> list[Path]:
    """The standard library's own ``.py`` files, sorted by relative path.

    Test suites, ``site-packages`` and ``idlelib``'s icons are left out; what
    remains is ordinary Python source present on every machine. limit_files
    keeps the first that many files (in the same deterministic order).

    >>> files = stdlib_corpus(limit_files=3)
    >>> len(files), all(f.suffix == ".py" for f in files)
    (3, True)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    found: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in skip and not d.startswith("."))
        found.extend(Path(directory) / name for name in names if name.endswith(".py"))
    found.sort(key=lambda path: path.relative_to(root).as_posix())
    if not found:
        raise EmptyDatasetError(f"No .py files under the standard library at {root}.")
    return found if limit_files is None else found[: max(0, int(limit_files))]


def as_sequence(value: Sequence[Any] | Any) -> list[Any]:
    """A list from a single value or a sequence (strings count as single values)."""
    if isinstance(value, str | bytes | os.PathLike) or not isinstance(value, Sequence):
        return [value]
    return list(value)
