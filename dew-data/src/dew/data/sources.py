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
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, overload, runtime_checkable

import numpy as np

from dew.data.compressed import format_suffix, open_data_file
from dew.data.errors import (
    EmptyDatasetError,
    LoadingScriptError,
    MalformedRecordError,
    MissingFileError,
    MissingKeyError,
)

if TYPE_CHECKING:
    import datasets

__all__ = [
    "ArrayRecords",
    "RecordSource",
    "expand_files",
    "json_records",
    "load_hf_dataset",
    "not_json_lines",
    "require_column",
    "stdlib_corpus",
    "utf8_lines",
]


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

    def __init__(self, columns: Mapping[str, np.ndarray], rows: np.ndarray | None = None, *,
                 unhashed: Iterable[str] = ()) -> None:
        if not columns:
            raise EmptyDatasetError("ArrayRecords needs at least one column; got none.")
        lengths = {name: len(array) for name, array in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(
                f"ArrayRecords' columns must hold the same number of rows; got {lengths}."
            )
        self.columns = dict(columns)
        self.rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        # Columns the fingerprint leaves out: ones another column already stands for (the prompts
        # as written beside their ids), so a position saved before such a column existed resumes.
        self.unhashed = frozenset(unhashed)
        self._fingerprint: str | None = None
        self._length = next(iter(lengths.values())) if self.rows is None else len(self.rows)

    def __len__(self) -> int:
        return self._length

    @overload
    def _map(self, indices: int) -> int | np.integer: ...

    @overload
    def _map(self, indices: np.ndarray) -> np.ndarray: ...

    def _map(self, indices: int | np.ndarray) -> int | np.integer | np.ndarray:
        return indices if self.rows is None else self.rows[indices]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -self._length <= index < self._length:
            raise IndexError(f"Record {index} is outside [0, {self._length}).")
        row = self._map(index)
        return {name: array[row] for name, array in self.columns.items()}

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The stacked rows at indices (a fresh array per column, not a view)."""
        rows = self._map(np.asarray(indices, dtype=np.int64))
        return {name: np.asarray(array[rows]) for name, array in self.columns.items()}

    def subset(self, indices: np.ndarray) -> ArrayRecords:
        """The records at indices, in that order, sharing this one's arrays (no copy)."""
        return ArrayRecords(self.columns, self._map(np.asarray(indices, dtype=np.int64)), unhashed=self.unhashed)

    def fingerprint(self) -> str:
        """A digest of what the records hold (every column's bytes but the unhashed, and which rows): a stream's
        saved position keeps it, so a resume over data edited since is told, not trained on.
        Computed once, on first use (a pass over the arrays)."""
        if self._fingerprint is None:
            import hashlib

            digest = hashlib.sha256()
            for name in sorted(set(self.columns) - self.unhashed):
                array = np.ascontiguousarray(self.columns[name])
                digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
                digest.update(array.reshape(-1).view(np.uint8).data)
            if self.rows is not None:
                digest.update(np.ascontiguousarray(self.rows).view(np.uint8).data)
            self._fingerprint = digest.hexdigest()[:32]
        return self._fingerprint

    def __reduce__(self) -> tuple[Callable[..., ArrayRecords],
                                  tuple[dict[str, _Pickled], np.ndarray | None, frozenset[str]]]:
        columns = {name: _picklable(array) for name, array in self.columns.items()}
        return (_rebuild_array_records, (columns, self.rows, self.unhashed))

    def __repr__(self) -> str:
        shapes = {name: (array.shape, str(array.dtype)) for name, array in self.columns.items()}
        return f"ArrayRecords({shapes}, records={self._length})"


# A column as it pickles: the array, or a memory map's ("memmap", filename, offset, dtype, shape).
_Pickled: TypeAlias = "np.ndarray | tuple[str, str, int, str, tuple[int, ...]]"


def _picklable(array: np.ndarray) -> _Pickled:
    if isinstance(array, np.memmap) and array.filename is not None and array.base is not None:
        return ("memmap", str(array.filename), array.offset, array.dtype.str, array.shape)
    return array


def _reopen(value: _Pickled) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    _, filename, offset, dtype, shape = value  # a memory map, by its file
    return np.memmap(filename, mode="r", dtype=np.dtype(dtype), shape=shape, offset=offset)


def _rebuild_array_records(columns: dict[str, _Pickled], rows: np.ndarray | None,
                           unhashed: frozenset[str] = frozenset()) -> ArrayRecords:
    return ArrayRecords({name: _reopen(value) for name, value in columns.items()}, rows, unhashed=unhashed)


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
            if path.is_dir():
                raise MissingFileError(f"The data file {text!r} is a directory, not a file. {_folder_advice(path)}")
            if not path.is_file():
                raise MissingFileError(f"The data file {text!r} does not exist. Pass existing files or a glob "
                                       f"such as '{text}'.")
            files.append(path)
    if not files:
        raise EmptyDatasetError("No input files were given; pass at least one path or glob.")
    return files


def _saved_by_datasets(folder: Path) -> bool:
    """Whether datasets' save_to_disk wrote folder (one Dataset's state.json, or a DatasetDict's
    dataset_dict.json): a cache folder's dataset_info.json alone is no such folder."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _folder_advice(folder: Path) -> str:
    """What to pass instead of a folder where files go: a save_to_disk folder's readers, or a glob
    of the files it holds (by their most common suffix)."""
    if _saved_by_datasets(folder):
        return ("It was written by datasets' save_to_disk: read it with hf_text (files: the folder) or "
                "token_windows (dataset: the folder), or export it to JSON Lines (Dataset.to_json).")
    suffixes = [p.suffix for p in folder.iterdir() if p.is_file() and p.suffix]
    common = max(sorted(set(suffixes)), key=suffixes.count) if suffixes else ".jsonl"
    return f"Pass existing files or a glob such as '{folder / ('*' + common)}'."


def not_json_lines(path: Path | str, first: str) -> MalformedRecordError | None:
    """The error for a file that is no JSON Lines file though a reader of them was pointed at it (a
    JSON array, a Parquet or Arrow file), judged by its name and first line; None when it may be one."""
    suffix = format_suffix(Path(path))
    if suffix in (".parquet", ".arrow"):
        return MalformedRecordError(
            f"{os.fspath(path)!r} is a{'n Arrow' if suffix == '.arrow' else ' Parquet'} file, and this reader "
            "reads JSON Lines (one JSON object per line); convert it (datasets.Dataset.from_"
            f"{suffix[1:]}(path).to_json('data.jsonl')), or read it with a reader of shards (hf_text, chat).")
    if first.lstrip().startswith("["):
        return MalformedRecordError(
            f"{os.fspath(path)!r} holds a JSON array, and dew reads JSON Lines: one JSON object per line. "
            "Write each record on a line of its own (jq -c '.[]' FILE > FILE.jsonl).")
    return None


def utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line of a text file, decoded a line at a time so a line that
    is not UTF-8 is named (MalformedRecordError) instead of failing the whole read. A gzip, bzip2,
    xz or zstd file is decompressed as it is read."""
    with open_data_file(path) as handle:
        for number, raw in enumerate(handle, 1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a first line's BOM is no text
            except UnicodeDecodeError as error:
                raise MalformedRecordError(
                    f"Line {number} of {os.fspath(path)!r} is not UTF-8 text ({error.reason}, byte "
                    f"{raw[error.start]:#04x} at column {error.start + 1}); write the file as UTF-8."
                ) from None


def json_records(files: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """('file:line', record) of every non-blank line of the JSONL files; MalformedRecordError names a
    line that is not one JSON object."""
    import json

    for path in expand_files(files):
        if wrong := not_json_lines(path, ""):
            raise wrong
        first = True
        for number, line in utf8_lines(Path(path)):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            if first and (wrong := not_json_lines(path, line)):
                raise wrong
            first = False
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise MalformedRecordError(f"{where} is not JSON ({error.msg}); write one JSON object per "
                                           "line.") from None
            if not isinstance(record, dict):
                raise MalformedRecordError(f"{where} holds a {type(record).__name__}, not a JSON object; write "
                                           "one JSON object per line.")
            yield where, record


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


def load_hf_dataset(name_or_path: str, *, split: str, config: str | None = None) -> datasets.Dataset:
    """A ``datasets.Dataset``: from a ``save_to_disk`` folder when the path exists, else the hub.

    A local folder may hold one Dataset or a DatasetDict (split picks one).
    A name that looks like a path (it starts with ``.``, ``/`` or ``~``) and
    does not exist raises MissingFileError instead of asking the hub.

    Nothing in a dataset is executed: a local folder holding a Python file
    (an old-style loading script) is refused before ``datasets`` sees it,
    and the ``hf`` extra requires a ``datasets`` (4 or later) that refuses
    loading scripts from the hub too; either way LoadingScriptError names
    the dataset.
    """
    import datasets

    path = Path(name_or_path).expanduser()
    if path.exists():
        _refuse_scripts(path)
        if _saved_by_datasets(path):
            if config is not None:
                raise MissingKeyError(
                    f"The folder {name_or_path!r} was written by datasets' save_to_disk, which keeps one "
                    f"dataset and no configs, so config={config!r} names nothing there; leave config out "
                    "(a recipe's data.config), or point at the folder that config was saved to.")
            loaded = datasets.load_from_disk(os.fspath(path))
        else:  # a folder of data files (parquet, json, csv, images; a datasets cache folder's .arrow
            # files beside its dataset_info.json): datasets infers the builder and the splits
            loaded = _load_dataset(datasets, os.fspath(path), config, split)
    elif name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 1)[-1]:
        raise MissingFileError(
            f"The dataset path {name_or_path!r} does not exist. Pass a folder written by "
            f"datasets' save_to_disk, a folder of data files, or a hub name such as 'user/name'."
        )
    else:
        loaded = _load_dataset(datasets, name_or_path, config, split)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise MissingKeyError(
                f"The dataset {name_or_path!r} has no split {split!r}; its splits are "
                f"{sorted(loaded)}. Pass split= with one of them."
            )
        loaded = loaded[split]
    return loaded


def _refuse_scripts(path: Path) -> None:
    """LoadingScriptError when path is, or its folder holds, a Python file datasets could run."""
    if path.is_file():
        scripts = [path] if path.suffix == ".py" else []
    else:
        scripts = sorted(p for p in path.glob("*.py") if p.is_file())
    if scripts:
        raise LoadingScriptError(
            f"The dataset folder {os.fspath(path)!r} holds the Python file(s) "
            f"{', '.join(p.name for p in scripts)}, which old versions of datasets run as a "
            f"loading script. dew never runs code from a data folder: convert the data to files "
            f"(Parquet, JSON lines, CSV, images) or save_to_disk, and keep scripts elsewhere."
        )


def _load_dataset(datasets: ModuleType, name_or_path: str, config: str | None,
                  split: str) -> datasets.Dataset | datasets.DatasetDict:
    """datasets.load_dataset, with a refused loading script reported as LoadingScriptError."""
    try:
        return datasets.load_dataset(name_or_path, config, split=split)
    except ValueError as error:  # a config or split it does not have: said with recipe keys, on one line
        raise _unknown_choice(datasets, name_or_path, config, split, error) from None
    except RuntimeError as error:
        if "scripts are no longer supported" not in str(error):
            raise
        raise LoadingScriptError(
            f"The dataset {name_or_path!r} needs a loading script ({error}); dew never runs code "
            f"from a dataset. Use a version of it published as data files (Parquet, JSON, CSV)."
        ) from error


def _unknown_choice(datasets: ModuleType, name: str, config: str | None, split: str,
                   error: ValueError) -> Exception:
    """datasets' refusal of a config or a split as MissingKeyError listing the ones there are
    (its own message runs to several lines and ends in a load_dataset call); any other error as it is."""
    said = str(error)
    if "Config name is missing" in said or "BuilderConfig" in said:
        try:
            configs: object = datasets.get_dataset_config_names(name)
        except Exception:  # noqa: BLE001  # the names are a courtesy: datasets' own line says them
            configs = said.splitlines()[-1]
        given = "and none was named" if config is None else f"and no config {config!r}"
        return MissingKeyError(f"The dataset {name!r} has the configs {configs} {given}; pass config= with one "
                               "of them (a recipe's data.config).")
    if "Unknown split" in said:
        splits = said.split("Should be one of", 1)[-1].strip(" .")
        where = "" if config is None else f" (config {config!r})"
        return MissingKeyError(f"The dataset {name!r}{where} has no split {split!r}; its splits are {splits}. "
                               "Pass split= with one of them (a recipe's data.split).")
    return error


def require_column(dataset: datasets.Dataset, key: str, origin: str) -> None:
    """MissingKeyError naming the key and the columns there are, unless dataset has column key."""
    columns = list(dataset.column_names)
    if key not in columns:
        raise MissingKeyError(
            f"{origin} has no column {key!r}; its columns are {columns}. Pass the key that holds "
            f"the data (text_key=, image_key= or label_key=)."
        )
