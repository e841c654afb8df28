"""HFImages: image datasets through Hugging Face ``datasets``, as uint8 arrays.

Each record's image is decoded with Pillow, converted to RGB (or L for one
channel), brought to ``size`` and returned as a uint8 ``[H, W, C]`` array
with values in [0, 255] under ``"image"``; an integer label, when the dataset
has ``label_key``, comes as int32 under ``"label"``. ``fit="crop"`` scales the
shorter side to the target and cuts the centre (aspect kept);
``fit="resize"`` scales to the target directly (aspect changed).

The dataset is a hub name (``datasets.load_dataset``) or a local path: a
folder written by ``save_to_disk`` or a folder of image files
(``imagefolder``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from dew.data.base import Dataset
from dew.data.errors import EmptyDatasetError, MalformedRecordError
from dew.data.sources import load_hf_dataset, require_column
from dew.data.stream import record_dataset

if TYPE_CHECKING:
    import datasets
    from PIL import Image as PILImage

__all__ = ["HFImages", "ImageRecords", "UndecodableImageError", "fit_image"]


class UndecodableImageError(MalformedRecordError):
    """A record's image cannot be decoded (a damaged file, or not an image at all)."""


def fit_image(image: PILImage.Image | np.ndarray | dict[str, Any], size: tuple[int, int], fit: Literal["crop", "resize"], mode: str) -> np.ndarray:
    """A PIL image (or array) as uint8 ``[height, width, channels]`` of the given size."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    elif isinstance(image, dict):  # an undecoded Image feature: its bytes or its path
        import io

        image = Image.open(io.BytesIO(image["bytes"]) if image.get("bytes") else image["path"])
    image = image.convert(mode)
    height, width = size
    if fit == "crop":
        scale = max(height / image.height, width / image.width)
        scaled = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
        if scaled != image.size:
            image = image.resize(scaled, Image.Resampling.BICUBIC)
        left, top = (image.width - width) // 2, (image.height - height) // 2
        image = image.crop((left, top, left + width, top + height))
    elif image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    array = np.asarray(image, dtype=np.uint8)
    return array[:, :, None] if array.ndim == 2 else array


@dataclass(frozen=True)
class ImageRecords:
    """A ``datasets.Dataset`` as a record source of fitted uint8 images (and labels)."""

    data: datasets.Dataset
    image_key: str
    label_key: str | None
    size: tuple[int, int]
    fit: Literal["crop", "resize"]
    mode: str

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        try:
            row = self.data[int(index)]
            out = {"image": fit_image(row[self.image_key], self.size, self.fit, self.mode)}
        except OSError as error:  # Pillow's UnidentifiedImageError, a truncated file: named, not a traceback
            raise UndecodableImageError(
                f"Record {index} of the image dataset ({self._source(int(index))}) is not an image "
                f"Pillow decodes ({type(error).__name__}: {error}). Remove or replace it, then resume "
                "the run.") from None
        if self.label_key is not None:
            out["label"] = np.asarray(row[self.label_key], dtype=np.int32)
        return out

    def _source(self, index: int) -> str:
        """Where record index's image came from: its file, when the dataset kept the path."""
        import datasets

        try:
            raw = self.data.cast_column(self.image_key, datasets.Image(decode=False))[index][self.image_key]
        except Exception:  # noqa: BLE001 - only a better message is at stake
            return "its file is not recorded"
        path = raw.get("path") if isinstance(raw, dict) else None
        return f"file {path}" if path else "stored in the dataset, without a file"

    def subset(self, indices: np.ndarray) -> ImageRecords:
        return ImageRecords(self.data.select(np.asarray(indices, dtype=np.int64)), self.image_key,
                            self.label_key, self.size, self.fit, self.mode)


@dataclass(frozen=True)
class HFImages:
    """An image dataset by hub name or local path, read as uint8 images of one size.

    ``size`` is one side (square) or ``(height, width)``. ``label_key`` is
    read when the dataset has that column; a key other than the default
    "label" must exist (None never reads labels). Validation comes from ``val_split`` when given, else from a
    seeded ``val_fraction`` of the training split held out in ``load``.
    """

    dataset: str
    split: str = "train"
    config: str | None = None
    val_split: str | None = None
    image_key: str = "image"
    label_key: str | None = "label"
    size: int | tuple[int, int] = 64
    fit: Literal["crop", "resize"] = "crop"
    channels: Literal[1, 3] = 3

    def __post_init__(self) -> None:
        size = (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)
        if len(size) != 2 or min(size) < 1:
            raise ValueError(f"HFImages.size must be a positive side or (height, width), got {self.size!r}.")
        object.__setattr__(self, "size", (int(size[0]), int(size[1])))
        if self.fit not in ("crop", "resize"):
            raise ValueError(f"HFImages.fit must be 'crop' or 'resize', got {self.fit!r}.")
        if self.channels not in (1, 3):
            raise ValueError(f"HFImages.channels must be 1 or 3, got {self.channels!r}.")

    def records(self, split: str | None = None) -> ImageRecords:
        """The split (default ``split``) as a record source; errors name a missing column."""
        split = self.split if split is None else split
        data = load_hf_dataset(self.dataset, split=split, config=self.config)
        origin = f"The image dataset {os.fspath(self.dataset)!r} (split {split!r})"
        require_column(data, self.image_key, origin)
        if len(data) == 0:
            raise EmptyDatasetError(f"{origin} holds no records; there is nothing to train on.")
        label = self.label_key if self.label_key in data.column_names else None
        if label is None and self.label_key not in (None, "label"):  # a key asked for by name
            require_column(data, self.label_key, origin)
        mode = "RGB" if self.channels == 3 else "L"
        return ImageRecords(data, self.image_key, label, self.size, self.fit, mode)  # type: ignore[arg-type]

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A Dataset: train_stream over the training split, one ordered pass for validation."""
        train = self.records()
        val: ImageRecords | None = None
        if self.val_split is not None:
            val = self.records(self.val_split)
        elif val_fraction:
            if not 0.0 < val_fraction < 1.0:
                raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}.")
            held = max(1, round(len(train) * val_fraction))
            if held >= len(train):
                raise EmptyDatasetError(
                    f"Holding out {val_fraction:.0%} of {len(train)} images leaves none to train on."
                )
            order = np.random.default_rng(val_seed).permutation(len(train))
            train, val = train.subset(np.sort(order[held:])), train.subset(np.sort(order[:held]))
        if val is not None and len(val) < batch:
            raise EmptyDatasetError(
                f"The validation images number {len(val)}, fewer than one global batch of {batch}, "
                f"so validation would yield nothing. Lower the batch or hold out more images."
            )
        return record_dataset(train, val, batch=batch, seed=seed, workers=workers, prefetch=prefetch)
