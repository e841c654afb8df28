"""HFText: text in local Arrow, Parquet or JSONL shards, tokenized as it is read, packed into windows.

A corpus larger than memory trains without being tokenized ahead of time
into a second copy: the shards are memory-mapped or read a row group at a
time (``dew.data.shards``), and the Grain workers that feed the run tokenize
the documents they are about to pack, with the run's tokenizer, many
documents per ``encode_batch`` call.

The windows are exactly TokenWindows': every document is followed by the
end-of-document id, the documents are laid end to end and the token stream
is cut into windows of ``length + 1`` ids (the tail shorter than a window is
dropped). ``segment_ids`` numbers the documents within each window (1, 2,
...), so LMObjective keeps attention inside each document.

The order. Documents are grouped in blocks of ``block`` consecutive ones;
each epoch lays the blocks end to end in a seeded permutation (the Feistel
bijection of ``dew.data.order``) and cuts that token stream into windows, so
a window's neighbours come from a random place in the corpus while the
tokenizer still works on runs of adjacent documents. Where window ``i`` of
epoch ``e`` starts is a sum of block lengths, which needs each block's token
count: they are counted once, before the first step, in Grain workers
(``index_workers``), and kept in ``cache_dir`` when it is set (one int64 per
block; in a process pool, a ``cache_dir`` every process sees lets a restart
skip the count). A block whose count changed since (the corpus was edited)
is refused by name rather than silently shifting every later window.

The position. Window ``r`` of the endless stream is a function of ``r``
alone, so the stream is an EndlessSource of train_stream: its position is
the global number of windows consumed, and a run resumes exactly, at any
process count and any number of workers. Validation holds out a seeded
``val_fraction`` of the blocks and reads them in stored order.

>>> import json, tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> lines = [json.dumps({"text": f"document {i} says hello."}) for i in range(40)]
>>> _ = (folder / "part-0.jsonl").write_text("\\n".join(lines))
>>> from dew.data import DataPartition
>>> data = HFText(files=str(folder), length=31).load(batch=4)
>>> batch = next(data.train(DataPartition()))
>>> batch["text"].shape, batch["segment_ids"].shape
((4, 32), (4, 32))
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from dew.data import window_cache
from dew.data.base import Dataset, EosTokenizer, close_if_closable
from dew.data.errors import DataError, EmptyDatasetError, MalformedRecordError
from dew.data.order import epoch_order
from dew.data.shards import Shards, expand_shards
from dew.data.stream import in_workers, record_dataset
from dew.data.token_windows import framed_documents, resolve_tokenizer, tokenizer_fingerprint

__all__ = ["HFText", "StaleIndexError", "StreamedWindows", "count_tokens"]

_BLOCKS_PER_TASK = 64  # blocks counted per Grain element while indexing
_CACHED_BLOCKS = 256  # tokenized blocks a process keeps (a few MB)


class StaleIndexError(DataError, ValueError):
    """A block's token count differs from the one indexed: the corpus changed since it was counted."""


def _texts(shards: Shards, start: int, stop: int) -> list[str]:
    """The non-empty texts of rows [start, stop) (a null or empty text is no document)."""
    out = []
    for row, value in enumerate(shards.values(start, stop), start):
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise MalformedRecordError(
                f"The text of {shards.where(row)} is a {type(value).__name__}, not a string; point "
                f"text_key at a column of text."
            )
        out.append(value)
    return out


@dataclass(frozen=True)
class _Count:
    """Tokens (end-of-document ids included) in each block of one indexing task."""

    shards: Shards
    tokenizer: EosTokenizer
    block: int
    blocks: int

    def __call__(self, task: int) -> np.ndarray:
        first = int(task) * _BLOCKS_PER_TASK
        last = min(first + _BLOCKS_PER_TASK, self.blocks)
        documents = len(self.shards)
        counts = np.zeros(last - first, np.int64)
        texts: list[str] = []
        owners: list[int] = []
        for b in range(first, last):
            found = _texts(self.shards, b * self.block, min((b + 1) * self.block, documents))
            texts.extend(found)
            owners.extend([b - first] * len(found))
        if texts:
            lengths = np.asarray([len(ids) for ids in framed_documents(self.tokenizer, texts)], np.int64)
            np.add.at(counts, np.asarray(owners), lengths)
        return counts


def count_tokens(shards: Shards, tokenizer: EosTokenizer, block: int, *, workers: int = 0) -> np.ndarray:
    """Tokens per block of ``block`` documents, each framed as a training sequence holds it
    (``framed_documents``: its starting and end-of-document ids included).

    The blocks are counted in Grain, by ``workers`` spawned processes when
    above 0 (the shards and the tokenizer must pickle).
    """
    blocks = -(-len(shards) // block)
    tasks = -(-blocks // _BLOCKS_PER_TASK)
    dataset = grain.MapDataset.range(tasks).map(_Count(shards, tokenizer, block, blocks)).to_iter_dataset(
        grain.ReadOptions(num_threads=1 if workers == 0 else 0, prefetch_buffer_size=2))
    iterator = iter(in_workers(dataset, workers))
    try:
        counts = [np.asarray(c) for c in iterator]
    finally:
        close_if_closable(iterator)
    return np.concatenate(counts) if counts else np.zeros(0, np.int64)


class StreamedWindows:
    """Windows of ``length + 1`` ids cut from blocks of documents tokenized on demand.

    ``take(indices)`` reads windows in stored order (the blocks as listed);
    ``endless(seed)`` reads the endless stream whose epochs permute the blocks
    (see the module docstring). Both return ``text`` and ``segment_ids``.
    """

    def __init__(self, shards: Shards, tokenizer: EosTokenizer, *, block: int, blocks: np.ndarray,
                 counts: np.ndarray, length: int) -> None:
        self.shards, self.tokenizer, self.block, self.length = shards, tokenizer, int(block), int(length)
        self.blocks = np.asarray(blocks, np.int64)
        self.all_sizes = np.asarray(counts, np.int64)  # tokens per block of the whole corpus
        self.sizes = self.all_sizes[self.blocks]
        self.width = self.length + 1
        self.windows = int(self.sizes.sum()) // self.width
        self._files: list[tuple[str, str]] | None = None
        self._reset()

    def _reset(self) -> None:
        self._tokens: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._layouts: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state.pop("_tokens")
        state.pop("_layouts")
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __len__(self) -> int:
        return self.windows

    def file_digests(self) -> list[tuple[str, str]]:
        """Each shard file with a digest of its bytes, sampled in a large one (dew.data.stream's
        DigestsFiles): an edit that keeps every block's token count, which fingerprint cannot see,
        is refused at a resume, naming the file. Taken once, when the first position is saved."""
        if self._files is None:
            self._files = self.shards.file_digests()
        return self._files

    def fingerprint(self) -> str:
        """A digest of the corpus as its blocks' token counts describe it (dew.data.stream's
        FingerprintedSource): an edit that changes any block's length is refused at a resume. The
        text is not read again for it (a streamed corpus may be large); file_digests samples it."""
        digest = hashlib.sha256(self.all_sizes.astype(np.int64).tobytes())
        digest.update(self.blocks.tobytes())
        digest.update(f"{self.block}:{self.length}".encode())
        return digest.hexdigest()[:32]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.windows:
            raise IndexError(f"Window {index} is outside [0, {self.windows}).")
        return {k: v[0] for k, v in self.take(np.asarray([index])).items()}

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Windows in stored order (the blocks as listed, no permutation)."""
        return self._read(np.asarray(indices, np.int64), seed=None)

    def endless(self, seed: int) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
        """The endless stream: epoch e lays the blocks out in permutation e of seed."""
        return _Endless(self, int(seed))

    # -- internals ------------------------------------------------------------------------------
    def _layout(self, seed: int | None, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids in epoch order, where each starts in the epoch's token stream)."""
        key = (-1 if seed is None else seed, -1 if seed is None else epoch)
        if key not in self._layouts:
            if len(self._layouts) >= 2:
                self._layouts.popitem(last=False)
            order = np.arange(len(self.blocks)) if seed is None else epoch_order(len(self.blocks), seed, epoch)
            starts = np.concatenate([[0], np.cumsum(self.sizes[order], dtype=np.int64)])
            self._layouts[key] = (self.blocks[order], starts)
        return self._layouts[key]

    def _tokenize(self, needed: Sequence[int]) -> None:
        """Tokenize the blocks not cached yet, all their documents in one batch."""
        missing = [b for b in dict.fromkeys(needed) if b not in self._tokens]
        for b in needed:
            if b in self._tokens:
                self._tokens.move_to_end(b)
        if not missing:
            return
        documents = len(self.shards)
        texts: list[str] = []
        sizes = []
        for b in missing:
            found = _texts(self.shards, b * self.block, min((b + 1) * self.block, documents))
            texts.extend(found)
            sizes.append(len(found))
        encoded = framed_documents(self.tokenizer, texts) if texts else []
        at = 0
        for b, size in zip(missing, sizes, strict=True):
            pieces = encoded[at:at + size]
            at += size
            tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
            if len(tokens) != self.all_sizes[b]:
                raise StaleIndexError(
                    f"Block {b} (documents {b * self.block} to {min((b + 1) * self.block, documents) - 1}, "
                    f"from {self.shards.where(b * self.block)}) holds {len(tokens)} tokens now, but "
                    f"{int(self.all_sizes[b])} when the corpus was indexed: the shards or the "
                    f"tokenizer changed since. Delete the stale index from cache_dir (or change it) "
                    f"and start the run afresh."
                )
            starts = np.zeros(len(tokens), bool)
            if pieces:
                lengths = np.asarray([len(ids) for ids in pieces], np.int64)
                starts[np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)] = True
            self._tokens[b] = (tokens, starts)
        while len(self._tokens) > max(_CACHED_BLOCKS, len(needed)):
            self._tokens.popitem(last=False)

    def _read(self, positions: np.ndarray, seed: int | None) -> dict[str, np.ndarray]:
        if self.windows == 0:
            raise EmptyDatasetError(
                f"The corpus holds {int(self.sizes.sum())} tokens, fewer than one window of "
                f"length + 1 = {self.width}.")
        text = np.empty((len(positions), self.width), np.int32)
        segments = np.empty((len(positions), self.width), np.int32)
        epochs, within = np.divmod(positions, self.windows)
        spans = []
        for row, (epoch, index) in enumerate(zip(epochs.tolist(), within.tolist(), strict=True)):
            order, starts = self._layout(seed, epoch)
            begin = index * self.width
            first = int(np.searchsorted(starts, begin, side="right")) - 1
            last = int(np.searchsorted(starts, begin + self.width - 1, side="right")) - 1
            spans.append((row, order[first:last + 1], begin - int(starts[first])))
        self._tokenize([int(b) for _, blocks, _ in spans for b in blocks])
        for row, blocks, offset in spans:
            filled = 0
            starts = np.empty(self.width, bool)
            for b in blocks:  # the window's slice of each block it spans
                tokens, firsts = self._tokens[int(b)]
                take = min(self.width - filled, len(tokens) - offset)
                text[row, filled:filled + take] = tokens[offset:offset + take]
                starts[filled:filled + take] = firsts[offset:offset + take]
                filled += take
                offset = 0
            numbered = np.cumsum(starts, dtype=np.int32)
            segments[row] = 1 + numbered - numbered[0]
        return {"text": text, "segment_ids": segments}

    def __repr__(self) -> str:
        return (f"StreamedWindows({len(self.blocks)} blocks of {self.block} documents, "
                f"{self.windows} windows of {self.width})")


@dataclass(frozen=True)
class _Endless:
    source: StreamedWindows
    seed: int

    def __call__(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        return self.source._read(np.asarray(positions, np.int64), self.seed)


@dataclass(frozen=True)
class HFText:
    """Text from local ``.arrow``, ``.parquet`` or ``.jsonl`` shards, tokenized on the fly.

    files are paths, globs or folders (a ``save_to_disk`` folder reads the
    Arrow files its state.json lists). text_key names the text column;
    tokenizer is ``"byte"``, a tokenizer.json path or an object with
    ``encode`` and ``eos_id``; block is the number of documents shuffled and
    tokenized together; cache_dir keeps the per-block token counts between
    runs; index_workers counts them in that many processes.
    """

    files: str | Sequence[str]
    text_key: str = "text"
    length: int = 1024
    tokenizer: Any = "byte"
    block: int = 16
    cache_dir: str | None = None
    index_workers: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.files, str | os.PathLike):
            object.__setattr__(self, "files", tuple(os.fspath(f) for f in self.files))
        if self.length < 1:
            raise ValueError(f"HFText.length must be at least 1, got {self.length}.")
        if self.block < 1:
            raise ValueError(f"HFText.block must be at least 1 document, got {self.block}.")

    def text_tokenizer(self) -> EosTokenizer:
        """The tokenizer object this reader encodes with (``"byte"`` names ByteTokenizer)."""
        return resolve_tokenizer(self.tokenizer)

    def shards(self) -> Shards:
        """The text column of every shard, rows numbered across the files."""
        shards = Shards(expand_shards(self.files), self.text_key)
        if len(shards) == 0:
            raise EmptyDatasetError(f"The shards {self.files!r} hold no rows.")
        return shards

    def _key(self, shards: Shards, tokenizer: EosTokenizer) -> str:
        files = []
        for path in shards.files:
            info = path.stat()
            files.append([os.fspath(path.resolve()), info.st_size, info.st_mtime_ns])
        blob = json.dumps([files, self.text_key, self.block, tokenizer_fingerprint(tokenizer)])
        return "counts-" + hashlib.sha256(blob.encode()).hexdigest()[:32]

    def token_counts(self, shards: Shards | None = None, tokenizer: EosTokenizer | None = None) -> np.ndarray:
        """Tokens per block, counted once (kept in cache_dir when set)."""
        shards = self.shards() if shards is None else shards
        tokenizer = self.text_tokenizer() if tokenizer is None else tokenizer
        key = None
        if self.cache_dir is not None:
            key = self._key(shards, tokenizer)
            cached = window_cache.read(self.cache_dir, key)
            if cached is not None:
                return np.asarray(cached)
        counts = count_tokens(shards, tokenizer, self.block, workers=self.index_workers)
        if self.cache_dir is not None and key is not None:
            window_cache.write(self.cache_dir, key, counts)
        return counts

    def records(self, blocks: np.ndarray | None = None) -> StreamedWindows:
        """The windows as a record source (all blocks, or those listed)."""
        shards, tokenizer = self.shards(), self.text_tokenizer()
        counts = self.token_counts(shards, tokenizer)
        blocks = np.arange(len(counts)) if blocks is None else np.asarray(blocks, np.int64)
        source = StreamedWindows(shards, tokenizer, block=self.block, blocks=blocks, counts=counts,
                                 length=self.length)
        if len(source) == 0:
            raise EmptyDatasetError(
                f"The shards {self.files!r} hold {int(source.sizes.sum())} tokens (end-of-document "
                f"ids included), fewer than one window of length + 1 = {self.length + 1}. Add text "
                f"or use a smaller length."
            )
        return source

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A Dataset over the windows: a seeded val_fraction of the blocks held out and read in
        stored order, the rest streamed endlessly (workers > 0 tokenizes in that many processes)."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}.")
        everything = self.records()
        if val_fraction == 0.0:
            return record_dataset(everything, None, batch=batch, seed=seed, workers=workers, prefetch=prefetch)
        total = len(everything.blocks)
        held = max(1, round(total * val_fraction))
        if held >= total:
            raise EmptyDatasetError(
                f"Holding out {val_fraction:.0%} of {total} blocks leaves none to train on. Use a "
                f"smaller val_fraction, a smaller block, or more data.")
        chosen = np.random.default_rng(val_seed).permutation(total)
        train = StreamedWindows(everything.shards, everything.tokenizer, block=self.block,
                                blocks=np.sort(chosen[held:]), counts=everything.all_sizes,
                                length=self.length)
        val = StreamedWindows(everything.shards, everything.tokenizer, block=self.block,
                              blocks=np.sort(chosen[:held]), counts=everything.all_sizes,
                              length=self.length)
        if len(val) < batch:
            raise EmptyDatasetError(
                f"val_fraction={val_fraction} holds out {len(val)} windows, fewer than one global "
                f"batch of {batch}, so validation would yield nothing. Raise val_fraction, lower "
                f"the batch, or add text.")
        return record_dataset(train, val, batch=batch, seed=seed, workers=workers, prefetch=prefetch)
