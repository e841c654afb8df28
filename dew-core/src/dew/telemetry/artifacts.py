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
    """

    name: str
    kind: Literal["image", "video", "text"]
    data: np.ndarray | str

    def __post_init__(self) -> None:
        if self.kind == "text" and not isinstance(self.data, str):
            raise TypeError(f"A text artifact holds a str, got {type(self.data).__name__}.")
        if self.kind in ("image", "video"):
            array = np.asarray(self.data)
            if array.dtype != np.uint8:
                raise TypeError(f"An {self.kind} artifact holds uint8 pixels, got {array.dtype}.")
