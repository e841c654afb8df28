"""scikit-learn's bundled 8x8 handwritten digits, as images and as moving-digit videos.

No download: the 1797 digits ship inside scikit-learn (the ``digits``
extra). ``Digits`` yields uint8 images [size, size, 1] (pixel values 0..16
scaled to 0..255, enlarged by an integer factor) with int32 labels.
``MovingDigits`` places each digit on a larger black canvas and moves it in
a straight line, bouncing off the borders, for a small real video set.

>>> records = Digits().records()
>>> len(records), records[0]["image"].shape, records[0]["image"].dtype, int(records[0]["label"])
(1797, (8, 8, 1), dtype('uint8'), 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dew.data.base import Dataset
from dew.data.sources import ArrayRecords
from dew.data.videos import load_records

__all__ = ["Digits", "MovingDigits", "digit_images"]


def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 digits as uint8 [N, 8, 8] in [0, 255] and their int32 labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - the extra is part of every test install
        raise ImportError("The digits readers need scikit-learn: pip install 'dew-data[digits]'.") from error
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    return images, digits.target.astype(np.int32)


@dataclass(frozen=True)
class Digits:
    """The digits as uint8 images [size, size, 1] under "image", labels under "label"."""

    size: int = 8

    def __post_init__(self) -> None:
        if self.size < 8 or self.size % 8:
            raise ValueError(f"Digits.size must be a multiple of 8 (the digits are 8x8), got {self.size}.")

    def records(self) -> ArrayRecords:
        images, labels = digit_images()
        factor = self.size // 8
        images = images.repeat(factor, axis=1).repeat(factor, axis=2)[..., None]
        return ArrayRecords({"image": np.ascontiguousarray(images), "label": labels})

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A Dataset of the digits in dew's global order, optionally holding some out."""
        return load_records(self.records(), batch=batch, seed=seed, val_fraction=val_fraction,
                            val_seed=val_seed, workers=workers, prefetch=prefetch)


@dataclass(frozen=True)
class MovingDigits:
    """Each digit moving on a black canvas: uint8 videos [frames, size, size, 1] under "video".

    Start positions and velocities (1 or 2 pixels a frame on each axis, either
    sign) are drawn from seed; the digit bounces off the borders.
    """

    frames: int = 8
    size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size < 8 or self.frames < 1:
            raise ValueError(f"MovingDigits needs size >= 8 and frames >= 1, got size={self.size}, "
                             f"frames={self.frames}.")

    def records(self) -> ArrayRecords:
        images, labels = digit_images()
        rng = np.random.default_rng(self.seed)
        room = self.size - 8
        count = len(images)
        start = rng.integers(0, room + 1, (count, 2))
        velocity = rng.choice([-2, -1, 1, 2], (count, 2))
        videos = np.zeros((count, self.frames, self.size, self.size, 1), np.uint8)
        for frame in range(self.frames):
            position = start + velocity * frame
            if room:  # reflect into [0, room]
                position = np.abs((position + room) % (2 * room) - room)
            for row in range(count):
                y, x = position[row]
                videos[row, frame, y:y + 8, x:x + 8, 0] = images[row]
        return ArrayRecords({"video": videos, "label": labels})

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A Dataset of the videos in dew's global order, optionally holding some out."""
        return load_records(self.records(), batch=batch, seed=seed, val_fraction=val_fraction,
                            val_seed=val_seed, workers=workers, prefetch=prefetch)
