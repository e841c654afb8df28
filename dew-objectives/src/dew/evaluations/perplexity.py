"""Perplexity over a file of documents, measured as the evaluation harnesses measure it (wikitext).

Each record's text (``text_key``) is tokenized without special tokens and
scored whole in rolling windows of the model's ``max_seq_len``: the first
window starts from the tokenizer's beginning-of-text id (its end-of-document
id where it has none) and predicts the first tokens; every later window
predicts the next tokens with as many earlier ones before them as fill the
window, so each token is scored once, with the longest context the model
takes. The summed log-probabilities give lm-eval's ``word_perplexity``
(per whitespace-separated word), ``byte_perplexity`` and ``bits_per_byte``
(per UTF-8 byte), and ``token_perplexity`` (per token of this tokenizer),
each pooled over the file's documents.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dew.data.base import eos_id_of, prefix_of
from dew.evaluations.base import Subject, TaskFileError, check_task_file, read_task_file
from dew.evaluations.scoring import loglikelihoods

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["PerplexityTask", "rolling_windows"]


def rolling_windows(tokens: Sequence[int], prefix: int, width: int) -> Iterator[tuple[list[int], int]]:
    """(row ids, how many of its last ids are scored) covering tokens once each, as lm-eval's
    rolling log-likelihood cuts a document for a model that reads width ids at a time.

    >>> list(rolling_windows([5, 6, 7, 8, 9], prefix=1, width=3))
    [([1, 5, 6, 7], 3), ([6, 7, 8, 9], 2)]
    """
    tokens = list(tokens)
    if not tokens:
        return
    first = min(width, len(tokens))
    yield [prefix, *tokens[:first]], first
    done = first
    while done < len(tokens):
        scored = min(len(tokens) - done, width)
        end = done + scored
        start = max(end - width - 1, 0)
        yield tokens[start:end], scored
        done = end


@dataclass(frozen=True)
class PerplexityTask:
    """Word, byte and token perplexity over a JSONL file of documents (see the module docstring)."""

    scores_causal_text: ClassVar[bool] = True  # dew.evaluations.base.ScoresCausalText
    file_fields: ClassVar[tuple[str, ...]] = ("file",)  # dew.evaluations.base.ReadsFiles

    file: str
    text_key: str = "text"
    batch: int = 8

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise TaskFileError(f"PerplexityTask.batch={self.batch!r}; it is at least 1.")
        check_task_file(self.file)
        self.documents()  # every record read as the task is built: a bad line is refused before a run trains

    def documents(self) -> list[str]:
        """Every record's text, checked (TaskFileError names a bad line)."""
        out = []
        for line, record in read_task_file(self.file):
            where = f"Line {line} of {os.fspath(self.file)!r}"
            if self.text_key not in record:
                raise TaskFileError(f"{where} has no key {self.text_key!r} (it has {sorted(record)}); set "
                                    "text_key= to the key that holds each document.")
            text = record[self.text_key]
            if not isinstance(text, str) or not text:
                raise TaskFileError(f"{where} holds {json.dumps(text)[:40]} under {self.text_key!r}, not a "
                                    "document: write each one as a non-empty JSON string.")
            out.append(text)
        if not out:
            raise TaskFileError(f"The task file {os.fspath(self.file)!r} holds no record.")
        return out

    def evaluate(self, subject: Subject, *, mesh: Mesh | None = None) -> dict[str, float]:
        """word_perplexity, byte_perplexity, bits_per_byte and token_perplexity over the file."""
        tokenizer = subject.text_tokenizer("PerplexityTask", "documents")
        width = getattr(subject.model, "max_seq_len", None)  # any flax Module: the whole text if unbounded
        documents = self.documents()
        start = next(iter(prefix_of(tokenizer)), eos_id_of(tokenizer))
        if start is None:
            raise TaskFileError("PerplexityTask starts each document from the tokenizer's beginning-of-text "
                                "or end-of-document id, and this tokenizer names neither.")
        prefix = int(start)
        encoded = [[int(i) for i in tokenizer.encode(text)] for text in documents]
        rows = [row for ids in encoded
                for row in rolling_windows(ids, prefix, int(width) if width else max(len(ids), 1))]
        logp = float(loglikelihoods(subject.model, subject.variables, rows, batch=self.batch, mesh=mesh).sum())
        words = sum(len(re.split(r"\s+", text)) for text in documents)
        size = sum(len(text.encode("utf-8")) for text in documents)
        tokens = sum(len(ids) for ids in encoded)
        return {"word_perplexity": _exp(-logp / words), "byte_perplexity": _exp(-logp / size),
                "bits_per_byte": -logp / size / math.log(2), "token_perplexity": _exp(-logp / tokens),
                "records": float(len(documents))}


def _exp(nats: float) -> float:
    """e to the nats: a perplexity past float64's range (a word of ~710 nats, as a long URL or text
    written without spaces costs a weak model) is infinite, not an OverflowError."""
    try:
        return math.exp(nats)
    except OverflowError:
        return math.inf
