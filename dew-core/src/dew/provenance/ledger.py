"""Read a run's data ledger back, and audit what it consumed against an uninterrupted run.

A ledger (``dew.training.ledger``) is appended to by every fit of a run, so
it holds history a resumed run undid: the steps a crashed fit took after
its last checkpoint were trained again from there. Reading replays it:
each ``open`` line drops the steps after the one it opened at, and the
lines that follow take their place. What is left is, for every step of the
run's final state, the global records it consumed.

An audit compares that with what an uninterrupted run consumes: by default
every position of the global order from the first one, once, in order,
under one order throughout (the seed and source size the stream names); or
another run's ledger (``against``), whose steps' record digests must match
too. It counts positions, not just steps, so a skipped batch is reported as
the records it held, and names the first step whose records differ.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dew.errors import DewError
from dew.training.ledger import LEDGER

if TYPE_CHECKING:
    from dew.data.order import RecordOrder

__all__ = [
    "Audit", "ConsumedStep", "LedgerDamagedError", "LedgerEmptyError", "Ledgered", "LedgerMissingError", "Segment",
    "audit", "read_ledger",
]


class LedgerMissingError(DewError, FileNotFoundError):
    """The run directory holds no data ledger (a run trained before dew wrote one, or not a run)."""


class LedgerDamagedError(DewError, ValueError):
    """A line inside the ledger is not one dew wrote: the file was edited or damaged."""


class LedgerEmptyError(DewError, ValueError):
    """The ledger records no step: the run kept none, so there is nothing to prove."""


@dataclass(frozen=True)
class ConsumedStep:
    """One step of the run's final state: the positions [first, end) it read and its records' digest."""

    step: int
    first: int
    end: int
    digest: str


@dataclass(frozen=True)
class Segment:
    """One fit of the run: the step it opened at, its processes and data shares, where it resumed from."""

    step: int
    processes: int
    shares: int
    position: dict[str, Any] | None


@dataclass(frozen=True)
class Ledgered:
    """A run's consumption as its final state saw it, step by step, with the fits that made it."""

    steps: tuple[ConsumedStep, ...]
    segments: tuple[Segment, ...]
    orders: tuple[tuple[int, dict[str, Any]], ...]  # (first step, order) each time the order was named
    undone: int = 0  # step lines a later fit replaced
    uncommitted: int = 0  # step lines past the newest committed checkpoint, left out (a save under way)
    contents: tuple[str, ...] = ()  # the digests of the data's contents its saved positions name, in order
    files: tuple[tuple[str, ...], ...] = ()  # the digests of the files its saved positions name, in order
    layout: Any = None  # how the last saved position says the stream draws its records (a mixture's weights)
    trained: int = 0  # the newest committed step, where known: steps after the last that read data count too

    @property
    def order(self) -> dict[str, Any] | None:
        return self.orders[-1][1] if self.orders else None

    @property
    def last(self) -> int:
        """The step the run's state reached: its newest committed step, not the last step that read
        records (PPO reads a batch once per epochs x minibatches steps)."""
        return max(self.trained, self.steps[-1].step if self.steps else 0)


def read_ledger(run: str | Path) -> Ledgered:
    """The run's ledger, replayed (see the module docstring)."""
    path = Path(run) / LEDGER
    if not Path(run).is_dir():
        raise LedgerMissingError(f"{Path(run)} does not exist or is not a directory; give dew audit the "
                                 "directory dew train wrote (trainer.checkpoint_dir).")
    from dew.training.config import RUN_FILE

    if not path.is_file() and not (Path(run) / RUN_FILE).is_file():
        inside = sorted(str(child) for child in Path(run).iterdir() if (child / RUN_FILE).is_file())
        where = f" Its runs: {', '.join(inside[-3:])}{' (the newest three)' if len(inside) > 3 else ''}." \
            if inside else ""
        from dew.recipes.resuming import the_run_folder

        raise LedgerMissingError(
            f"{Path(run)} is not a run's folder (it holds no {RUN_FILE}): give dew audit the folder dew "
            f"train printed for the run, a recipe's {{timestamp}} folder included.{where}{the_run_folder(run)}")
    if not path.is_file():
        raise LedgerMissingError(
            f"{Path(run)} holds no data ledger ({LEDGER}), and an audit needs one: dew writes it beside the "
            "checkpoints of a run whose training stream reports the records it reads (readers built on "
            "dew.data.train_stream do); runs trained before dew wrote one have none. Resume or retrain the "
            "run with this dew to start one.")
    steps: dict[int, ConsumedStep] = {}
    segments: list[Segment] = []
    orders: list[tuple[int, dict[str, Any]]] = []
    contents: dict[str, None] = {}
    files: dict[tuple[str, ...], None] = {}
    layout = None
    undone = 0
    numbers: dict[int, int] = {}  # the line each step's row stands on
    saved = False  # whether a checkpoint's save was recorded (its commit is the disk's to say)
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines):
                break  # a last line cut short by a crash: everything it described was undone with it
            raise _damaged(path, number, "is not JSON") from None
        if not isinstance(row, dict):
            raise _damaged(path, number, f"is a JSON {type(row).__name__}, not a ledger line")
        try:
            kind = row.get("kind")
            position = row.get("position")
            if isinstance(position, dict):  # what a saved position keeps of the data, for --against
                if isinstance(position.get("content"), str):
                    contents[position["content"]] = None
                if isinstance(position.get("files"), list):
                    files[tuple(map(str, position["files"]))] = None
                if position.get("layout") is not None:
                    layout = position["layout"]
            if kind == "open":
                later = [s for s in steps if s > int(row["step"])]
                undone += len(later)
                for step in later:
                    del steps[step]
                segments.append(Segment(int(row["step"]), int(row["processes"]), int(row["shares"]),
                                        row.get("position")))
            elif kind == "order":
                order = {k: v for k, v in row.items() if k not in ("kind", "step")}
                orders = [(step, named) for step, named in orders if step < int(row["step"])]
                if not orders or orders[-1][1] != order:
                    orders.append((int(row["step"]), order))
            elif kind == "checkpoint":
                saved = True
            elif kind == "step":
                step = int(row["step"])
                if step in steps:
                    undone += 1
                steps[step] = ConsumedStep(step, int(row["first"]), int(row["end"]), str(row["digest"]))
                numbers[step] = number
        except KeyError as missing:
            raise _damaged(path, number, f"has no {missing}") from None
        except (TypeError, ValueError, OverflowError) as error:
            raise _damaged(path, number, f"holds a value that is not a number ({error})") from None
    newest = _newest_committed(Path(run), saved)
    beyond = [s for s in steps if newest is not None and s > newest]
    for step in beyond:  # written as their checkpoint's save began: the run's state holds them once it commits
        del steps[step]
    kept = [steps[s] for s in sorted(steps)]
    for consumed, order in _ordered(kept, orders):
        if not _drawn_by_the_order(consumed, order):
            raise _damaged(path, numbers[consumed.step], f"gives step {consumed.step} a digest other than that "
                           f"of the records dew's global order (seed {order['seed']}, {order['size']} records) "
                           f"puts at its positions [{consumed.first}, {consumed.end})")
    if not steps:
        raise LedgerEmptyError(
            f"{path} records no step: the run kept none (the ledger is written at each checkpoint, and this "
            "run stopped before its first one committed), so there is nothing to audit. Train it to a checkpoint "
            "first.")
    return Ledgered(tuple(kept), tuple(segments), tuple(orders), undone, len(beyond),
                    tuple(contents), tuple(files), layout, newest or 0)


_LARGEST_CHECKED = 1 << 24  # a step reading more records than this (none does) is not recomputed


def _ordered(steps: Sequence[ConsumedStep], orders: Sequence[tuple[int, dict[str, Any]]]
             ) -> Iterator[tuple[ConsumedStep, dict[str, Any]]]:
    """Each step with the order its stream named at it, where that is dew's own global order (a seed and
    a record count: dew.data.order); a third party's stream that names another is not recomputed."""
    for step in steps:
        named = [order for first, order in orders if first <= step.step]
        order = named[-1] if named else None
        if (order is not None and set(order) == {"seed", "size"}
                and all(isinstance(order[k], int) and not isinstance(order[k], bool) for k in order)
                and order["size"] > 0 and 0 <= step.first < step.end <= step.first + _LARGEST_CHECKED):
            yield step, order


def _drawn_by_the_order(step: ConsumedStep, order: dict[str, Any]) -> bool:
    """Whether the step's digest is that of the records the order puts at its positions: a ledger's line
    edited by hand, or an order's seed changed, names other records than the run read."""
    import numpy as np

    from dew.training.ledger import records_digest

    records = _orders(order["size"], order["seed"])(np.arange(step.first, step.end, dtype=np.int64))
    return records_digest(records) == step.digest


@functools.lru_cache(maxsize=2)  # an order keeps up to two epochs' tables (64 MB at 4M records)
def _orders(size: int, seed: int) -> RecordOrder:
    from dew.data.order import RecordOrder

    return RecordOrder(size, seed)


def _layouts_part(mine: Any, theirs: Any, reached: int) -> int | None:
    """The record from which two saved layouts draw their first reached records otherwise, or None
    where they agree. A mixture's agree over the schedule pieces begun before reached, which both
    runs read: a piece one run began and the other never had parts them at its start, though the
    other drew past it; other sources part them from record 0. Another layout agrees when it is
    equal. A run that saved none is not compared."""
    if mine is None or theirs is None:
        return None
    if isinstance(mine, dict) and isinstance(theirs, dict) and {"sources", "weights"} <= set(mine) & set(theirs):
        if mine["sources"] != theirs["sources"]:
            return 0
        ours, other = ([p for p in layout["weights"] if int(p[0]) < reached] for layout in (mine, theirs))
        differing = [int(a[0]) for a, b in zip(ours, other, strict=False) if a != b]
        differing += [int(p[0]) for p in (ours[len(other):] + other[len(ours):])]
        return min(differing, default=None)
    return None if mine == theirs else 0


def _listed(digests: tuple[tuple[str, ...], ...]) -> str:
    return "; ".join(", ".join(group) for group in digests)


def _newest_committed(run: Path, saved: bool) -> int | None:
    """The run's newest committed step: 0 when the ledger records a save and none committed (a run killed
    during its first); None when it is not known (a ledger that records no save, or a run that also keeps
    local steps, whose newest state may be one of those)."""
    from dew.checkpoints.store import Store
    from dew.training.config import RUN_FILE

    try:
        recorded = json.loads((run / RUN_FILE).read_text())
        if (recorded.get("trainer") or {}).get("local_checkpoint_dir"):
            return None
    except (OSError, ValueError, AttributeError):
        pass
    kept = Store(run, local=False).committed()
    return kept[-1] if kept else 0 if saved else None


def _damaged(path: Path, number: int, what: str) -> LedgerDamagedError:
    return LedgerDamagedError(
        f"Line {number} of {path} {what}: the ledger was edited or damaged, so what the run consumed "
        "cannot be proven from it. Restore the file from a copy, or retrain the run to write a new one.")


@dataclass(frozen=True)
class Audit:
    """What a run consumed against what it should have: counts of records and the first step that differs."""

    steps: int
    compared: int
    records: int
    expected: int
    skipped: int
    repeated: int
    extra: int
    first_difference: int | None
    missing_steps: tuple[int, ...]
    against: str
    notes: tuple[str, ...] = field(default=())
    unledgered: int = 0  # steps 1 to this one have no ledger line: trained before the ledger was kept

    @property
    def exact(self) -> bool:
        return self.agrees and not self.unledgered

    @property
    def agrees(self) -> bool:
        """Whether every ledgered step agrees with the reference (steps without lines aside)."""
        return (self.first_difference is None and not self.skipped and not self.repeated and not self.extra
                and not self.missing_steps)


def _ideal(ledger: Ledgered) -> list[ConsumedStep]:
    """An uninterrupted run of the same batch sizes: every position from the first, once, in order."""
    position = ledger.segments[0].position if ledger.segments else None
    records = position.get("records") if isinstance(position, dict) else 0
    start = records if isinstance(records, int) and not isinstance(records, bool) else 0
    out, at = [], start
    for step in ledger.steps:
        size = step.end - step.first
        out.append(ConsumedStep(step.step, at, at + size, ""))
        at += size
    return out


def _unlined(steps: Sequence[ConsumedStep]) -> tuple[int, ...]:
    """The steps between two ledger lines that have none where the records between those lines' positions
    were read by no line: a line removed, or a write of the ledger refused. (A PPO run reads a batch every
    few steps, so steps without a line whose positions leave no hole are its own.)"""
    return tuple(step for before, after in zip(steps, steps[1:], strict=False) if after.first > before.end
                 for step in range(before.step + 1, after.step))


def _coverage(steps: Sequence[ConsumedStep]) -> list[tuple[int, int]]:
    return [(s.first, s.end) for s in steps]


def _compare_positions(mine: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> tuple[int, int, int]:
    """(skipped, repeated, extra) positions: theirs read more often than mine; mine more than once beyond
    theirs; mine that theirs never read. A sweep over the intervals' ends."""
    events: dict[int, list[int]] = {}
    for which, spans in ((0, mine), (1, theirs)):
        for first, end in spans:
            events.setdefault(first, [0, 0])[which] += 1
            events.setdefault(end, [0, 0])[which] -= 1
    skipped = repeated = extra = 0
    a = b = 0
    points = sorted(events)
    for here, there in zip(points, points[1:], strict=False):
        a += events[here][0]
        b += events[here][1]
        width = there - here
        skipped += width * max(0, b - a)
        if b == 0:
            extra += width * min(a, 1)
            repeated += width * max(0, a - 1)
        else:
            repeated += width * max(0, a - b)
    return skipped, repeated, extra


def audit(ledger: Ledgered, against: Ledgered | None = None, *, name: str = "RUN_B") -> Audit:
    """Compare the run's consumption with an uninterrupted run (or with against's), step by step."""
    notes = []
    mine = list(ledger.steps)
    changed = None
    if against is None:
        theirs = _ideal(ledger)
        described = "an uninterrupted run (every position of the global order from the first, once)"
        if len(ledger.orders) > 1:
            changed = ledger.orders[1][0]
            notes.append(f"the order changed at step {changed} (from {ledger.orders[0][1]} to "
                         f"{ledger.orders[1][1]}): the same positions hold other records from there")
    else:
        theirs = list(against.steps)
        described = name
        if ledger.order and against.order and ledger.order != against.order:
            notes.append(f"the runs read different orders ({ledger.order} and {against.order}): the same "
                         "positions hold different records")
        if ledger.contents and against.contents and ledger.contents != against.contents:
            changed = min(s.step for s in mine)  # the ids agree, the records they name do not
            notes.append(f"the runs read different data (its contents' digests: {', '.join(ledger.contents)} "
                         f"here, {', '.join(against.contents)} in {name}): the same positions hold other records")
        elif ledger.files and against.files and ledger.files != against.files:
            changed = min(s.step for s in mine)  # as many records, of other text (a file edited in place)
            notes.append(f"the runs read files of other bytes (their digests: {_listed(ledger.files)} here, "
                         f"{_listed(against.files)} in {name}): the same positions hold other text")
        reached = min(ledger.steps[-1].end, against.steps[-1].end) if ledger.steps and against.steps else 0
        parting = _layouts_part(ledger.layout, against.layout, reached)
        if parting is not None:  # the first step drawing a record past the parting
            changed = next((s.step for s in mine if s.end > parting), min(s.step for s in mine))
            notes.append(f"the runs draw their records otherwise ({json.dumps(ledger.layout)} here, "
                         f"{json.dumps(against.layout)} in {name}): the same positions hold records of other sources")
    by_step = {s.step: s for s in theirs}
    compared = [s for s in mine if s.step in by_step]
    first = None
    for step in compared:
        other = by_step[step.step]
        same_records = not other.digest or step.digest == other.digest
        if (step.first, step.end) != (other.first, other.end) or not same_records:
            first = step.step
            break
    last = ledger.last if against is None else min(ledger.last, against.last)
    seen = {m.step for m in mine}  # built once: a run's steps number in the millions
    if against is None:  # the reference is built from the ledger's own steps: a step lacking a line lacks there
        missing = _unlined(mine)
    else:
        missing = tuple(sorted(s for s in by_step if 1 <= s <= last and s not in seen))  # by the steps, not to last
    within = [s for s in mine if s.step <= last]
    reference = [s for s in theirs if s.step <= last]
    skipped, repeated, extra = _compare_positions(_coverage(within), _coverage(reference))
    first = min((s for s in (first, changed, *missing[:1]) if s is not None), default=None)
    if ledger.uncommitted:
        notes.append(f"{ledger.uncommitted} step(s) after step {ledger.last} are in the ledger but in no committed "
                     "checkpoint (a save under way, or a run stopped during one): left out, as a resume trains "
                     "them again")
    if against is not None and ledger.last != against.last:
        notes.append(f"the runs reached different steps ({ledger.last} and {against.last}); compared through "
                     f"step {last}")
    # Against an uninterrupted run, the steps before the first ledger line are not compared at all:
    # a ledger that begins at a resume (one removed, or a run older than the ledger) cannot vouch for them.
    unledgered = mine[0].step - 1 if against is None and mine else 0
    return Audit(steps=ledger.last, compared=last, records=sum(s.end - s.first for s in within),
                 expected=sum(s.end - s.first for s in reference), skipped=skipped, repeated=repeated,
                 extra=extra, first_difference=first, missing_steps=missing, against=described,
                 notes=tuple(notes), unledgered=unledgered)
