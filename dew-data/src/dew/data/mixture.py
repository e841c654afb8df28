"""Mixture: named sources drawn by weight, or by a schedule of weights over steps.

Each source is any registered dataset reader (its ``name`` and fields, as a
recipe's ``data`` section gives them) or a reader object; the mixture draws
single records from their streams. Which source fills stream position ``r``
is Grain's own interleave (``grain.MapDataset.mix``): for integer
proportions ``p_i`` summing to ``S``, source ``i`` holds exactly
``n*p_i/S`` of every ``n`` positions, rounded down or up, in a fixed
pattern. It is computed here vectorised and in closed form, so any position
costs the same whatever its size, and the test suite checks it against
``MapDataset.mix`` itself.

A schedule is a list of ``{step, weights}``: from its step on (counted in
global batches of the dataset's batch, or in a batch-size ramp's steps: see
``MixtureSource.at_steps``) each entry's weights apply, until the next
entry's step. Position ``r`` of piece ``p`` draws record number
``C_p[i] + j`` of source ``i``'s own endless stream, where ``C_p[i]`` is how
many records source ``i`` gave before the piece began; that stream is the
source's usual one (its records shuffled per epoch by its own seed, derived
from the mixture's seed and the source's name).

So position ``r`` is a function of ``r`` alone: the mixture is an
EndlessSource of train_stream, its checkpointed position is the global
record count, and a resumed run draws the same records at any process count
or number of workers. The stream reports ``data/<source>/records`` (records
drawn from each source so far, over all processes) with every step.

Records of every source must carry the same keys with the same shapes. A
key some sources lack is filled for them from ``fill`` (``loss_mask`` and
``segment_ids`` with ones: every token scored, one document per row, which
is what a row without those keys means), so token windows mix with packed
conversations.

>>> import numpy as np
>>> from dew.data.sources import ArrayRecords
>>> class Rows:
...     def __init__(self, value): self.value = value
...     def records(self): return ArrayRecords({"x": np.full((10, 2), self.value)})
>>> mixture = Mixture(sources={"a": Rows(0), "b": Rows(1)}, weights={"a": 3, "b": 1})
>>> from dew.data import DataPartition
>>> stream = mixture.load(batch=8).train(DataPartition())
>>> next(stream)["x"][:, 0].tolist()
[0, 0, 0, 1, 0, 0, 0, 1]
>>> dict(stream.scalars())
{'data/a/records': 6.0, 'data/b/records': 2.0}
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dew.data.base import Dataset, Tokenizer
from dew.data.errors import DataError, EmptyDatasetError
from dew.data.stream import DigestsFiles, FingerprintedSource, Source, StreamReader, stream_reader

__all__ = ["Mixture", "MixtureError", "MixtureSource", "interleave", "interleave_counts", "proportions"]


@runtime_checkable
class _ListsRecords(Protocol):
    """A reader a mixture can draw from: its ``records()`` are a record source."""

    def records(self) -> Source: ...

_FILL = {"loss_mask": 1, "segment_ids": 1}


class MixtureError(DataError, ValueError):
    """A mixture's sources, weights or schedule cannot make a stream (the message names the source)."""


# -- Grain's interleave, vectorised ----------------------------------------------------------------

def proportions(weights: Sequence[float]) -> tuple[int, ...]:
    """Positive float weights as the integer proportions grain.MapDataset.mix draws with.

    Weights so small that 100 over the least overflows (below about 1e-306) are first divided by
    the largest, which keeps their ratios; any others are scaled exactly as grain scales them.
    """
    if not math.isfinite(100 / min(weights)):
        weights = [w / max(weights) for w in weights]
    scale = 100 / min(weights)
    return tuple(int(w * scale) for w in weights)


def interleave(positions: np.ndarray, parts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(which part, index within it) of each position of the interleave of integer proportions.

    The same as ``grain.MapDataset.mix``'s selection, for an array of positions at once.
    """
    k = np.asarray(positions, dtype=np.int64)
    if len(k) and int(k.max()) + 1 > (2**62) // max(sum(parts), 1):
        k = k.astype(object)  # Python integers: exact however far the stream has run
    remaining = sum(parts)
    now, after = k, k + 1
    which = np.full(len(k), -1, np.int64)
    index = np.zeros(len(k), np.int64)
    for i, part in enumerate(parts):
        now_next = now * (remaining - part) // remaining
        after_next = after * (remaining - part) // remaining
        counted = after - after_next
        hit = (which < 0) & ((now - now_next) != counted)
        which[hit] = i
        index[hit] = np.asarray(counted[hit], np.int64) - 1
        remaining -= part
        now, after = now_next, after_next
    return which, index


def interleave_counts(n: int, parts: Sequence[int]) -> list[int]:
    """How many of the first n positions of the interleave each part holds."""
    remaining, now, out = sum(parts), int(n), []
    for part in parts:
        following = now * (remaining - part) // remaining
        out.append(now - following)
        remaining -= part
        now = following
    return out


# -- the source ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    """From record ``start`` on: the sources drawn (indices), their proportions, and how many
    records each source (all of them) gave before this piece."""

    start: int
    sources: tuple[int, ...]
    parts: tuple[int, ...]
    before: tuple[int, ...]


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class MixtureSource:
    """The endless stream of a mixture (see the module docstring)."""

    def __init__(self, names: Sequence[str], sources: Sequence[Source], pieces: Sequence[_Piece],
                 template: Mapping[str, tuple[tuple[int, ...], str]], fill: Mapping[str, int],
                 remake: Callable[[Callable[[int], int]], MixtureSource] | None = None) -> None:
        self.names = tuple(names)
        self._remake = remake
        self.sources = tuple(sources)
        self.pieces = tuple(pieces)
        self.template = dict(template)
        self.fill = dict(fill)
        self._starts = np.asarray([p.start for p in self.pieces], np.int64)

    def __len__(self) -> int:
        """The records of all sources together: a nominal size the saved position is checked by."""
        return sum(len(s) for s in self.sources)

    def fewest_records(self, batch: int) -> int:
        """One: each source starts over when its share outlasts its records, so sources holding
        fewer records together than one batch still fill it (a small source at a large weight
        repeats within a batch whatever the others hold)."""
        return 1

    def at_steps(self, records_before: Callable[[int], int]) -> MixtureSource:
        """The same mixture with its schedule's steps placed at records_before(step) records
        (dew.data.stream.StepScheduled: a batch-size ramp's count)."""
        return self if self._remake is None else self._remake(records_before)

    def endless(self, seed: int) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
        return _MixedRead(self, int(seed))

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, record number in that source's stream) of each stream position."""
        positions = np.asarray(positions, np.int64)
        which = np.empty(len(positions), np.int64)
        number = np.empty(len(positions), np.int64)
        piece_of = np.searchsorted(self._starts, positions, side="right") - 1
        for p in np.unique(piece_of):
            piece = self.pieces[int(p)]
            here = piece_of == p
            part, index = interleave(positions[here] - piece.start, piece.parts)
            chosen = np.asarray(piece.sources, np.int64)[part]
            which[here] = chosen
            number[here] = np.asarray(piece.before, np.int64)[chosen] + index
        return which, number

    def drawn(self, records: int) -> list[int]:
        """How many of the first records positions each source filled."""
        p = int(np.searchsorted(self._starts, records, side="right")) - 1
        piece = self.pieces[p]
        out = list(piece.before)
        for source, count in zip(piece.sources, interleave_counts(records - piece.start, piece.parts),
                                 strict=True):
            out[source] += count
        return out

    def layout(self, records: int) -> dict[str, Any]:
        """The sources in order with their sizes, and the weights (as whole proportions) of every
        piece of the schedule that began before records: what a saved position is checked by."""
        past = [piece for piece in self.pieces if piece.start < records] or list(self.pieces[:1])
        return {"sources": [[name, len(source)] for name, source in zip(self.names, self.sources, strict=True)],
                "weights": [[piece.start, [[self.names[i], part] for i, part in
                                           zip(piece.sources, piece.parts, strict=True)]] for piece in past]}

    def fingerprint(self) -> str:
        """The sources' digests together (dew.data.stream.FingerprintedSource): a source edited in
        place since a position was saved is refused at the resume, as it is alone."""
        prints = [list(part) for part in self.part_fingerprints()]
        return hashlib.sha256(json.dumps(prints).encode()).hexdigest()[:32]

    def part_fingerprints(self) -> list[tuple[str, str | None]]:
        """Each source's name and digest (None: it keeps none), so a refused resume names the source
        edited (dew.data.stream.FingerprintsParts)."""
        return [(name, source.fingerprint() if isinstance(source, FingerprintedSource) else None)
                for name, source in zip(self.names, self.sources, strict=True)]

    def file_digests(self) -> list[tuple[str, str]]:
        """Every source's files with their digests (dew.data.stream.DigestsFiles), in order."""
        return [pair for source in self.sources if isinstance(source, DigestsFiles)
                for pair in source.file_digests()]

    def position_scalars(self, records: int) -> dict[str, float]:
        """``data/<source>/records`` for the first records positions of the stream."""
        return {f"data/{name}/records": float(count)
                for name, count in zip(self.names, self.drawn(records), strict=True)}

    def __repr__(self) -> str:
        return f"MixtureSource({', '.join(f'{n}: {len(s)}' for n, s in zip(self.names, self.sources, strict=True))})"


class _MixedRead:
    """Stream positions -> records, each from the source and record number the interleave names."""

    def __init__(self, mixture: MixtureSource, seed: int) -> None:
        self.mixture = mixture
        self.seed = seed
        self.readers = [stream_reader(source, _seed_of(seed, name))
                        for name, source in zip(mixture.names, mixture.sources, strict=True)]

    def __call__(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        which, number = self.mixture.draws(positions)
        out = {key: np.empty((len(positions), *shape), np.dtype(dtype))
               for key, (shape, dtype) in self.mixture.template.items()}
        for source in np.unique(which):
            rows = np.flatnonzero(which == source)
            got = self.readers[int(source)](number[rows])
            for key, array in out.items():
                array[rows] = got[key] if key in got else self.mixture.fill[key]
        return out


# -- the reader ----------------------------------------------------------------------------------

def _is_number(value: object) -> bool:
    """A real number, numpy's too (np.int64(3), np.float32(0.75)); not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def _weight_problems(sources: Mapping[str, Any], weights: object, what: str) -> list[tuple[tuple[str, ...], str]]:
    """The problems of one set of weights (what names it in messages: "weights", "the weights at step 5")."""
    if not isinstance(weights, Mapping):
        return [((), f"The mixture's {what} are {weights!r}; give a mapping {{source: weight, ...}}.")]
    unknown = sorted(set(map(str, weights)) - set(map(str, sources)))
    if unknown:
        return [((unknown[0],), f"The mixture's {what} name source {unknown[0]!r}, which is not among its "
                                f"sources ({', '.join(map(str, sources))}).")]
    for name, weight in weights.items():
        if not _is_number(weight) or not np.isfinite(weight) or weight < 0:
            return [((str(name),), f"Mixture source {name!r} has weight {weight!r} in the {what}; a weight "
                                   f"is a finite number >= 0 (0 leaves the source out).")]
    positive = [float(w) for w in weights.values() if w > 0]
    if not positive:
        return [((), f"Every weight in the mixture's {what} is 0; give some source a positive weight.")]
    if max(positive) / min(positive) > _WIDEST:
        return [((), f"The mixture's {what} differ by more than {_WIDEST:.0e} times ({min(positive)!r} "
                     f"against {max(positive)!r}); a source that rare is never drawn in a run: give it "
                     f"weight 0, or a larger one.")]
    return []


def _schedule_problems(sources: Mapping[str, Any], schedule: object) -> list[tuple[tuple[str, ...], str]]:
    if not isinstance(schedule, Sequence) or isinstance(schedule, str) or not schedule:
        return [(("schedule",), f"A mixture's schedule is a list of {{step: N, weights: {{source: weight, "
                                f"...}}}} starting at step 0; got {schedule!r}.")]
    found: list[tuple[tuple[str, ...], str]] = []
    steps: list[int] = []
    for number, entry in enumerate(schedule):
        where = ("schedule", str(number))
        if not isinstance(entry, Mapping) or set(entry) != {"step", "weights"}:
            found.append((where, f"Schedule entry {number} is {entry!r}; each entry is {{step: N, weights: "
                                 f"{{source: weight, ...}}}}."))
            continue
        step = entry["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            found.append(((*where, "step"), f"Schedule entry {number} starts at step {step!r}; a step is a "
                                            f"whole number >= 0 (counted in global batches)."))
            continue
        steps.append(step)
        found += [((*where, "weights", *path), message) for path, message in
                  _weight_problems(sources, entry["weights"], f"weights at step {step}")]
    if found:
        return found
    if steps[0] != 0:
        return [(("schedule", "0", "step"), "A mixture's schedule starts at step 0: its first entry needs step: 0.")]
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        return [(("schedule",), f"The schedule's steps must increase; they are {steps}.")]
    return []


def _unweighted_problems(sources: Mapping[str, Any], weightings: Sequence[Mapping[str, Any]], field: str
                         ) -> list[tuple[tuple[str, ...], str]]:
    """A source no weights name: it would be read and tokenized, and never drawn, without a word."""
    named = {str(name) for weights in weightings for name in weights}
    missing = [str(name) for name in sources if str(name) not in named]
    if not missing:
        return []
    return [((field,), f"Mixture source {missing[0]!r} has no weight, so it would never be drawn; give it "
                    f"one (weight 0 leaves it out on purpose), or remove the source.")]


def _source_problems(name: str, given: Mapping[str, Any]) -> list[str]:
    """A source given by registered name: the name exists and its fields are its reader's."""
    from dew import registry

    if "name" not in given:
        return [f"Mixture source {name!r} is {dict(given)!r}; name its registered dataset with name: "
                f"(token_windows, hf_text, chat, ...), beside its fields."]
    try:
        registry.datasets.validate(str(given["name"]), {k: v for k, v in given.items() if k != "name"})
    except registry.RegistryError as error:
        return [f"Mixture source {name!r}: {error}"]
    return []


_WIDEST = 1e9  # the largest ratio of two positive weights: Grain draws with integer proportions


@dataclass(frozen=True)
class Mixture:
    """Named sources mixed by weight (see the module docstring).

    sources maps each name to a registered dataset (``{"name": ..., fields}``)
    or a reader with ``records()``; weights maps names to non-negative weights
    (a source left out weighs 0); schedule is instead a list of ``{"step":
    s, "weights": {...}}`` starting at step 0; fill gives the value of a key
    some sources' records lack.
    """

    sources: Mapping[str, Any]
    weights: Mapping[str, float] | None = None
    schedule: Sequence[Mapping[str, Any]] | None = None
    fill: Mapping[str, int] = field(default_factory=lambda: dict(_FILL))

    def __post_init__(self) -> None:
        found = self.field_problems({"sources": self.sources, "weights": self.weights,
                                     "schedule": self.schedule})
        if found:
            raise MixtureError(found[0][1])

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """What is wrong with a mixture's sources, weights and schedule, each problem with the
        field it is in (dew.registry.ChecksFields: ``dew train --check`` asks this before
        anything is built; constructing a Mixture raises the first as a MixtureError)."""
        sources = fields.get("sources") or {}
        weights, schedule = fields.get("weights"), fields.get("schedule")
        if not isinstance(sources, Mapping) or not sources:
            return [(("sources",), "A mixture needs at least one source; give sources={name: dataset, ...}.")]
        if (weights is None) == (schedule is None):
            return [((), "A mixture takes weights= or schedule=; give exactly one.")]
        if weights is not None:
            weighing = [(("weights", *path), message) for path, message in _weight_problems(sources, weights, "weights")]
        else:
            weighing = _schedule_problems(sources, schedule)
        found = weighing + [(("sources", str(name)), message) for name, given in sources.items()
                            if isinstance(given, Mapping) for message in _source_problems(str(name), given)]
        if not weighing:  # every weight readable: is every source given one?
            found += (_unweighted_problems(sources, [weights], "weights") if weights is not None else
                      _unweighted_problems(sources, [entry["weights"] for entry in schedule or ()], "schedule"))
        return found

    def _steps(self) -> list[tuple[int, Mapping[str, float]]]:
        """The schedule as (step, weights) pairs (weights alone: one at step 0), checked already."""
        if self.weights is not None:
            return [(0, self.weights)]
        return [(int(entry["step"]), entry["weights"]) for entry in self.schedule or ()]

    # -- building the sources -----------------------------------------------------------------
    @cached_property
    def readers(self) -> dict[str, object]:
        """Each source's reader, built from the registry when given as a mapping."""
        from dew import registry

        built: dict[str, object] = {}
        for name, given in self.sources.items():
            if isinstance(given, Mapping):
                fields = {k: v for k, v in given.items() if k != "name"}
                try:
                    built[name] = registry.datasets.build(str(given["name"]), **fields)
                except Exception as error:
                    error.add_note(f"(while building mixture source {name!r})")
                    raise
            else:
                built[name] = given
        return built

    def text_tokenizer(self) -> Tokenizer | None:
        """The sources' common tokenizer (None when none encodes text); they must agree."""
        from dew.data.base import TextReader
        from dew.data.token_windows import tokenizer_fingerprint

        found = {name: reader.text_tokenizer() for name, reader in self.readers.items()
                 if isinstance(reader, TextReader)}
        found = {name: tokenizer for name, tokenizer in found.items() if tokenizer is not None}
        if not found:
            return None
        prints = {name: tokenizer_fingerprint(tokenizer) for name, tokenizer in found.items()}
        if len(set(prints.values())) > 1:
            first, *rest = prints
            other = next(n for n in rest if prints[n] != prints[first])
            raise MixtureError(
                f"Mixture sources {first!r} and {other!r} encode text with different tokenizers; one "
                f"model reads every row, so give every source the same tokenizer.")
        return next(iter(found.values()))

    def _records(self) -> dict[str, Source]:
        out = {}
        for name, reader in self.readers.items():
            if not (isinstance(reader, _ListsRecords) and callable(reader.records)):  # a Dataset's is a count
                raise MixtureError(
                    f"Mixture source {name!r} is a {type(reader).__name__}, which has no records(); a "
                    f"mixture draws single records, so each source must be a reader that lists them.")
            try:
                source = reader.records()
            except DataError as error:
                raise type(error)(f"Mixture source {name!r}: {error}") from error
            if len(source) == 0:
                raise EmptyDatasetError(f"Mixture source {name!r} holds no records; remove it or give it data.")
            out[name] = source
        return out

    def _template(self, sources: Mapping[str, Source]) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every key's record shape and dtype, checked to agree across the sources."""
        first: dict[str, tuple[str, tuple[int, ...], str]] = {}
        seen: dict[str, set[str]] = {}
        for name, source in sources.items():
            record = {k: np.asarray(v) for k, v in stream_reader(source, 0)(np.asarray([0])).items()}
            seen[name] = set(record)
            for key, value in record.items():
                shape, dtype = tuple(value.shape[1:]), value.dtype.str
                if key not in first:
                    first[key] = (name, shape, dtype)
                elif first[key][1:] != (shape, dtype):
                    other, their_shape, their_dtype = first[key]
                    raise MixtureError(
                        f"Mixture sources {other!r} and {name!r} give {key!r} different shapes or dtypes "
                        f"({their_shape} {np.dtype(their_dtype)} and {shape} {np.dtype(dtype)}); one "
                        f"compiled step reads every row, so make them agree (the same length, say).")
        for name, keys in seen.items():
            lacking = sorted(set(first) - keys - set(self.fill))
            if lacking:
                owner = first[lacking[0]][0]
                raise MixtureError(
                    f"Mixture source {name!r} gives no {lacking[0]!r}, which source {owner!r} does, and "
                    f"fill has no value for it. Add {lacking[0]}: VALUE to fill, or mix sources whose "
                    f"records carry the same keys.")
        return {key: (shape, np.dtype(dtype).str) for key, (_, shape, dtype) in first.items()}

    def source(self, batch: int, records_before: Callable[[int], int] | None = None) -> MixtureSource:
        """The mixture's endless record source, its schedule counted in global batches of batch
        (or, given records_before, a step placed at the records the steps before it hold)."""
        sources = self._records()
        names = list(sources)
        pieces: list[_Piece] = []
        before = [0] * len(names)
        placed = records_before or (lambda step: step * batch)
        for step, weights in self._steps():
            start = placed(step)
            if pieces:
                drawn = MixtureSource(names, list(sources.values()), pieces, {}, {}).drawn(start)
                before = drawn
            chosen = tuple(i for i, name in enumerate(names) if weights.get(name, 0) > 0)
            parts = proportions([float(weights[names[i]]) for i in chosen])
            pieces.append(_Piece(start, chosen, parts, tuple(before)))
        return MixtureSource(names, list(sources.values()), pieces, self._template(sources), self.fill,
                             remake=lambda counted: self.source(batch, counted))

    def records(self) -> MixtureSource:
        """The mixture as a record source (its schedule counted in batches of 1)."""
        return self.source(1)

    def load(self, *, batch: int, seed: int = 0, workers: int = 0, prefetch: int = 4) -> Dataset:
        """An endless, resumable stream of the mixture in global batches of batch rows (no validation
        split: evaluate each source on its own). Sources that encode text with different tokenizers
        are refused first (text_tokenizer), before any record is read."""
        self.text_tokenizer()
        source = self.source(batch)
        return Dataset(train=StreamReader(source, batch=batch, seed=seed, workers=workers, prefetch=prefetch),
                       val=None, records=None, batch=batch)
