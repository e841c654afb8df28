"""VideoArrays: videos stored as arrays of frames, read with dew's global record position.

A ``.npy`` file holds uint8 videos ``[N, T, H, W, C]`` (memory-mapped, so a
large file is not read into memory); an optional second file holds one int
label per video. Records go through ``train_stream`` like every dew reader,
so a run resumes at the same global record whatever the worker count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from dew.data.base import Dataset
from dew.data.errors import EmptyDatasetError
from dew.data.sources import ArrayRecords
from dew.data.stream import record_dataset
from dew.errors import DewError

__all__ = ["FrameCountError", "VideoArrays", "held_out", "load_records"]


class FrameCountError(DewError, ValueError):
    """Videos with another number of frames than the reader was asked for."""


def held_out(records: ArrayRecords, *, batch: int, val_fraction: float,
             val_seed: int) -> tuple[ArrayRecords, ArrayRecords | None]:
    """(train, val): a seeded val_fraction of records held out, or all for training."""
    if not val_fraction:
        return records, None
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}.")
    held = max(1, round(len(records) * val_fraction))
    if held >= len(records) or held < batch:
        raise EmptyDatasetError(
            f"Holding out {val_fraction:.0%} of {len(records)} records gives {held}: it must leave "
            f"some to train on and fill one global batch of {batch}; change val_fraction or batch.")
    order = np.random.default_rng(val_seed).permutation(len(records))
    return records.subset(np.sort(order[held:])), records.subset(np.sort(order[:held]))


def load_records(records: ArrayRecords, *, batch: int, seed: int, val_fraction: float,
                 val_seed: int, workers: int, prefetch: int) -> Dataset:
    """The Dataset of in-memory records, with an optional held-out share for validation."""
    train, val = held_out(records, batch=batch, val_fraction=val_fraction, val_seed=val_seed)
    return record_dataset(train, val, batch=batch, seed=seed, workers=workers, prefetch=prefetch)


@dataclass(frozen=True)
class VideoArrays:
    """Videos from a .npy file of uint8 ``[N, T, H, W, C]`` under "video" (labels under "label").

    frames, when given, is checked against the file's T, so a model built for
    another clip length fails here, naming both.
    """

    path: str
    frames: int | None = None
    labels: str | None = None

    def records(self) -> ArrayRecords:
        videos = np.load(os.fspath(self.path), mmap_mode="r")
        if videos.ndim != 5 or videos.dtype != np.uint8:
            raise ValueError(
                f"{self.path!r} holds {videos.dtype} of shape {videos.shape}; VideoArrays reads uint8 "
                "videos [count, frames, height, width, channels] in [0, 255].")
        if self.frames is not None and videos.shape[1] != self.frames:
            raise FrameCountError(
                f"{self.path!r} holds videos of {videos.shape[1]} frames, but frames={self.frames} "
                "was asked for; cut the clips or set frames to match.")
        if len(videos) == 0:
            raise EmptyDatasetError(f"{self.path!r} holds no videos; there is nothing to train on.")
        columns = {"video": videos}
        if self.labels is not None:
            labels = np.load(os.fspath(self.labels)).astype(np.int32)
            if labels.shape != (len(videos),):
                raise ValueError(f"{self.labels!r} holds {labels.shape} labels for {len(videos)} "
                                 "videos; give one int label per video.")
            columns["label"] = labels
        return ArrayRecords(columns)

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A Dataset over the videos in dew's global order."""
        return load_records(self.records(), batch=batch, seed=seed, val_fraction=val_fraction,
                            val_seed=val_seed, workers=workers, prefetch=prefetch)
