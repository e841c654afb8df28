"""train_stream: an endless, shuffled, sharded Grain stream that resumes anywhere.

The global order. Each epoch is a seeded permutation of the records
(``dew.data.order``: a Feistel bijection keyed by the seed and the epoch,
computed per index like Grain's index shuffle but vectorised), and the
epochs are laid end to end into one endless order. Global batch ``g`` after a start position ``r`` is records
``[r + g*B, r + (g+1)*B)`` of that order, so batches cross epoch boundaries
instead of dropping the last partial batch of each epoch. A source that lays
out its own endless stream (an EndlessSource: a corpus tokenized as it is
read, a mixture) maps the same positions to records itself. Share ``s`` of
``S`` reads rows ``[s*B/S, (s+1)*B/S)`` of every global batch; the union of
the shares is therefore the same at any process count.

The pipeline runs on Grain at the level of chunks (one share's rows of one
global batch): ``MapDataset.range(endless)[s::S]`` -> ``.map(chunk ->
record indices -> fetch and transform)`` -> ``.to_iter_dataset`` (a
prefetch thread) -> ``.mp_prefetch`` when ``workers``. A chunk's indices
come from the epoch's order (RecordOrder) and its records from one gather
(``source.take``) when the source offers it; routing every row through
Grain's per-index shuffle measured about 65 us per row here, too slow for
short token windows.

The position. Grain's own iterator state is per worker and does not survive a
change of worker or process count, so the stream's position is dew's own: the
global number of records consumed, ``r + batches * B``, saved as
``GLOBAL_POSITION`` + json. ``set_state`` rebuilds the pipeline from it, which
is valid for any share, any share count and any worker count.

Workers (``workers > 0``) are spawned processes: the source and the transform
must pickle, and a script that uses them must guard its entry point with
``if __name__ == "__main__":``. absl's flags, which Grain reads, are marked
parsed with their defaults when nothing parsed them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import grain
import numpy as np

from dew.data.base import (
    GLOBAL_POSITION,
    SINGLE,
    Consumption,
    DataPartition,
    Dataset,
    close_if_closable,
)
from dew.data.errors import (
    BatchDivisionError,
    EmptyDatasetError,
    ForeignPositionError,
    MissingKeyError,
    PositionMismatchError,
)
from dew.data.order import RecordOrder
from dew.data.sources import RecordSource

__all__ = [
    "CountingSource",
    "LaidOutSource",
    "RepeatingSource",
    "StepScheduled",
    "EndlessRecords",
    "EndlessSource",
    "Source",
    "StreamReader",
    "record_dataset",
    "TrainStream",
    "ValReader",
    "decode_position",
    "in_workers",
    "stream_reader",
    "train_stream",
    "val_stream",
]

Record = Mapping[str, Any]
Transform = Callable[[Record], Record]


@runtime_checkable
class EndlessSource(Protocol):
    """A record source that lays out its own endless stream (a streamed corpus, a mixture).

    ``endless(seed)`` returns a function from stream positions (an int64 array
    counting records of the whole global stream, across epochs) to those
    records stacked column by column. A source without it is read through
    ``take``/``[]`` in RecordOrder: one seeded permutation per epoch.
    """

    def endless(self, seed: int) -> Callable[[np.ndarray], dict[str, np.ndarray]]: ...


class EndlessRecords(EndlessSource, Protocol):
    """An EndlessSource that says how many records an epoch holds, as every streamed source must."""

    def __len__(self) -> int: ...


Source: TypeAlias = "RecordSource | EndlessRecords"
"""What a stream reads: records by index, or a source that lays out its own stream."""


@runtime_checkable
class _Takes(Protocol):
    """A record source that gathers a batch of indices at once (ArrayRecords.take)."""

    def take(self, indices: np.ndarray) -> Mapping[str, np.ndarray]: ...


@runtime_checkable
class CountingSource(Protocol):
    """A record source that can say what the first ``records`` positions of its stream hold.

    ``position_scalars(records)`` returns scalars to log (a mixture's
    ``data/<source>/records``) computed from the position alone, so every
    process reports the same.
    """

    def position_scalars(self, records: int) -> Mapping[str, float]: ...


@runtime_checkable
class LaidOutSource(Protocol):
    """A record source whose layout a recipe can change between runs (a mixture's sources and
    weights).

    ``layout(records)`` describes, as JSON values, how the stream's first
    ``records`` positions are drawn. A saved position keeps it, and a resume
    whose source draws those positions otherwise is refused: it would read
    some records twice and skip others.
    """

    def layout(self, records: int) -> Any: ...


def check_layout(source: Source, fields: Mapping[str, Any]) -> None:
    """Refuse a position saved under another layout of source's past records (see LaidOutSource)."""
    if "layout" not in fields or not isinstance(source, LaidOutSource):
        return
    records = int(fields["records"])
    mine = json.loads(json.dumps(source.layout(records)))
    if mine != fields["layout"]:
        raise PositionMismatchError(
            f"The data position was saved at record {records} of a stream drawn as "
            f"{json.dumps(fields['layout'])}; this data draws those records as {json.dumps(mine)}. "
            f"Resuming would read some records again and skip others. Restore the data as it was; "
            f"to change a mixture's weights from here on, keep its weights and add a schedule "
            f"entry at a step after the checkpoint.")


def _check_scheduled_batch(source: Source, fields: Mapping[str, Any], batch: int) -> None:
    """Refuse another batch for a layout that changes after the saved position: its later changes
    are placed at records counted in batches of the current size, so after steps of another size
    they would land at other steps than the schedule names."""
    saved = int(fields.get("batch", batch))
    if saved == batch or not isinstance(source, LaidOutSource):
        return
    records = int(fields["records"])
    if source.layout(records) != source.layout(2**62):  # a piece of the schedule begins later
        raise PositionMismatchError(
            f"The data position was saved by steps of {saved} records, and this stream reads {batch} a step; "
            f"its mixture's schedule changes the weights after the checkpoint, at steps it places by the "
            f"batch, so those changes would land at other steps than it names. Keep data.batch={saved} "
            f"until the schedule's last change, or leave the later entries out.")


@runtime_checkable
class FingerprintedSource(Protocol):
    """A record source that can digest what it holds (ArrayRecords: its arrays' bytes).

    A saved position keeps the digest, and a resume over a source that holds
    other records at the same count (a corpus edited in place) is refused: the
    saved position would point into other data without a word.
    """

    def fingerprint(self) -> str: ...


@runtime_checkable
class FingerprintsParts(Protocol):
    """A record source made of named parts (a mixture's sources), each digested alone: a saved
    position keeps each part's digest, and a resume over a part edited since is refused naming it,
    where the digest of the whole could only say that something changed."""

    def part_fingerprints(self) -> Sequence[tuple[str, str | None]]: ...


@runtime_checkable
class DigestsFiles(Protocol):
    """A record source read from files it can digest cheaply (hf_text's shards: their bytes,
    sampled), beside a fingerprint that cannot see every edit: a saved position keeps the digests,
    and a resume over a file edited since is refused naming it."""

    def file_digests(self) -> Sequence[tuple[str, str]]: ...


def check_files(source: Source, fields: Mapping[str, Any]) -> None:
    """Refuse a position saved over files whose bytes differ now (see DigestsFiles); a position
    saved before positions kept them is not checked."""
    if "files" not in fields or not isinstance(source, DigestsFiles):
        return
    now = source.file_digests()
    for (name, digest), saved in zip(now, fields["files"], strict=False):
        if digest != saved:
            raise PositionMismatchError(
                f"The data position was saved over another version of {name}: the file was edited since "
                "the checkpoint, keeping its records' count, so resuming would train on other text than the "
                "run's order holds. Restore the file as it was, or start a new run over this data.")


def check_content(source: Source, fields: Mapping[str, Any]) -> None:
    """Refuse a position saved over other contents of as many records (see FingerprintedSource)."""
    if "content" not in fields or not isinstance(source, FingerprintedSource):
        return
    if source.fingerprint() != fields["content"]:
        over, restore = "data", "the data"
        if isinstance(source, FingerprintsParts) and "parts" in fields:  # kept since mixtures name their parts
            saved = {name: digest for name, digest in fields["parts"]}
            changed = [name for name, digest in source.part_fingerprints() if saved.get(name) != digest]
            if changed:
                over = restore = (f"the mixture's source{'s' if len(changed) > 1 else ''} "
                                  f"{', '.join(repr(name) for name in changed)}")
        raise PositionMismatchError(
            f"The data position was saved over {over} whose contents differ from this data's (as many "
            "records, other contents: a file edited since the checkpoint, or another val_seed or val_fraction "
            "holding other records out, say), so resuming would train on "
            f"other records than the run's order holds. Restore {restore} as it was, or start a new run over "
            "this data.")


def source_fields(source: Source, records: int) -> dict[str, Any]:
    """What a position saved at records keeps of its source, for a resume to check: its layout (a
    LaidOutSource's), its content digest (a FingerprintedSource's), its parts' digests (a
    FingerprintsParts') and its files' digests (a DigestsFiles')."""
    fields: dict[str, Any] = {"layout": source.layout(records)} if isinstance(source, LaidOutSource) else {}
    if isinstance(source, FingerprintedSource):
        fields["content"] = source.fingerprint()
    if isinstance(source, FingerprintsParts):
        fields["parts"] = [list(part) for part in source.part_fingerprints()]
    if isinstance(source, DigestsFiles):
        fields["files"] = [digest for _, digest in source.file_digests()]
    return fields


@runtime_checkable
class RepeatingSource(Protocol):
    """A record source whose stream repeats records by design (a mixture draws a small source at
    a large weight many times over): it says how few records it may hold for a batch of a size,
    where any other source must hold at least one batch, as a batch would repeat its records."""

    def fewest_records(self, batch: int) -> int: ...


@runtime_checkable
class StepScheduled(Protocol):
    """A record source whose contents change at given steps (a mixture's schedule).

    Its stream is laid out in records, so it places a step at the records the
    steps before it hold: ``step * batch`` for a constant batch. A batch-size
    ramp (dew.data.ramped) gives it the ramp's count instead with
    ``at_steps(records_before)``, so a change scheduled for step 4 happens at
    step 4 whatever sizes the steps before it had.
    """

    def at_steps(self, records_before: Callable[[int], int]) -> Source: ...


@dataclass(frozen=True)
class _Ordered:
    """Positions -> records through a seeded RecordOrder and one gather."""

    fetch: _Fetch
    order: RecordOrder

    def __call__(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        return self.fetch(self.order(positions))


def stream_reader(source: Source, seed: int, transform: Transform | None = None
                  ) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """The function from stream positions to stacked records that train_stream reads source with.

    An EndlessSource lays out its own stream; any other source is shuffled by
    RecordOrder, one seeded permutation per epoch laid end to end.
    """
    if isinstance(source, EndlessSource):
        if transform is not None:
            raise ValueError(
                f"{type(source).__name__} lays out its own stream of stacked records, so it takes "
                "no per-record transform; transform its records where they are made instead."
            )
        return source.endless(seed)
    return _Ordered(_Fetch(source, transform), RecordOrder(_length(source), seed))


def _rows(batch: int, partition: DataPartition) -> int:
    if batch < 1:
        raise BatchDivisionError(f"The global batch must hold at least one row; got {batch}.")
    if batch % partition.shares:
        raise BatchDivisionError(
            f"A global batch of {batch} rows does not divide among {partition.shares} data "
            f"shares ({batch} % {partition.shares} = {batch % partition.shares}). Choose a "
            f"batch that is a multiple of {partition.shares}, such as "
            f"{max(partition.shares, batch - batch % partition.shares)}."
        )
    return batch // partition.shares


def _length(source: Source) -> int:
    length = len(source)
    if length == 0:
        raise EmptyDatasetError(f"The record source {source!r} holds no records; there is nothing to stream.")
    return length


@dataclass(frozen=True)
class _Fetch:
    """Turn an array of record indices into one batch: a dict of stacked arrays."""

    source: RecordSource
    transform: Transform | None = None

    def __call__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        # A source is any indexable (ArrayRecords, a third party's); one that can take a batch of
        # indices at once (ArrayRecords.take) is read that way.
        if self.transform is None and isinstance(self.source, _Takes):
            return dict(self.source.take(indices))
        records = [self.source[int(i)] for i in indices]
        if self.transform is not None:
            records = [self.transform(record) for record in records]
        return stack(records)


def stack(records: list[Record]) -> dict[str, np.ndarray]:
    """Stack records (mappings of arrays) column by column; every record must carry the same keys."""
    keys = list(records[0])
    for where, record in enumerate(records):
        if len(record) != len(keys) or any(key not in record for key in keys):
            missing = sorted(set(keys) - set(record)) or sorted(set(record) - set(keys))
            raise MissingKeyError(
                f"Records of one batch carry different keys: record {where} has {sorted(record)}, "
                f"record 0 has {sorted(keys)} (no key {missing[0]!r} in one of them). Every record "
                f"must carry the same keys; fix the source or make the transform return them all."
            )
    return {key: np.stack([np.asarray(record[key]) for record in records]) for key in keys}


def _read_options(prefetch: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=1 if prefetch > 0 else 0, prefetch_buffer_size=max(prefetch, 1))


_ENDLESS = 2**62  # chunks in an endless stream


@dataclass(frozen=True)
class _Chunk:
    """Chunk m of the stream after start: the records at positions [start + m*rows, ... + rows)."""

    read: Callable[[np.ndarray], dict[str, np.ndarray]]
    start: int
    rows: int

    def __call__(self, chunk: int) -> dict[str, np.ndarray]:
        first = self.start + int(chunk) * self.rows
        return self.read(np.arange(first, first + self.rows, dtype=np.int64))


def _pipeline(source: Source, *, batch: int, partition: DataPartition, seed: int, start: int,
              transform: Transform | None, workers: int, prefetch: int) -> Iterator[dict[str, np.ndarray]]:
    rows = _rows(batch, partition)
    chunk = _Chunk(stream_reader(source, seed, transform), start, rows)
    chunks = grain.MapDataset.range(_ENDLESS)[partition.share :: partition.shares]
    dataset = chunks.map(chunk).to_iter_dataset(_read_options(prefetch))
    return iter(in_workers(dataset, workers, buffer=max(prefetch, 1)))


def in_workers(dataset: grain.IterDataset, workers: int, *, buffer: int = 1) -> grain.IterDataset:
    """dataset read ahead by workers spawned processes (as it is, for none), each ending once this
    process is gone, with Grain's absl flags marked parsed (a program that is no absl app never parses
    them, and Grain's workers read them)."""
    if workers < 1:
        return dataset
    _flags_parsed()
    return dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer),
                               worker_init_fn=_EndWithParent(os.getpid()))


def _check_counts(workers: int, prefetch: int) -> None:
    """A negative count of reading processes or batches ahead, which read as none without a word."""
    if workers < 0 or prefetch < 0:
        raise ValueError(f"workers and prefetch count processes and batches: each must be at least 0, got "
                         f"workers={workers} and prefetch={prefetch}.")


@dataclass(frozen=True)
class _EndWithParent:
    """Started in each reading worker: the worker ends once the process that started it is gone.

    A ``kill -9`` of the run gives its workers no signal, and they went on running as orphans; a
    daemon thread here sees the worker's parent change and ends it (a worker's own ``prctl``
    death signal would fire when the starting thread ends, not the process).
    """

    parent: int

    def __call__(self, index: int, count: int) -> None:
        threading.Thread(target=self._watch, name="dew-parent-watch", daemon=True).start()

    def _watch(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(0.5)
        os._exit(1)


def _flags_parsed() -> None:
    """Mark absl's flags parsed (with their defaults) when nothing parsed them: Grain's workers read
    its flags, and a program that is not an absl app (dew train, a user's script) never parses them."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def decode_position(state: bytes) -> dict[str, Any]:
    """The json fields of a position train_stream wrote; ForeignPositionError otherwise."""
    if not isinstance(state, bytes | bytearray) or not bytes(state).startswith(GLOBAL_POSITION):
        head = bytes(state[:40]) if isinstance(state, bytes | bytearray) else type(state).__name__
        raise ForeignPositionError(
            f"The data position {head!r} was not written by train_stream (it lacks the "
            f"{GLOBAL_POSITION!r} prefix), so this stream cannot resume from it. Resume with the "
            f"reader that saved it, or start the data stream afresh."
        )
    try:
        fields = json.loads(bytes(state)[len(GLOBAL_POSITION):].decode())
        int(fields["records"])
    except (ValueError, KeyError, TypeError) as error:
        raise ForeignPositionError(f"The data position {bytes(state)!r} is corrupt: {error}.") from None
    return fields


class TrainStream:
    """This share's rows of an endless global stream, with a global position.

    Iterate it for batches (dicts of numpy arrays with ``batch // shares``
    rows). ``get_state()`` returns the global record count consumed;
    ``set_state`` rebuilds the Grain pipeline there. ``records`` is that count.
    """

    def __init__(self, source: Source, *, batch: int, partition: DataPartition = SINGLE, seed: int = 0,
                 transform: Transform | None = None, workers: int = 0, prefetch: int = 4,
                 start: int = 0) -> None:
        self.source = source
        self.batch = int(batch)
        self.partition = partition
        self.seed = int(seed)
        self.transform = transform
        self.workers = int(workers)
        self.prefetch = int(prefetch)
        _check_counts(self.workers, self.prefetch)
        self.size = _length(source)
        _rows(self.batch, partition)
        fewest = source.fewest_records(self.batch) if isinstance(source, RepeatingSource) else self.batch
        if self.size < fewest:  # each batch would repeat records (and a huge one cannot be read)
            raise EmptyDatasetError(
                f"The training records number {self.size}, fewer than one global batch of {self.batch}: "
                f"each batch would hold some of them twice. Lower the batch to at most {self.size}, or "
                "add records.")
        self.records = int(start)
        self._iterator: Iterator[dict[str, np.ndarray]] | None = None
        self._order = RecordOrder(self.size, self.seed)
        self._last: tuple[int, int] | None = None

    def _open(self) -> Iterator[dict[str, np.ndarray]]:
        if self._iterator is None:
            self._iterator = _pipeline(
                self.source, batch=self.batch, partition=self.partition, seed=self.seed,
                start=self.records, transform=self.transform, workers=self.workers,
                prefetch=self.prefetch)
        return self._iterator

    def __iter__(self) -> TrainStream:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = next(self._open())
        if self.workers > 0:  # out of the workers' shared memory, which is let go of now rather than at exit
            out = {key: np.array(value) for key, value in out.items()}
        self._last = (self.records, self.records + self.batch)
        self.records += self.batch
        return out

    def consumption(self) -> Consumption:
        """The global batch the last ``next()`` returned rows of: its positions and record ids.

        The ids come from the same global order the shares read their rows
        from, so every share reports the same global batch.
        """
        if self._last is None:
            raise RuntimeError("consumption() describes the last batch; call next() first.")
        first, end = self._last
        return Consumption(first, end, self._order(np.arange(first, end, dtype=np.int64)),
                           {"seed": self.seed, "size": self.size})

    def scalars(self) -> Mapping[str, float]:
        """What the stream so far holds, for the trainer to log (a CountingSource's counts)."""
        return self.source.position_scalars(self.records) if isinstance(self.source, CountingSource) else {}

    @property
    def epoch(self) -> float:
        """Epochs consumed so far (records / dataset size)."""
        return self.records / self.size

    def get_state(self) -> bytes:
        """GLOBAL_POSITION + json: records consumed, seed, batch, dataset size, (a
        LaidOutSource's) layout and (a FingerprintedSource's) content digest."""
        fields = {"records": self.records, "seed": self.seed, "batch": self.batch, "size": self.size,
                  **source_fields(self.source, self.records)}
        return GLOBAL_POSITION + json.dumps(fields, sort_keys=True).encode()

    def set_state(self, state: bytes) -> None:
        """Continue from a position any share of this stream saved, at any share count."""
        fields = decode_position(state)
        if int(fields.get("seed", self.seed)) != self.seed:
            raise PositionMismatchError(
                f"The data position was saved with shuffle seed {fields['seed']}, this stream "
                f"uses seed {self.seed}; resuming would replay and skip records. Open the stream "
                f"with seed={fields['seed']}."
            )
        check_layout(self.source, fields)  # a mixture names what changed, before its total size
        _check_scheduled_batch(self.source, fields, self.batch)
        if int(fields.get("size", self.size)) != self.size:
            raise PositionMismatchError(
                f"The data position was saved over {fields['size']} records, this source holds "
                f"{self.size}: the data changed since the checkpoint, or another val_fraction or "
                f"val_seed (data.load) holds another share of it out, so the position means nothing "
                f"here. Restore the data and its held-out share as they were, or start the stream afresh."
            )
        check_files(self.source, fields)  # names the file, where the digest of the whole cannot
        check_content(self.source, fields)
        self.close()
        self.records = int(fields["records"])
        self._last = None

    def close(self) -> None:
        """Stop the prefetch threads and worker processes (a later next() reopens)."""
        iterator, self._iterator = self._iterator, None
        close_if_closable(iterator)

    def __enter__(self) -> TrainStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def train_stream(source: Source, *, batch: int, partition: DataPartition = SINGLE, seed: int = 0,
                 transform: Transform | None = None, workers: int = 0, prefetch: int = 4) -> TrainStream:
    """Open this process's endless, shuffled share of source's records.

    batch is the global batch (rows over all shares); each step yields
    ``batch // partition.shares`` rows as a dict of numpy arrays. transform
    maps one record (a dict of arrays) to another before batching. workers > 0
    reads in that many spawned processes; the stream is identical either way.

    >>> import numpy as np
    >>> from dew.data.sources import ArrayRecords
    >>> stream = train_stream(ArrayRecords({"x": np.arange(10)}), batch=4, seed=0)
    >>> first = next(stream)["x"]
    >>> position = stream.get_state()
    >>> second = next(stream)["x"]
    >>> again = train_stream(ArrayRecords({"x": np.arange(10)}), batch=4, seed=0)
    >>> again.set_state(position)
    >>> bool((next(again)["x"] == second).all())
    True
    """
    return TrainStream(source, batch=batch, partition=partition, seed=seed, transform=transform,
                       workers=workers, prefetch=prefetch)


def val_stream(source: RecordSource, *, batch: int, partition: DataPartition = SINGLE,
               transform: Transform | None = None,
               remainder: Literal["drop", "short"] = "drop", prefetch: int = 4) -> Iterator[dict[str, np.ndarray]]:
    """One pass over source in its stored order, this share's rows of each global batch.

    Global batch ``g`` is records ``[g*B, (g+1)*B)``; share ``s`` reads rows
    ``[s*B/S, (s+1)*B/S)`` of it. The last partial global batch (``n % B``
    records) is dropped with ``remainder="drop"``, so every batch has the
    compiled shape; with ``"short"`` it is cut to a multiple of the share count
    and yielded with fewer rows (at most ``S - 1`` records are left out).
    Raises EmptyDatasetError when no batch at all would come out.
    """
    rows = _rows(batch, partition)
    n = _length(source)
    shares = partition.shares
    full, left = divmod(n, batch)
    short = (left // shares) * shares if remainder == "short" else 0
    if full == 0 and short == 0:
        raise EmptyDatasetError(
            f"The validation split holds {n} records, fewer than one global batch of {batch} "
            f"(remainder={remainder!r}); it would yield nothing. Use a smaller batch, more "
            f"validation records, or remainder='short'."
        )
    starts = [g * batch + partition.share * rows for g in range(full)]
    spans = [(start, start + rows) for start in starts]
    if short:
        each = short // shares
        begin = full * batch + partition.share * each
        spans.append((begin, begin + each))
    dataset = grain.MapDataset.source(spans).map(_SpanFetch(_Fetch(source, transform)))
    return iter(dataset.to_iter_dataset(_read_options(prefetch)))


@dataclass(frozen=True)
class _SpanFetch:
    fetch: _Fetch

    def __call__(self, span: tuple[int, int]) -> dict[str, np.ndarray]:
        return self.fetch(np.arange(span[0], span[1]))


@dataclass(frozen=True)
class StreamReader:
    """A Dataset.train factory over a record source: ``reader(partition)`` opens a TrainStream.

    ``open`` takes another global batch or start position, which is how
    ``dew.data.ramped`` changes the batch size mid-stream.
    """

    source: Source
    batch: int
    seed: int = 0
    transform: Transform | None = None
    workers: int = 0
    prefetch: int = 4

    def __post_init__(self) -> None:
        _check_counts(self.workers, self.prefetch)  # as the data loads, not as the run starts

    def __call__(self, partition: DataPartition = SINGLE) -> TrainStream:
        return self.open(partition)

    def open(self, partition: DataPartition = SINGLE, *, batch: int | None = None,
             start: int = 0) -> TrainStream:
        return TrainStream(self.source, batch=self.batch if batch is None else batch,
                           partition=partition, seed=self.seed, transform=self.transform,
                           workers=self.workers, prefetch=self.prefetch, start=start)


@dataclass(frozen=True)
class ValReader:
    """A Dataset.val factory: ``reader(partition)`` opens one pass (see val_stream)."""

    source: RecordSource
    batch: int
    transform: Transform | None = None
    remainder: Literal["drop", "short"] = "drop"

    def __call__(self, partition: DataPartition = SINGLE) -> Iterator[dict[str, np.ndarray]]:
        return val_stream(self.source, batch=self.batch, partition=partition,
                          transform=self.transform, remainder=self.remainder)


def record_dataset(train: Source, val: RecordSource | None, *, batch: int, seed: int = 0, workers: int = 0,
                   prefetch: int = 4) -> Dataset:
    """The Dataset of a training record source and an optional held-out one, in global order.

    A held-out source smaller than one global batch is refused here, when the data
    loads, rather than at the first evaluation, after the run has trained that far.
    """
    if val is not None and _length(val) < batch:
        raise EmptyDatasetError(
            f"The held-out validation split holds {_length(val)} records, fewer than one global "
            f"batch of {batch}, so validation would yield nothing. Raise val_fraction, lower the "
            f"batch, or add data."
        )
    return Dataset(
        train=StreamReader(train, batch=batch, seed=seed, workers=workers, prefetch=prefetch),
        val=None if val is None else ValReader(val, batch=batch),
        records=len(train),
        batch=batch,
    )
