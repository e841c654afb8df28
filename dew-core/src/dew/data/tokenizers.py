"""A tokenizer that needs no files: one id per UTF-8 byte, plus an end-of-document id.

>>> tokenizer = ByteTokenizer()
>>> tokenizer.encode("dew")
[100, 101, 119]
>>> tokenizer.decode([100, 101, 119, tokenizer.eos_id])
'dew'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from dew.data.base import listed_ids
from dew.errors import DewError

__all__ = ["ByteTokenizer", "UnknownTokenError", "drawable_vocab"]


class UnknownTokenError(DewError, ValueError):
    """decode() was given an id outside the tokenizer's vocabulary."""


@dataclass(frozen=True)
class ByteTokenizer:
    """Text as its UTF-8 bytes: ids 0..255 are bytes, 256 marks the end of a document.

    encode never fails; decode skips the end-of-document id and replaces
    byte sequences that are not valid UTF-8 (a model's output may cut a
    character in half) with U+FFFD. stop_ids are further ids that end a
    generated continuation (an RL policy's newline), which an export keeps.
    """

    stop_ids: tuple[int, ...] = field(default=(), compare=False, repr=False)

    def stopping_at(self, *listed: object) -> ByteTokenizer:
        """This tokenizer, ending continuations also at the ids listed (an id or a list of them)."""
        kept = [i for i in listed_ids(*listed) if i < self.vocab_size]
        return ByteTokenizer(tuple(dict.fromkeys(i for i in [*self.stop_ids, *kept] if i != self.eos_id)))

    @property
    def vocab_size(self) -> int:
        """257: the 256 byte values and the end-of-document id."""
        return 257

    @property
    def eos_id(self) -> int:
        """The end-of-document id (256)."""
        return 256

    def encode(self, text: str, *, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of text as ids, followed by eos_id when add_eos."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode takes a str, got {type(text).__name__}.")
        ids = list(text.encode("utf-8"))
        return ids + [self.eos_id] if add_eos else ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The byte ids of text and, for each, the span [start, end) of the character it belongs to."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for position, character in enumerate(text):
            encoded = character.encode("utf-8")
            ids.extend(encoded)
            spans.extend([(position, position + 1)] * len(encoded))
        return ids, spans

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text the byte ids spell, skipping special ids."""
        values = [int(i) for i in np.asarray(ids).reshape(-1)] if not isinstance(ids, list) else ids
        bad = [int(i) for i in values if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise UnknownTokenError(
                f"ByteTokenizer.decode got ids outside [0, {self.vocab_size}): {bad[:5]}; "
                "were these ids made by another tokenizer or a model with a larger vocabulary?"
            )
        return bytes(int(i) for i in values if int(i) < 256).decode("utf-8", errors="replace")


def drawable_vocab(tokenizer: object) -> int | None:
    """The ids a model's draws are kept below so that tokenizer can spell them, None for no limit.

    The byte tokenizer refuses ids past its 257, so a model whose vocabulary is padded past them
    draws from those alone. A library's tokenizer skips ids it has no text for, as transformers'
    do, so draws stay the model's own: as transformers samples a published model's padded rows.
    """
    return tokenizer.vocab_size if isinstance(tokenizer, ByteTokenizer) else None
