"""safetensors files in and out: one file, or the shards an index names.

Tensors travel as numpy arrays (bfloat16 through ml_dtypes, which jax ships),
read lazily from disk one name at a time, and written a shard at a time
(``ShardWriter``), so neither direction holds a second copy of the whole
checkpoint in host memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

__all__ = ["WEIGHTS", "WEIGHTS_INDEX", "ShardWriter", "TensorFiles", "write_tensors"]

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def write_tensors(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write tensors as one safetensors file (contiguous copies; metadata as strings)."""
    from safetensors.numpy import save_file

    save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()},
              str(path), metadata=dict(metadata))


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
    """The tensors of a directory, by name: ``model.safetensors`` or the shards of its index."""

    def __init__(self, directory: Path) -> None:
        index = directory / WEIGHTS_INDEX
        single = directory / WEIGHTS
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="numpy") as handle:
                self.files = {name: single for name in handle.keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(
                f"{directory} holds neither {WEIGHTS} nor {WEIGHTS_INDEX}; point at a directory "
                "that Pretrained.save or transformers' save_pretrained wrote."
            )

    def names(self) -> set[str]:
        return set(self.files)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, read from the headers alone."""
        from safetensors import safe_open

        out: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118
                    out[name] = tuple(handle.get_slice(name).get_shape())
        return out

    def read(self, names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) for each of names, one file open at a time."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in sorted(names):
            by_file.setdefault(self.files[name], []).append(name)
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="numpy") as handle:
                for name in wanted:
                    yield name, handle.get_tensor(name)
