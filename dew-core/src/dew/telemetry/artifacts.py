"""A preview: an image, a short video or a text an objective renders for a person."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["Artifact"]


@dataclass(frozen=True)
class Artifact:
    """One preview. kind says how to read data.

    image: uint8 array (H, W, C) or (N, H, W, C) in [0, 255];
    video: uint8 array (T, H, W, C); text: a str.

    labels name what each picture shows (its class, its prompt), in order:
    the images of a batch, or the cells of a grid already tiled ``columns``
    wide (an image or a video drawn as rows of cells, row by row). A
    report shows each cell with its label.
    """

    name: str
    kind: Literal["image", "video", "text"]
    data: np.ndarray | str
    labels: tuple[str, ...] = ()
    columns: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "text" and not isinstance(self.data, str):
            raise TypeError(f"A text artifact holds a str, got {type(self.data).__name__}.")
        if self.labels and self.kind == "text":
            raise TypeError("labels name the pictures of an image or video preview; a text has none.")
        if self.columns is not None and (self.columns < 1 or not self.labels):
            raise ValueError(f"columns (got {self.columns}) is the width of a labelled grid: at "
                             "least 1, with labels given.")
        if self.kind in ("image", "video"):
            array = np.asarray(self.data)
            if array.dtype != np.uint8:
                raise TypeError(f"An {self.kind} artifact holds uint8 pixels, got {array.dtype}.")
