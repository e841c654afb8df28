"""The host side of a step, one way: stream -> rollout -> check -> shard.

``Feed.next(state, step)`` takes this process's next batch from the
training stream, runs the rollout on it (if the trainer has one), checks
it against the batches before it and puts it on the mesh. Nothing it calls
calls back: the compiled step only ever sees what comes out of ``next``.

A batch is checked once, here. The first batch fixes the keys, shapes and
dtypes of the run; a batch-size ramp may add one shape per size it names;
anything else (a missing or extra key, another shape or dtype, a batch that
is not a mapping) is refused at the step it arrives, naming the key and
both shapes, before anything compiles for it.

A fit starts the stream before it places the state (``begin``): the
first batch is read on a thread meanwhile (dew.training.opening), and
``open`` continues that stream when the restored position is the one it
began at, or opens afresh.

The position a checkpoint saves is the stream's (``get_state``), with the
rollout's state packed beside it when the rollout has one, so a resumed
run continues both where they stopped. The ledger is told every batch a
step read: the first, and any a refilling rollout drew within the step.

Each batch a rollout that samples and scores (``Transcribed``: GRPO's,
PPO's) makes is written to the rollout journal
(``dew.training.rollout_journal``), kept beside the ledger: a run directory
written by process 0. A run resumed alone (one process) replays the
journaled batches of the steps it had made past its checkpoint instead of
making them again: it reads the stream as the first run did, checks each
batch against the one the line was made from, and puts the rollout's state
back; a batch that differs is sampled again, with a warning.
"""

from __future__ import annotations

import base64
import json
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh

from dew.data.base import (
    Accounted,
    Batch,
    Consumption,
    DataPartition,
    Dataset,
    Reporting,
    Resumable,
    close_if_closable,
)
from dew.errors import DewError
from dew.training.ledger import Ledger, RecordLedger, joined
from dew.training.opening import FirstRead
from dew.training.placement.mesh import BatchMismatchError, global_shape, shard_batch
from dew.training.protocols import Lagging, Refilling, RewardTimed, Rollout, Serving, Transcribed
from dew.training.rollout_ahead import Ahead
from dew.training.rollout_journal import Rolled, RolloutJournal, batch_digest
from dew.training.runtime.whole_batch import from_process_zero, share_of, whole
from dew.training.state import TrainState

__all__ = ["Feed", "Fed", "ReplayMismatchWarning", "RolloutStateError", "StreamEndedError", "pack_position", "unpack_position"]

_ROLLOUT_POSITION = b"dew-rollout-position:"

Signature = tuple[tuple[str, tuple[int, ...], str], ...]


def pack_position(data: bytes | None, rollout: bytes | None) -> bytes | None:
    """One checkpoint position for the stream and the rollout (just the stream's without one).

    >>> unpack_position(pack_position(b"5", b"r"))
    (b'5', b'r')
    >>> pack_position(b"5", None)
    b'5'
    """
    if rollout is None:
        return data
    payload = {
        "data": None if data is None else base64.b64encode(data).decode(),
        "rollout": base64.b64encode(rollout).decode(),
    }
    return _ROLLOUT_POSITION + json.dumps(payload, sort_keys=True).encode()


def unpack_position(position: bytes | None) -> tuple[bytes | None, bytes | None]:
    """The stream's and the rollout's positions from a saved one."""
    if position is None or not position.startswith(_ROLLOUT_POSITION):
        return position, None
    payload = json.loads(position[len(_ROLLOUT_POSITION):])
    data = payload.get("data")
    return (None if data is None else base64.b64decode(data, validate=True),
            base64.b64decode(payload["rollout"], validate=True))


class StreamEndedError(DewError, RuntimeError):
    """The training stream ran out before fit's last step (Dataset.train must be endless)."""


class RolloutStateError(DewError, ValueError):
    """A checkpoint holds a rollout's state, but the trainer's rollout cannot take it back."""


class ReplayMismatchWarning(UserWarning):
    """A resumed run's stream gave a step another batch than the one its journaled rollout was made
    from, or the rollout was made with other objective settings: that step, and every later one, is
    sampled again rather than replayed."""


@dataclass
class FeedClock:
    """Seconds spent waiting for the stream, running the rollout, and in its reward.

    A rollout that keeps a running total of the seconds its reward took
    (``reward_seconds``) has them counted apart from the rest of its time.
    """

    data: float = 0.0
    rollout: float = 0.0
    reward: float = 0.0


@dataclass(frozen=True)
class _Made:
    """One step's batch on the host, with what making it read and cost."""

    batch: Batch
    drawn: list[Consumption]  # the stream batches it read, for the ledger
    scalars: Mapping[str, float]
    before: tuple[bytes | None, bytes | None]  # the stream's and rollout's positions it was made from (ahead)
    data: float = 0.0
    rollout: float = 0.0
    reward: float = 0.0


@dataclass(frozen=True)
class Fed:
    """One batch on the mesh, with the signature the compiled step is keyed by."""

    batch: dict[str, jax.Array]
    signature: Signature
    rows: int
    scalars: Mapping[str, float] = field(default_factory=dict)  # the stream's (Reporting), logged with the step


@dataclass
class Feed:
    """This process's batches, from the stream to the mesh (see the module docstring)."""

    dataset: Dataset
    mesh: Mesh
    partition: DataPartition
    required: Sequence[str] = ()
    rollout: Rollout | None = None
    ramp_sizes: frozenset[int] = frozenset()
    check: Callable[[Batch, int], None] | None = None
    clock: FeedClock = field(default_factory=FeedClock)
    ledger: Ledger | None = None  # told which records each step consumed (dew.training.ledger)
    journal: RolloutJournal | None = None  # each rolled-out batch (default: beside a RecordLedger)
    maker: str | None = None  # the settings its rollouts are made with (a recipe's objective digest)
    replayed: int = 0  # steps whose batch came from the journal rather than the rollout
    lag: int = 0  # how many steps ahead the batches are made (the rollout's max_lag)
    _stream: Iterator[Batch] | None = None
    _step: int = 0  # steps consumed (what the ledger counts)
    _current: int = 0  # the step being fed (for messages)
    _drawn: list[Consumption] = field(default_factory=list)  # batches read since the last step's ledger line
    _draws: int = 0  # stream batches read in all
    _replay: dict[int, Rolled] = field(default_factory=dict)  # journaled steps a resumed run replays
    _ahead: Ahead[_Made] | None = None  # the worker making later steps' batches (a rollout's max_lag > 0)
    _shapes: dict[int, dict[str, jax.ShapeDtypeStruct]] = field(default_factory=dict)
    _last: tuple[tuple[object, ...], Signature, int] | None = None  # the last batch's local shapes, checked
    _first: FirstRead[Batch] | None = None  # the first batch, read on a thread since begin()
    _begun: tuple[bytes | None, bool] | None = None  # the position (and resuming) begin() opened at
    _before: bytes | None = None  # the stream's position before its first batch (begun early)

    def begin(self, position: bytes | None, *, resuming: bool) -> None:
        """Open the stream where position left it and start reading its first batch on a thread
        (dew.training.opening), so its start-up runs while the fit places its state; ``open`` with
        the same position continues this stream, another position closes it and opens afresh."""
        self._close_stream()
        stream = self._stream_at(unpack_position(position)[0], resuming)
        self._stream, self._begun = stream, (position, resuming)
        self._before = stream.get_state() if isinstance(stream, Resumable) else None
        self._first = FirstRead(stream)

    def open(self, position: bytes | None, *, resuming: bool, start: int = 0) -> None:
        """Open the stream (and the rollout's state) where position left them, for step start."""
        data, rollout_state = unpack_position(position)
        if self._first is None or self._begun != (position, resuming):
            self._close_stream()
            self._stream = self._stream_at(data, resuming)
        stream = self._stream
        if rollout_state is not None:
            if not isinstance(self.rollout, Resumable):
                raise RolloutStateError(
                    "The checkpoint holds a rollout state, but this trainer's rollout has no "
                    "set_state; resume with the rollout the run was trained with."
                )
            self.rollout.set_state(rollout_state)
        self._step = start
        if self.journal is None and isinstance(self.rollout, Transcribed) and isinstance(self.ledger, RecordLedger):
            # the run directory, process 0's; a rollout that only checks its batch (DPO's) has
            # nothing it paid for and is not Transcribed
            self.journal = RolloutJournal(self.ledger.path.parent)
        replayable = self.journal.opened(start, self.maker) if self.journal is not None else {}
        # A pool's process 0 keeps the journal, of whole global batches: every process replays them.
        pooled = jax.process_count() > 1 and self.rollout is not None
        self._replay = from_process_zero(replayable) if pooled else replayable
        if not isinstance(stream, Accounted):
            self.ledger = None  # a stream that cannot say which records it read keeps no ledger
        if self.ledger is not None:
            self.ledger.opened(start, data, self.partition)
        if isinstance(self.rollout, Refilling):  # in a pool, it refills from the whole global batch too
            self.rollout.draw_from(self._more if jax.process_count() == 1 else
                                   lambda: whole(self._more(), self.partition))
        self.lag = self.rollout.max_lag if isinstance(self.rollout, Lagging) else 0
        # Two threads launching programs with collectives over several devices may reach them in
        # different orders and deadlock: on a larger mesh the lagged batches are made in the loop.
        threaded = jax.process_count() == 1 and self.mesh.devices.size == 1
        self._ahead = Ahead(self._make, self.lag, threaded=threaded) if self.lag != 0 else None

    def position(self) -> bytes | None:
        """What a checkpoint saves: the stream's position, with the rollout's state if it has one.

        Run ahead, the batches under way are waited for (the journal holds them
        then) and the position saved is the one the next step's batch was made
        from, so a resumed run makes (or replays) the steps the stopped one made ahead.
        """
        made = self._ahead.settle() if self._ahead is not None else []  # the worker is idle after
        data, rollout = made[0][1].before if made else self._positions()
        if self.ledger is not None:
            self.ledger.checkpoint(self._step, data)
        if self.journal is not None:
            self.journal.checkpoint(self._step)
        return pack_position(data, rollout)

    def close(self) -> None:
        if self._ahead is not None:  # before the stream: the worker may be reading it
            self._ahead.close()
        self._close_stream()
        if self.ledger is not None:
            self.ledger.close()

    def _stream_at(self, data: bytes | None, resuming: bool) -> Iterator:
        """The training stream, at data (its start when None)."""
        stream = iter(self.dataset.train(self.partition))
        if data is not None:
            if isinstance(stream, Resumable):
                stream.set_state(data)
            else:
                warnings.warn(
                    "The checkpoint holds a data position but the training iterator has no "
                    "set_state; the stream restarts from its beginning and may replay records.",
                    stacklevel=4,
                )
        elif resuming:
            warnings.warn(
                "Resuming from a checkpoint that holds no data position (the training iterator "
                "had no get_state when it was saved): the stream restarts from its first record, "
                "so records already trained on will be seen again. Give the iterator get_state and "
                "set_state, or use a reader built on dew.data.train_stream.",
                stacklevel=4,
            )
        return stream

    def _close_stream(self) -> None:
        """Close the stream (a first batch under way is waited for a while first)."""
        if self._first is not None:
            self._first.settle()
            self._first = None
        stream, self._stream = self._stream, None
        close_if_closable(stream)

    def next(self, state: TrainState, step: int) -> Fed:
        """The batch of step, rolled out, checked and on the mesh."""
        began = time.perf_counter()
        self._step = step + 1
        if self._ahead is None:  # made here and now, from the policy about to train on it
            key = state.key_for(step, purpose="rollout") if self.rollout is not None else None
            made = self._make(state, step, key)
            self.clock.data += made.data
            self.clock.reward += made.reward
            self.clock.rollout += made.rollout
        else:  # made on the worker, ahead: the wait is what the step lost to it
            made = self._ahead.take(state, step)
            waited = time.perf_counter() - began
            reward = min(made.reward, waited)
            self.clock.reward += reward
            self.clock.rollout += waited - reward
        if self.ledger is not None and made.drawn:  # after the rollout: a refilling one read more of the stream
            self.ledger.consumed(step + 1, joined(made.drawn))
        batch = made.batch
        host = {k: v if isinstance(v, jax.Array) else np.asarray(v) for k, v in batch.items()}
        local = tuple((k, v.shape, v.dtype) for k, v in host.items())
        if self._last is None or self._last[0] != local:  # the step before checked these shapes
            shapes = self._check(host, step)
            self._last = (local, _signature(shapes), _rows(shapes))
        _, signature, rows = self._last
        if self.check is not None:
            self.check(host, step)
        return Fed(shard_batch(host, self.mesh, self.partition), signature, rows, made.scalars)

    def _make(self, state: TrainState, step: int, key: jax.Array | None) -> _Made:
        """Read step's batch from the stream and roll it out (or replay it from the journal)."""
        self._current = step
        before = self._positions() if self._ahead is not None else (None, None)
        drawn = self._drawn = []
        began = time.perf_counter()
        # A rollout serving a sample it holds reads no batch: the stream keeps its records for a step that samples.
        serves = isinstance(self.rollout, Serving) and key is not None and not self.rollout.reads_batch()
        batch: Batch = {} if serves else self._more()
        rolled = time.perf_counter()
        reward = 0.0
        if self.rollout is not None and key is not None:
            # In a pool every process rolls out (or replays) the whole global batch, and keeps its
            # share (dew.training.runtime.whole_batch).
            pooled = jax.process_count() > 1
            batch = whole(batch, self.partition) if pooled and not serves else batch
            replay = self._replayed(step, batch)
            if replay is not None:
                batch = replay
            else:
                rollout, count, source = self.rollout, self._draws, batch
                scored = rollout.reward_seconds if isinstance(rollout, RewardTimed) else 0.0
                batch = rollout(state, batch, key)
                _check_mapping(batch, step, "The rollout")
                reward = rollout.reward_seconds - scored if isinstance(rollout, RewardTimed) else 0.0
                self._journal(step, source, batch, self._draws - count + (0 if serves else 1))
            batch = share_of(batch, self.partition) if pooled else batch
        # Read once the rollout is done, so what the stream reports counts the batches it refilled from.
        scalars: dict[str, float] = dict(self._stream.scalars()) if isinstance(self._stream, Reporting) else {}
        ended = time.perf_counter()
        return _Made(batch, drawn, scalars, before, data=rolled - began, rollout=ended - rolled - reward,
                     reward=reward)

    def _positions(self) -> tuple[bytes | None, bytes | None]:
        """The stream's position and the rollout's state, as they are now."""
        if self._first is not None:  # the first batch is being read on its thread: where it began
            data = self._before
        else:
            data = self._stream.get_state() if isinstance(self._stream, Resumable) else None
        rollout = self.rollout.get_state() if isinstance(self.rollout, Resumable) else None
        return data, rollout

    def _replayed(self, step: int, batch: Batch) -> Batch | None:
        """The journaled batch of step when the stream gave it the batch the line was made from."""
        entry = self._replay.pop(step, None)
        if entry is None:
            return None
        changed = None
        if entry.data != batch_digest(batch):
            changed = ("read another stream batch than its journaled rollout was made from (the data "
                       "or its order changed since that run)")
        elif None not in (entry.maker, self.maker) and entry.maker != self.maker:
            changed = ("has a journaled rollout made with other objective settings (the recipe's "
                       "objective changed since that run)")
        if changed is not None:
            warnings.warn(ReplayMismatchWarning(
                f"Step {step} {changed}: sampling it, and every later step, again."), stacklevel=3)
            self._replay.clear()
            return None
        for _ in range(entry.draws - 1):  # what a refilling rollout read within the step
            self._more()
        if entry.state is not None and isinstance(self.rollout, Resumable):
            self.rollout.set_state(entry.state)
        self.replayed += 1
        return entry.batch

    def _journal(self, step: int, source: Batch, batch: Batch, draws: int) -> None:
        """Write the batch the rollout made for step (with what it read and scored) to the journal."""
        rollout = self.rollout
        transcript: list[dict[str, object]] = (rollout.transcript() if isinstance(rollout, Transcribed)
                                            else [])  # drained either way
        if self.journal is None:
            return
        state = rollout.get_state() if isinstance(rollout, Resumable) else None
        arrays = {k: np.asarray(jax.device_get(v)) for k, v in batch.items()}
        self.journal.write(Rolled(step, arrays, batch_digest(source), draws, state, tuple(transcript)))

    def _more(self) -> Batch:
        """The stream's next batch (a Refilling rollout reads further ones within a step)."""
        try:
            if self._first is not None:  # begun early: what is left of reading it is waited for here
                first, self._first = self._first, None
                batch = first.take()
            else:
                batch = next(self._stream)  # type: ignore[arg-type]
        except StopIteration:
            raise StreamEndedError(
                f"The training stream ended at step {self._current}; Dataset.train must yield batches "
                "endlessly (repeat the data, or lower steps)."
            ) from None
        _check_mapping(batch, self._current, "The training stream")
        self._draws += 1
        if self.ledger is not None:
            self._drawn.append(self._stream.consumption())  # type: ignore[union-attr]
        return batch

    def _check(self, batch: Batch, step: int) -> dict[str, jax.ShapeDtypeStruct]:
        missing = [k for k in self.required if k not in batch]
        if missing:
            raise BatchMismatchError(
                f"The batch of step {step} has no key {', '.join(map(repr, missing))}, which the "
                f"objective reads; the batch holds {sorted(batch)}. In a recipe, the data reader writes the "
                "batch's keys and the objective's settings choose those it reads (its *_key fields, and "
                "options such as a precomputed reference): give the reader a form that writes them, or set "
                "the objective to read what it writes."
            )
        shapes = global_shape(batch, self.partition)
        rows = _rows(shapes)
        expected = self._shapes.get(rows)
        if expected is None and self._shapes and rows not in self.ramp_sizes:
            expected = next(iter(self._shapes.values()))
        if expected is None:
            self._shapes[rows] = shapes
            return shapes
        extra = sorted(set(shapes) - set(expected))
        lacking = sorted(set(expected) - set(shapes))
        if extra or lacking:
            said = []
            if extra:
                said.append(f"has key(s) {', '.join(map(repr, extra))} that the first batch did not")
            if lacking:
                said.append(f"lacks key(s) {', '.join(map(repr, lacking))} that the first batch had")
            raise BatchMismatchError(
                f"The batch of step {step} {' and '.join(said)}; every batch of a run must hold "
                f"the same keys ({sorted(expected)}). Drop or add the key in the reader or rollout."
            )
        for key, want in expected.items():
            got = shapes[key]
            if got.shape != want.shape or got.dtype != want.dtype:
                raise BatchMismatchError(
                    f"At step {step}, batch key {key!r} has shape {tuple(got.shape)} and dtype "
                    f"{got.dtype} (global), but the compiled step expects shape {tuple(want.shape)} "
                    f"and dtype {want.dtype}. Every batch of a run must have the same shapes."
                )
        return shapes


def _check_mapping(batch: object, step: int, source: str) -> None:
    if not isinstance(batch, Mapping):
        raise BatchMismatchError(
            f"{source} gave step {step} a {type(batch).__name__}, not a batch: a batch is a "
            "mapping of arrays keyed by name, like {'text': ids}. Yield a dict."
        )


def _rows(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> int:
    return next((s.shape[0] for s in shapes.values() if s.shape), 0)


def _signature(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> Signature:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in shapes.items()))
