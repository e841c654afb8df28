"""Scored token sequences laid into fixed-length rows, one or several to a row.

Supervised readers (prompt and completion, chat) encode each record as its ids and
a mask of the tokens the loss scores; this is the one place those become the
rows a step reads, so packing behaves the same whichever reader made them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

__all__ = ["Scored", "packed_rows"]


class Scored(Protocol):
    """One encoded record: its token ids and a mask of the same length (1 where scored)."""

    @property
    def ids(self) -> np.ndarray: ...

    @property
    def mask(self) -> np.ndarray: ...


def packed_rows(records: Iterable[Scored], width: int, pad_id: int, *, pack: bool) -> dict[str, np.ndarray]:
    """text, loss_mask and segment_ids, each int32 [rows, width].

    Records keep their order. With pack, a record joins the current row while it fits and
    starts a new one when it does not; without, each record has a row of its own. A row's
    records are numbered 1, 2, ... in segment_ids (0 marks padding, which is pad_id in text
    and unscored). Every record must be at most width tokens long.

    >>> from types import SimpleNamespace as R
    >>> one = R(ids=np.array([5, 6, 7]), mask=np.array([0, 1, 1]))
    >>> two = R(ids=np.array([8, 9]), mask=np.array([1, 1]))
    >>> packed_rows([one, two, one], 5, 0, pack=True)["segment_ids"].tolist()
    [[1, 1, 1, 2, 2], [1, 1, 1, 0, 0]]
    >>> packed_rows([one, two], 5, 0, pack=False)["text"].tolist()
    [[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]]
    """
    rows: list[list[Scored]] = []
    used = width
    for record in records:
        if not pack or used + len(record.ids) > width:
            rows.append([])
            used = 0
        rows[-1].append(record)
        used += len(record.ids)
    text = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    segments = np.zeros((len(rows), width), np.int32)
    for r, row in enumerate(rows):
        start = 0
        for number, record in enumerate(row, 1):
            stop = start + len(record.ids)
            text[r, start:stop], mask[r, start:stop], segments[r, start:stop] = record.ids, record.mask, number
            start = stop
    return {"text": text, "loss_mask": mask, "segment_ids": segments}
