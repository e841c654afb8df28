"""safetensors files in and out: one file, or the shards an index names.

Tensors travel as numpy arrays (bfloat16 through ml_dtypes, which jax ships),
read from disk one name at a time, and written a shard at a time
(``ShardWriter``), so neither direction holds a second copy of the whole
checkpoint in host memory. ``read`` uses plain reads into a fresh array at
the offsets the file's header gives; ``mapped`` maps one tensor's bytes at a
time and lets go of the pages once the caller has copied them out (mapping
the whole file, as safetensors' own reader does, would count every page
touched against the process until the file is closed, up to a whole shard on
top of the arrays already read).
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dew.pretrained.errors import DamagedFileError

# Releasing a mapping's pages at once: a POSIX flag the mmap module has where the platform does.
_DONTNEED: int | None = getattr(mmap, "MADV_DONTNEED", None)

__all__ = ["WEIGHTS", "WEIGHTS_INDEX", "ShardWriter", "TensorFiles", "write_tensors"]

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def write_tensors(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write tensors as one safetensors file (contiguous copies; metadata as strings)."""
    from safetensors.numpy import save_file

    from dew.pretrained.writing import process_umask

    save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()},
              str(path), metadata=dict(metadata))
    _sort_metadata(path)
    # safetensors creates its files for their owner alone (0600): an export in a shared folder is
    # read by others as its config.json beside it is
    os.chmod(path, 0o666 & ~process_umask())


def _sort_metadata(path: Path) -> None:
    """Rewrite the file's header with its metadata in sorted order, in place: safetensors writes the
    metadata from a hash map, whose order differs from one process to the next, so the same tensors
    and metadata made files of other bytes (an export's checksum changed between two runs of it).
    Only the order of keys of one length changes, so the header keeps its length and the tensors
    their offsets."""
    with open(path, "r+b") as handle:
        length = int.from_bytes(handle.read(8), "little")
        written = handle.read(length)
        header = json.loads(written)
        metadata = header.get("__metadata__")
        if not isinstance(metadata, dict) or list(metadata) == sorted(metadata):
            return
        header["__metadata__"] = dict(sorted(metadata.items()))
        text = written.rstrip(b" ")
        again = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(again) != len(text) or json.loads(again) != json.loads(text):
            return  # written in another spelling than this one: left as safetensors wrote it
        handle.seek(8)
        handle.write(again)


class ShardWriter:
    """Tensors written into safetensors files of at most max_bytes each (one file: no index).

    ``add`` buffers a tensor and writes the buffer out once the next tensor
    would pass max_bytes; ``close`` names the files as transformers does
    (``model.safetensors``, or ``model-00001-of-0000N.safetensors`` with
    ``model.safetensors.index.json``) and removes the index and shards an
    earlier save left there, which readers would otherwise prefer.
    """

    def __init__(self, directory: Path, max_bytes: int, metadata: Mapping[str, str]) -> None:
        self.directory, self.max_bytes, self.metadata = directory, int(max_bytes), dict(metadata)
        self._buffer: dict[str, np.ndarray] = {}
        self._size = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if self._buffer and self._size + array.nbytes > self.max_bytes:
            self._flush()
        self._buffer[name] = np.ascontiguousarray(array)
        self._size += array.nbytes
        self.total += array.nbytes

    def _flush(self) -> None:
        path = self.directory / f".dew-shard-{len(self._written)}.safetensors"
        write_tensors(path, self._buffer, self.metadata)
        self._written.append((path, list(self._buffer)))
        self._buffer, self._size = {}, 0

    def close(self) -> list[Path]:
        """Write what is buffered, name the files, and return them."""
        if self._buffer or not self._written:
            self._flush()
        stale = self._stale()
        count = len(self._written)
        if count == 1:
            final = [self.directory / WEIGHTS]
            self._written[0][0].replace(final[0])
            for old in stale | {self.directory / WEIGHTS_INDEX}:
                if old not in final:
                    old.unlink(missing_ok=True)
            return final
        final, weight_map = [], {}
        for number, (path, names) in enumerate(self._written, start=1):
            target = self.directory / f"model-{number:05d}-of-{count:05d}.safetensors"
            path.replace(target)
            final.append(target)
            weight_map.update({name: target.name for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for old in stale | {self.directory / WEIGHTS}:
            if old not in final:
                old.unlink(missing_ok=True)
        return final

    def _stale(self) -> set[Path]:
        """Shards an earlier save's index named."""
        index = self.directory / WEIGHTS_INDEX
        if not index.is_file():
            return set()
        try:
            names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (ValueError, AttributeError):
            return set()
        return {self.directory / name for name in names}


class TensorFiles:
    """The tensors of a directory, by name: ``model.safetensors`` or the shards of its index.

    Every file's header is read and checked when the directory is opened (a
    file cut short, not safetensors, or missing where the index points is a
    DamagedFileError naming it), so what reading finds later is known to fit.
    """

    def __init__(self, directory: Path) -> None:
        from dew.pretrained.errors import NoPretrainedModelError
        from dew.pretrained.reading import read_json

        index = directory / WEIGHTS_INDEX
        single = directory / WEIGHTS
        # model.safetensors first, as transformers reads a directory: its save_pretrained of one file
        # over a sharded save leaves the old index (and a copy may leave old shards) beside it.
        if single.is_file():
            self.files = {}
        elif index.is_file():
            weight_map = read_json(index, "weights index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                    isinstance(file, str) and "/" not in file for file in weight_map.values()):
                raise DamagedFileError(f"{index} has no weight_map of tensor names to file names in "
                                       "this directory; write the model again.")
            self.files = {name: directory / file for name, file in weight_map.items()}
            for file in sorted(set(self.files.values())):
                if not file.is_file():
                    raise DamagedFileError(f"{index} names {file.name}, which {directory} does not hold; "
                                           "copy the missing shard there, or write the model again.")
        else:
            raise NoPretrainedModelError(
                f"{directory} holds neither {WEIGHTS} nor {WEIGHTS_INDEX}; point at a directory "
                "that Pretrained.save or transformers' save_pretrained wrote."
            )
        self.headers: dict[Path, tuple[dict, int]] = {}
        for file in sorted(set(self.files.values())) or [single]:
            self.headers[file] = _header(file)
        if not self.files:
            self.files = {name: single for name in self.headers[single][0]}
        for name, file in self.files.items():
            if name not in self.headers[file][0]:
                raise DamagedFileError(f"{index} puts {name} in {file.name}, which does not hold it; "
                                       "write the model again.")

    def names(self) -> set[str]:
        return set(self.files)

    def info(self, name: str) -> dict[str, Any]:
        """name's header entry: dtype, shape, data_offsets."""
        return self.headers[self.files[name]][0][name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, read from the headers alone."""
        return {name: tuple(self.info(name)["shape"]) for name in self.files}

    def dtypes(self) -> dict[str, str]:
        """Every tensor's stored dtype, as safetensors names it (F32, BF16, I32, ...)."""
        return {name: self.info(name)["dtype"] for name in self.files}

    @property
    def nbytes(self) -> int:
        """The bytes of tensor data the files hold."""
        return sum(end - begin for header, _ in self.headers.values()
                   for begin, end in (info["data_offsets"] for info in header.values()))

    def read(self, names: set[str], *, reuse: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) for each of names, in file order.

        Each array is new; or, with reuse, a view of one buffer that the next
        tensor overwrites (the caller copies it out before asking for the
        next): the process then takes fresh memory only for what it keeps.
        """
        by_file: dict[Path, list[str]] = {}
        for name in sorted(names):
            by_file.setdefault(self.files[name], []).append(name)
        scratch = np.empty(0, np.uint8)
        for file, wanted in by_file.items():
            header, start = self.headers[file]
            wanted.sort(key=lambda name: header[name]["data_offsets"][0])
            if reuse:
                largest = max(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in wanted)
                if largest > scratch.size:
                    scratch = np.empty(largest, np.uint8)
            with file.open("rb", buffering=0) as handle:
                for name in wanted:
                    yield name, _read_one(handle, start, name, header[name], file, scratch if reuse else None)


    def read_aligned(self, name: str, alignment: int = 64) -> np.ndarray:
        """name's tensor read into fresh memory that starts on an alignment boundary (what a CPU
        device takes as its own buffer without copying it)."""
        file = self.files[name]
        header, start = self.headers[file]
        info = header[name]
        begin, end = info["data_offsets"]
        with file.open("rb", buffering=0) as handle:
            return _read_one(handle, start, name, info, file, fresh_pages(end - begin, alignment))

    def mapped(self, names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
        """(name, read-only array) for each of names, in file order, each a view of the file's bytes.

        No copy is made: the caller copies what it keeps (transposing or
        casting on the way, in one pass) before asking for the next tensor,
        whose arrival releases this one's pages from the process.
        """
        import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy)

        by_file: dict[Path, list[str]] = {}
        for name in sorted(names):
            by_file.setdefault(self.files[name], []).append(name)
        for file, wanted in by_file.items():
            header, start = self.headers[file]
            wanted.sort(key=lambda name: header[name]["data_offsets"][0])
            with file.open("rb") as handle:
                for name in wanted:
                    info = header[name]
                    begin, end = (start + offset for offset in info["data_offsets"])
                    dtype = np.dtype(_DTYPES[info["dtype"]])
                    if end == begin:  # an empty tensor: nothing to map
                        yield name, np.empty(tuple(info["shape"]), dtype)
                        continue
                    page = begin - begin % mmap.ALLOCATIONGRANULARITY
                    try:
                        # MAP_POPULATE is Linux-only: mmap has it where the platform does.
                        region = mmap.mmap(handle.fileno(), end - page, offset=page, prot=mmap.PROT_READ,
                                           flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                    except (OSError, ValueError) as error:
                        raise DamagedFileError(f"{file} cannot be read at {name} ({error}); the file was "
                                               "cut short or changed: write or copy it again.") from None
                    try:
                        array = np.frombuffer(region, dtype, count=(end - begin) // dtype.itemsize,
                                              offset=begin - page).reshape(tuple(info["shape"]))
                        yield name, array
                        del array
                    finally:  # the pages leave the process's memory even if a view lingers
                        if _DONTNEED is not None:
                            region.madvise(_DONTNEED)
                        try:
                            region.close()
                        except BufferError:  # a view still exported: the mapping goes with it
                            pass


# safetensors' dtype names -> numpy's (bfloat16 and the float8s through ml_dtypes).
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
           "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _header(file: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts;
    DamagedFileError, naming the file, unless every tensor's bytes lie inside it."""
    again = "it was cut short or is not a safetensors file; write or copy it again."
    try:
        size_on_disk = file.stat().st_size
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            text = handle.read(size) if 8 <= size_on_disk and size <= min(size_on_disk - 8, 2**27) else None
    except OSError as error:
        raise DamagedFileError(f"{file} cannot be read ({error.strerror}).") from None
    if text is None:
        raise DamagedFileError(f"{file} has no readable safetensors header: {again}")
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise DamagedFileError(f"{file}'s safetensors header is not valid JSON: {again}") from None
    if not isinstance(header, dict):
        raise DamagedFileError(f"{file}'s safetensors header is not an object: {again}")
    header.pop("__metadata__", None)
    data = size_on_disk - 8 - size
    for name, info in header.items():
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
            kind = _DTYPES.get(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise DamagedFileError(f"{file}'s header entry for {name} is malformed: {again}") from None
        if kind is None:
            raise DamagedFileError(f"{file} stores {name} as {info['dtype']}, which dew does not read.")
        if not 0 <= begin <= end <= data:
            raise DamagedFileError(f"{file} ends before the data of {name} (bytes {begin}..{end} of "
                                   f"{data}): {again}")
        # math.prod in Python's integers: np.prod in int64 wraps a shape of [2**32, 2**32] to 0 elements
        if any(n < 0 for n in shape) or math.prod(shape) * np.dtype(_numpy_dtype(kind)).itemsize != end - begin:
            raise DamagedFileError(f"{file} gives {name} {end - begin} bytes for shape {tuple(shape)} of "
                                   f"{info['dtype']}: {again}")
    return header, 8 + size


def fresh_pages(nbytes: int, alignment: int = 64) -> np.ndarray:
    """nbytes uninitialized bytes starting on an alignment boundary, as fresh anonymous pages.

    Not numpy's allocator: it asks the kernel for huge pages on arrays of 4 MB and more, and on a
    machine short of contiguous memory the kernel compacts memory for them at every fault, which
    made filling a large buffer several times slower than reading the file into it.
    """
    import mmap

    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS") or mmap.PAGESIZE % alignment:
        raw = np.empty(nbytes + alignment, np.uint8)  # (Windows) numpy's own, aligned by hand
        first = -raw.ctypes.data % alignment
        return raw[first:first + nbytes]
    populate = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the pages faulted in at once, not one by one
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate),
                         np.uint8)


def _numpy_dtype(kind: str) -> Any:
    import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy)

    return np.dtype(kind)


def _read_one(handle: object, start: int, name: str, info: dict, file: Path,
              scratch: np.ndarray | None = None) -> np.ndarray:
    import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy)

    kind = _DTYPES.get(info["dtype"])
    if kind is None:
        raise DamagedFileError(f"{file} stores {name} as {info['dtype']}, which dew does not read.")
    begin, end = info["data_offsets"]
    shape, dtype = tuple(info["shape"]), np.dtype(kind)
    if scratch is None:
        array = np.empty(shape, dtype)
    else:
        array = scratch[: end - begin].view(dtype).reshape(shape)
    if array.nbytes != end - begin:
        raise DamagedFileError(f"{file} is damaged: {name} holds {end - begin} bytes for shape "
                               f"{tuple(info['shape'])} of {info['dtype']} ({array.nbytes} bytes).")
    # numpy's stub declares ndarray.__buffer__ only for Python 3.12 and later
    view = memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    handle.seek(start + begin)  # type: ignore[attr-defined]
    done = 0
    while done < len(view):
        count = handle.readinto(view[done:])  # type: ignore[attr-defined]
        if not count:
            raise DamagedFileError(f"{file} ends inside {name}; the file was cut short (rewrite or fetch it again).")
        done += count
    return array
