"""safetensors files in and out: one file, or the shards an index names.

Tensors travel as numpy arrays (bfloat16 through ml_dtypes, which jax ships),
read lazily from disk one name at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

__all__ = ["WEIGHTS", "WEIGHTS_INDEX", "TensorFiles", "write_tensors"]

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def write_tensors(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write tensors as one safetensors file (contiguous copies; metadata as strings)."""
    from safetensors.numpy import save_file

    save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()},
              str(path), metadata=dict(metadata))


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
