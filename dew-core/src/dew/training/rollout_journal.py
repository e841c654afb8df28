"""The rollout journal: every batch a rollout made, beside the checkpoints, to replay and to read.

A run whose trainer has a rollout (GRPO, PPO, DPO's check) pays for each
step's batch on the host: sampled completions, their rewards, the sampling
policy's log-probabilities. The Feed writes each such batch here as soon
as the rollout returns it, with what the step read to make it:

- ``batch``: the arrays the step trained on (tokens, mask, rewards,
  ``old_logp``, ...), stored bit for bit (``.npz``, base64 in the line);
- ``data``: a digest of the stream's batch the rollout was handed, and
  ``draws``: how many of the stream's batches the step read (a refilling
  rollout reads more than one);
- ``state``: the rollout's own state after the step, for a rollout that
  keeps one (PPO's sample being served);
- ``transcript``: what the rollout scored, as text (``Transcribed``): each
  round's prompts, completions, rewards and the records' other keys.

A run resumed from a checkpoint at step k finds the lines of the steps it
already made past k (the run went on after its last checkpoint) and
replays them: it reads the same stream batches, checks that they are the
ones the line was made from and that the fit making them had the same
settings (``maker``, in the ``open`` line: a digest of the recipe's
objective section), and trains on the journaled batch instead of
sampling it again, so the resumed run is bitwise the uninterrupted one and
pays only for what it had not sampled. ``dew rescore`` scores the
transcripts with another reward, and ``dew report`` shows them.

It is JSON lines in ``rollouts.jsonl`` in the checkpoint directory
(``open`` lines where a fit opened, ``checkpoint`` lines where one saved,
``rollout`` lines), appended and flushed at every step; a line cut short by
a crash is skipped. A step journaled twice (a resumed run sampled it again)
is read as its last line.

>>> import numpy as np
>>> decode_batch(encode_batch({"x": np.arange(3, dtype=np.int8)}))["x"].tolist()
[0, 1, 2]
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dew.errors import DewError
from dew.telemetry.render import TornJournalError, append_lines, cut_torn_tail, journal_rows

__all__ = ["ROLLOUTS", "Kept", "Rolled", "RolloutJournal", "RolloutJournalError", "batch_digest", "decode_batch",
           "encode_batch", "kept_rollouts", "read_journal", "to_plain"]

ROLLOUTS = "rollouts.jsonl"


class RolloutJournalError(DewError, FileNotFoundError):
    """A directory holds no rollout journal, or one this dew cannot read."""


@dataclass(frozen=True)
class Rolled:
    """One step's batch as the rollout made it (see the module docstring)."""

    step: int  # the step that trained on it, counted from 0 (the step's index, not the count done)
    batch: Mapping[str, np.ndarray]
    data: str
    draws: int = 1
    state: bytes | None = None
    transcript: tuple[Mapping[str, Any], ...] = field(default=())  # JSON rounds, read back as written
    maker: str | None = None  # the settings of the fit that made it (its open line's; None: unsaid)


def batch_digest(batch: Mapping[str, ArrayLike]) -> str:
    """A digest of a batch's keys, dtypes, shapes and bytes (what a replayed line is checked against).

    >>> batch_digest({"a": np.zeros(2)}) == batch_digest({"a": np.zeros(2)})
    True
    >>> batch_digest({"a": np.zeros(2)}) == batch_digest({"a": np.zeros(2, np.float32)})
    False
    """
    digest = hashlib.sha256()
    for key in sorted(batch):
        value = np.asarray(batch[key])
        if value.dtype.kind == "O":  # strings and other objects: their text
            value = np.asarray([str(v) for v in value.reshape(-1)], dtype=str).reshape(value.shape)
        digest.update(f"{key}|{value.dtype.str}|{value.shape}|".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()[:32]


def encode_batch(batch: Mapping[str, ArrayLike]) -> str:
    """A batch's arrays as base64 ``.npz`` bytes: every bit kept, dtypes and shapes included."""
    buffer = io.BytesIO()
    np.savez(buffer, **{key: np.asarray(value) for key, value in batch.items()})  # type: ignore[arg-type]
    return base64.b64encode(buffer.getvalue()).decode()


def decode_batch(text: str) -> dict[str, np.ndarray]:
    """The arrays ``encode_batch`` wrote."""
    with np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False) as saved:
        return {key: saved[key] for key in saved.files}


def to_plain(value: object) -> object:
    """value as JSON can hold it: arrays and numpy scalars as lists and numbers, bytes as text."""
    if isinstance(value, np.ndarray):
        return [to_plain(v) for v in value.tolist()] if value.dtype.kind in "OSU" else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value


def _line(entry: Rolled) -> str:
    return json.dumps({
        "kind": "rollout", "step": int(entry.step), "data": entry.data, "draws": int(entry.draws),
        "state": None if entry.state is None else base64.b64encode(entry.state).decode(),
        "transcript": to_plain(list(entry.transcript)), "batch": encode_batch(entry.batch),
    }, sort_keys=True)


def _entry(row: Mapping[str, Any]) -> Rolled:
    state = row.get("state")
    return Rolled(step=int(row["step"]), batch=decode_batch(row["batch"]), data=str(row["data"]),
                  draws=int(row.get("draws", 1)),
                  state=None if state is None else base64.b64decode(state, validate=True),
                  transcript=tuple(row.get("transcript") or ()))


def _rows(path: Path, *, strict: bool = False) -> Iterator[dict[str, Any]]:
    """The journal's lines as rows, skipping a last line a crash cut short (no newline after it).

    A damaged line before the last is skipped too when a fit reopens the journal (that step samples
    again), but refused when strict: a reader of what the run trained on would silently miss it.
    """
    try:
        yield from journal_rows(path, strict=strict)
    except TornJournalError as error:
        raise RolloutJournalError(f"{error} Without it, the step it journaled is left out.") from None


def read_journal(directory: str | Path, *, batches: bool = True) -> list[Rolled]:
    """Every step's last journaled rollout in directory, in step order.

    batches=False leaves the arrays unread (``batch`` is empty): what a
    reader of the transcripts alone needs, without decoding every batch.
    """
    return _read(directory, batches=batches)[0]


def _objective_named(recipe: Path) -> str:
    """" (NAME)" for the objective a run's recipe names, or "" when it cannot be read."""
    try:
        name = json.loads(recipe.read_text(encoding="utf-8"))["objective"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f" ({name})" if isinstance(name, str) else ""


def _read(directory: str | Path, *, batches: bool) -> tuple[list[Rolled], int | None]:
    """read_journal's rollouts, and the step of the journal's last checkpoint line (file order), in
    one pass over the file: its lines carry every batch, so it is read once."""
    from dew.training.config import RUN_FILE

    path = Path(directory) / ROLLOUTS
    if not path.is_file() and (Path(directory) / RUN_FILE).is_file():
        raise RolloutJournalError(
            f"The run in {str(directory)!r} kept no rollout journal ({ROLLOUTS}): only a rollout that "
            f"samples text completions and scores them as it trains (GRPO's, PPO's) journals them, so this "
            f"run's objective{_objective_named(Path(directory) / RUN_FILE)} left nothing to rescore (or its "
            "journal was removed). To score what its model makes now, draw samples with dew generate "
            "(--out keeps them).")
    if not path.is_file():
        raise RolloutJournalError(
            f"{str(directory)!r} holds no {ROLLOUTS}: a run writes its rollout journal in its checkpoint "
            "directory when its trainer has a rollout (GRPO, PPO) and checkpoints in a local directory. "
            "Point at that directory.")
    last: dict[int, dict[str, Any]] = {}
    through = None
    for row in _rows(path, strict=True):
        try:
            if row.get("kind") == "rollout":
                last[int(row["step"])] = row
            elif row.get("kind") == "checkpoint":
                through = int(row["step"])  # the last in file order: the latest fit's latest save
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            raise RolloutJournalError(f"{path} holds a {row.get('kind')} line whose step this dew cannot read "
                                      f"({type(error).__name__}: {error}).") from None
    return _entries(path, last, batches=batches), through


def _entries(path: Path, last: dict[int, dict[str, Any]], *, batches: bool) -> list[Rolled]:
    try:
        if not batches:
            return [Rolled(step=s, batch={}, data=str(r["data"]), draws=int(r.get("draws", 1)),
                           transcript=_transcript(r)) for s, r in sorted(last.items())]
        return [_entry(row) for _, row in sorted(last.items())]
    except (KeyError, TypeError, ValueError, OverflowError, OSError) as error:
        raise RolloutJournalError(f"{path} holds a rollout line this dew cannot read "
                                  f"({type(error).__name__}: {error}).") from None


def _transcript(row: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """A rollout line's transcript: its rounds, each a mapping (a journal is data; another is refused)."""
    rounds = row.get("transcript") or ()
    if not isinstance(rounds, list | tuple) or not all(isinstance(round_, dict) for round_ in rounds):
        raise ValueError(f"its transcript is a {type(rounds).__name__} that is no list of rounds")
    return tuple(rounds)


@dataclass(frozen=True)
class Kept:
    """The journaled rollouts of the steps a run's last checkpoint kept.

    A run samples ahead of its steps (a rollout's max_lag), so its journal
    ends with a batch made for a step it never took; a run that stopped past
    its last checkpoint journaled steps a resume takes again. Neither is what
    the run trained on. ``through`` is the last checkpoint's step (None when
    none was written yet: every line counts), ``past`` how many lines lie
    beyond it.
    """

    entries: tuple[Rolled, ...]
    through: int | None
    past: int


def kept_rollouts(directory: str | Path, *, batches: bool = True) -> Kept:
    """read_journal's rollouts up to the journal's last checkpoint (see Kept)."""
    entries, through = _read(directory, batches=batches)
    if through is None:
        return Kept(tuple(entries), None, 0)
    kept = tuple(entry for entry in entries if entry.step < through)  # step counts from 0
    return Kept(kept, through, len(entries) - len(kept))


class RolloutJournal:
    """The journal as JSON lines appended to ``directory/rollouts.jsonl`` (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / ROLLOUTS

    def _append(self, lines: Sequence[str]) -> None:
        append_lines(self.path, lines)

    def opened(self, step: int, maker: str | None = None) -> dict[int, Rolled]:
        """Note that a fit with settings maker opened at step; return the lines it can replay
        (steps from step on), each with the maker of the fit that wrote it."""
        found: dict[int, Rolled] = {}
        made_by = None
        if self.path.is_file():
            for row in _rows(self.path):
                if row.get("kind") == "open":
                    made_by = row.get("maker")
                elif row.get("kind") == "rollout" and int(row["step"]) >= step:
                    try:
                        found[int(row["step"])] = replace(_entry(row), maker=made_by)
                    except (KeyError, ValueError, OSError):
                        found.pop(int(row["step"]), None)  # unreadable: that step samples again
        cut_torn_tail(self.path)  # a line a crash cut short would swallow the fit's first one
        opening = {"kind": "open", "step": int(step), "time": round(time.time(), 3)}
        self._append([json.dumps(opening if maker is None else {**opening, "maker": maker})])
        return found

    def write(self, entry: Rolled) -> None:
        """Journal one step's rollout, written through at once (it was paid for)."""
        self._append([_line(entry)])

    def checkpoint(self, step: int) -> None:
        """A checkpoint saved the position after step steps."""
        self._append([json.dumps({"kind": "checkpoint", "step": int(step)})])
