"""TokenWindows: text, tokenized once, packed into fixed-length int32 windows.

Every document is tokenized as the tokenizer starts a sequence (the
beginning-of-text id a Llama or Gemma tokenizer.json puts first, as
transformers' ``tokenizer(text)`` does; nothing for bytes or Qwen's) and
followed by the tokenizer's end-of-document id; the documents are laid end to end (packing) and the token stream is cut
into non-overlapping windows of ``length + 1`` tokens, so one window feeds a
language model ``length`` inputs and ``length`` shifted targets. A document
longer than a window continues in the next one; the end-of-document ids mark
where one document stops inside a window. The tail shorter than a window is
dropped.

Text comes from local files (``files``: paths or globs; ``.jsonl`` and
``.json`` files hold one JSON object per line with the text under
``text_key``; ``.parquet`` and ``.arrow`` files a ``text_key`` column; anything else is one
document per file, read as UTF-8; gzip, bzip2, xz and zstd files, such as
``.jsonl.gz``, are read through their compression) or from a Hugging Face dataset
(``dataset``: a ``save_to_disk`` folder, a folder of data files, or a hub
name). Windows live in memory, or in ``cache_dir`` as a ``.npy`` file keyed by
a digest of the inputs' contents, the tokenizer and the length, memory-mapped
on later loads once its recorded digest is checked (dew.data.window_cache).

>>> from dew.data import DataPartition
>>> from dew.data.sources import stdlib_corpus
>>> data = TokenWindows(files=stdlib_corpus(limit_files=2), length=64).load(batch=4)
>>> next(data.train(DataPartition()))["text"].shape
(4, 65)
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

from dew.data import window_cache
from dew.data.base import (
    Dataset,
    EosTokenizer,
    Tokenizer,
    WithEos,
    eos_id_of,
    prefix_of,
    vocab_size_of,
)
from dew.data.compressed import format_suffix, open_data_file
from dew.data.errors import EmptyDatasetError, MalformedRecordError, MissingKeyError
from dew.data.sources import (
    ArrayRecords,
    expand_files,
    load_hf_dataset,
    not_json_lines,
    require_column,
    utf8_lines,
)
from dew.data.stream import record_dataset
from dew.data.window_cache import content_digest

__all__ = ["ReplacedBytesWarning", "TokenWindows", "encode_documents", "framed_documents", "resolve_tokenizer", "split_records",
           "tokenizer_fingerprint"]

_CHUNK = 256  # documents tokenized per encode_batch call


class ReplacedBytesWarning(UserWarning):
    """A text file holds bytes that are not UTF-8; they were read as U+FFFD and trained on so."""


_WIDE_MARKS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)  # UTF-16's byte-order marks (UTF-32's begin so too)


def _decoded(raw: bytes, path: Path) -> str:
    """A text file's text as Python's text mode reads it: a byte-order mark is no text, and Windows'
    and old Macs' line ends are newlines. A stray bad byte is replaced, with a warning naming the
    file, since the model then learns U+FFFD where the file had something else."""
    if raw.startswith(_WIDE_MARKS):
        raise MalformedRecordError(
            f"{os.fspath(path)!r} is UTF-16 (or UTF-32) text, and dew reads UTF-8; convert it "
            f"(iconv -f utf-16 -t utf-8 {os.fspath(path)!r} > converted.txt) or save it as UTF-8.")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        text = raw.decode("utf-8-sig", errors="replace")
        bad = text.count("\ufffd") - raw.count("\ufffd".encode())
        at = error.start + (3 if raw.startswith(codecs.BOM_UTF8) else 0)  # counted from the file's first byte
        warnings.warn(ReplacedBytesWarning(
            f"{os.fspath(path)!r} is not all UTF-8 (first at byte {at}): {bad} bad byte "
            "sequence(s) are read as U+FFFD. Write the file as UTF-8 (iconv -f latin1 -t utf-8, say), "
            "or narrow data.files to leave it out."), stacklevel=2)
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


_JSON_SUFFIXES = {".jsonl", ".json", ".ndjson"}


@runtime_checkable
class _Encodes(Protocol):
    """What TokenWindows needs of a tokenizer besides its eos_id: text to ids."""

    def encode(self, text: str) -> Sequence[int]: ...


@runtime_checkable
class _Fingerprinted(Protocol):
    """A tokenizer that says what identifies its output (dew's HFTokenizer: a digest of its file)."""

    @property
    def fingerprint(self) -> str: ...


@runtime_checkable
class _BatchEncodes(Protocol):
    """A tokenizer that encodes many texts in one call (dew's HFTokenizer, through the tokenizers library)."""

    def encode_batch(self, texts: Sequence[str]) -> Sequence[np.ndarray]: ...


def resolve_tokenizer(tokenizer: object) -> EosTokenizer:
    """"byte" -> ByteTokenizer, a tokenizer.json or a folder holding one -> HFTokenizer, else as given."""
    if isinstance(tokenizer, str | os.PathLike):
        if os.fspath(tokenizer) == "byte":
            from dew.data.tokenizers import ByteTokenizer

            return ByteTokenizer()
        from dew.data.hf_tokenizer import HFTokenizer

        path = Path(tokenizer).expanduser()
        if path.is_dir():
            return HFTokenizer.from_directory(path)
        return HFTokenizer.from_file(tokenizer).stopping_with(path.parent)
    for needed, has in (("encode", _Encodes), ("eos_id", WithEos)):  # any object may be given: checked
        if not isinstance(tokenizer, has):
            raise TypeError(
                f"A tokenizer must have encode(text) and eos_id; {type(tokenizer).__name__} "
                f"{tokenizer!r:.40} lacks {needed}. Give 'byte', the path of a tokenizer folder or "
                "tokenizer.json, or (from Python) such an object."
            )
    return cast(EosTokenizer, tokenizer)  # checked for what windows read (encode, eos_id); decode is the reader's


def tokenizer_fingerprint(tokenizer: object) -> str:
    """What identifies a tokenizer's output: its own fingerprint (a file digest), else its type and
    sizes; then the ids it starts a document with, when it has some (windows cached before documents
    began with them are not the same windows)."""
    own = tokenizer.fingerprint if isinstance(tokenizer, _Fingerprinted) else None
    if own:
        named = str(own)
    else:
        sizes = f"{vocab_size_of(tokenizer)}:{eos_id_of(tokenizer)}"
        named = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}:{sizes}"
    prefix = prefix_of(tokenizer)
    return f"{named}:starts{prefix}" if prefix else named


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """The ids of many documents (no end-of-document id), batched when the tokenizer can."""
    from dew.data.tokenizers import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):  # a byte's id is its value: no per-byte Python work
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]
    if isinstance(tokenizer, _BatchEncodes):
        return list(tokenizer.encode_batch(list(texts)))
    return [np.asarray(tokenizer.encode(text), dtype=np.int32) for text in texts]


def framed_documents(tokenizer: EosTokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Each document's ids as a training sequence holds them (int32): the ids the tokenizer starts a
    sequence with (dew.data.base.prefix_of), the text's ids, then its end-of-document id."""
    prefix = np.asarray(prefix_of(tokenizer), np.int32)
    eos = np.asarray([tokenizer.eos_id], np.int32)
    return [np.concatenate([prefix, np.asarray(ids, np.int32), eos]) for ids in encode_documents(tokenizer, texts)]


def split_records(records: ArrayRecords, fraction: float, seed: int) -> tuple[ArrayRecords, ArrayRecords | None]:
    """(train, val): a seeded random ``fraction`` of the records held out, each side in stored order."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {fraction}.")
    if fraction == 0.0:
        return records, None
    n = len(records)
    held = max(1, round(n * fraction))
    if held >= n:
        raise EmptyDatasetError(
            f"Holding out {fraction:.0%} of {n} records leaves none to train on. Use a smaller "
            f"val_fraction or more data."
        )
    order = np.random.default_rng(seed).permutation(n)
    return records.subset(np.sort(order[held:])), records.subset(np.sort(order[:held]))


@dataclass(frozen=True)
class TokenWindows:
    """Tokenized text in windows of ``length + 1`` int32 ids under ``"text"``.

    Give ``files`` (paths or globs) or ``dataset`` (a Hugging Face dataset name
    or local path, with ``split`` and ``config``). ``tokenizer`` is ``"byte"``,
    the path of a ``tokenizer.json``, or an object with ``encode`` and
    ``eos_id``.
    """

    files: str | Sequence[str | os.PathLike[str]] | None = None
    dataset: str | None = None
    split: str = "train"
    config: str | None = None
    text_key: str = "text"
    length: int = 1024
    tokenizer: Any = "byte"  # registry-validated: "byte", a tokenizer.json path or any tokenizer object
    cache_dir: str | None = None

    def text_tokenizer(self) -> EosTokenizer:
        """The tokenizer object this reader encodes with (``"byte"`` names ByteTokenizer)."""
        return resolve_tokenizer(self.tokenizer)

    def __post_init__(self) -> None:
        if (self.files is None) == (self.dataset is None):
            raise ValueError("TokenWindows reads either files= or dataset=; give exactly one.")
        if self.files is not None and not isinstance(self.files, str | os.PathLike):
            object.__setattr__(self, "files", tuple(os.fspath(f) for f in self.files))
        if self.length < 1:
            raise ValueError(f"TokenWindows.length must be at least 1, got {self.length}.")

    # -- text --------------------------------------------------------------------------------
    def _paths(self) -> list[Path]:
        return expand_files(self.files) if self.files is not None else []

    def documents(self) -> Iterator[str]:
        """Every document's text, in input order."""
        if self.dataset is not None:
            data = load_hf_dataset(self.dataset, split=self.split, config=self.config)
            require_column(data, self.text_key, f"The dataset {self.dataset!r} (split {self.split!r})")
            row = 0
            for chunk in data.select_columns([self.text_key]).iter(batch_size=1024):
                for text in chunk[self.text_key]:
                    row += 1
                    if text is not None and not isinstance(text, str):
                        raise MalformedRecordError(
                            f"Row {row} of the dataset {self.dataset!r} (split {self.split!r}) holds a "
                            f"{type(text).__name__} under {self.text_key!r}, not a string; point text_key= "
                            "at the text column.")
                    if text:  # a null or empty text is no document, as in the files
                        yield text
            return
        for path in self._paths():
            yield from self._file_documents(path)

    def _file_documents(self, path: Path) -> Iterator[str]:
        suffix = format_suffix(path)
        if suffix in _JSON_SUFFIXES:
            first = True
            for number, line in utf8_lines(path):
                if first and line.strip() and (wrong := not_json_lines(path, line)):
                    raise wrong
                first = first and not line.strip()
                text = self._json_text(line, path, number) if line.strip() else None
                if text:  # a null or empty text is no document, as in Parquet and hf_text
                    yield text
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            from dew.data.shards import reading_table

            with reading_table(path, "Parquet"):
                parquet = pq.ParquetFile(path)
                if self.text_key not in parquet.schema_arrow.names:
                    raise MissingKeyError(
                        f"The Parquet file {os.fspath(path)!r} has no column {self.text_key!r}; its "
                        f"columns are {parquet.schema_arrow.names}. Pass text_key= with the text column."
                    )
                yield from self._column_texts(path, (text for batch in parquet.iter_batches(
                    columns=[self.text_key], batch_size=4096) for text in batch.column(0).to_pylist()))
        elif suffix == ".arrow":  # a datasets cache's or save_to_disk's file, memory-mapped
            from dew.data.shards import Shards

            shards = Shards([path], self.text_key)
            yield from self._column_texts(path, shards.values(0, len(shards)))
        else:
            with open_data_file(path) as handle:
                raw = handle.read()
            if b"\x00" in raw and not raw.startswith(_WIDE_MARKS):  # an image or archive a glob picked up: tokenized, it is noise
                raise MalformedRecordError(
                    f"{os.fspath(path)!r} holds NUL bytes, so it is no text file (an image or an "
                    "archive, say); narrow data.files to the text, or give Parquet or JSONL its suffix."
                )
            text = _decoded(raw, path)
            if text:
                yield text

    def _column_texts(self, path: Path, texts: Iterable[object]) -> Iterator[str]:
        """The documents of a Parquet or Arrow file's text column: a null or empty one is none."""
        for row, text in enumerate(texts, 1):
            if text is not None and not isinstance(text, str):
                raise MalformedRecordError(
                    f"Row {row} of {os.fspath(path)!r} holds a {type(text).__name__} under "
                    f"{self.text_key!r}, not a string; point text_key= at the text column.")
            if text:
                yield text

    def _json_text(self, line: str, path: Path, number: int) -> str | None:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise MalformedRecordError(
                f"Line {number} of {os.fspath(path)!r} is not valid JSON ({error.msg}); each line "
                f"of a JSONL file must be one JSON object."
            ) from None
        if not isinstance(record, dict) or self.text_key not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise MissingKeyError(
                f"Line {number} of {os.fspath(path)!r} has no key {self.text_key!r} (it has {keys}). "
                f"Pass text_key= with the field that holds the text."
            )
        text = record[self.text_key]
        if text is not None and not isinstance(text, str):
            raise MalformedRecordError(
                f"The {self.text_key!r} of line {number} of {os.fspath(path)!r} is a "
                f"{type(text).__name__}, not a string; point text_key= at the text, or write it as one."
            )
        return text

    # -- tokens and windows -------------------------------------------------------------------
    def tokens(self, tokenizer: EosTokenizer | None = None) -> np.ndarray:
        """All documents' ids end to end as one int32 array, each framed as ``framed_documents`` says
        (the tokenizer's starting ids, the text's, eos_id)."""
        tokenizer = resolve_tokenizer(self.tokenizer) if tokenizer is None else tokenizer
        pieces: list[np.ndarray] = []
        chunk: list[str] = []
        for text in self.documents():
            chunk.append(text)
            if len(chunk) == _CHUNK:
                pieces.extend(framed_documents(tokenizer, chunk))
                chunk = []
        if chunk:
            pieces.extend(framed_documents(tokenizer, chunk))
        return np.concatenate(pieces).astype(np.int32, copy=False) if pieces else np.zeros(0, np.int32)

    def _key(self, tokenizer: EosTokenizer) -> str:
        """A digest of what the windows depend on: the inputs' bytes, the tokenizer, the length."""
        if self.dataset is not None:
            source: list[object] = [self.dataset, self.split, self.config]
            local = Path(self.dataset).expanduser()
            if local.exists():
                files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
                source += content_digest(files)
        else:
            source = list(content_digest(p.resolve() for p in self._paths()))
        blob = json.dumps([source, self.text_key, self.length, tokenizer_fingerprint(tokenizer)], default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def windows(self) -> np.ndarray:
        """The ``[windows, length + 1]`` int32 array (memory-mapped from cache_dir when set).

        A cached array is used only when it is this user's own, intact output for the
        same inputs (see dew.data.window_cache); otherwise it is rebuilt, with a warning.
        """
        tokenizer = resolve_tokenizer(self.tokenizer)
        key = None
        if self.cache_dir is not None:
            key = self._key(tokenizer)
            cached = window_cache.read(self.cache_dir, key)
            if cached is not None:
                return cached
        tokens = self.tokens(tokenizer)
        width = self.length + 1
        count = len(tokens) // width
        if count == 0:
            where = f"dataset {self.dataset!r}" if self.dataset is not None else f"files {self.files!r}"
            raise EmptyDatasetError(
                f"The {where} hold {len(tokens)} tokens (start and end ids included), fewer than "
                f"one window of length + 1 = {width}. Add text or use a smaller length."
            )
        windows = tokens[: count * width].reshape(count, width)
        if key is None:
            return windows
        assert self.cache_dir is not None  # a key is made only when there is a cache
        path = window_cache.write(self.cache_dir, key, windows)
        return np.load(path, mmap_mode="r", allow_pickle=False)

    def records(self) -> ArrayRecords:
        """The windows as a record source for train_stream: one record per window."""
        return ArrayRecords({"text": self.windows()})

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A Dataset over the windows: a seeded val_fraction of them held out (val_seed picks
        which, independent of the shuffle seed), the rest streamed by train_stream.

        Validation is one ordered pass over the held-out windows in global batches of
        batch rows; the last partial batch is dropped so every batch has one shape, and a
        held-out set smaller than one batch is refused here rather than yielding nothing.
        """
        train, val = split_records(self.records(), val_fraction, val_seed)
        if val is not None and len(val) < batch:
            raise EmptyDatasetError(
                f"val_fraction={val_fraction} holds out {len(val)} windows, fewer than one global "
                f"batch of {batch}, so validation would yield nothing. Raise val_fraction, lower "
                f"the batch, or add text."
            )
        return record_dataset(train, val, batch=batch, seed=seed, workers=workers, prefetch=prefetch)

