"""``dew rescore RUN reward=NAME [reward.FIELD=VALUE ...]``: a run's journaled completions, scored again.

A run with a rollout journals what it sampled (``rollouts.jsonl`` in its
checkpoint directory: ``dew.training.rollout_journal``). This command reads
each step's completions, prompts and records back and scores them with
another registered reward, without loading or running the model: whether a
stricter or a differently shaped reward would have ranked the same samples
otherwise. It prints, per step, the mean reward the run trained on beside
the mean of the new one, and with ``--out`` writes the new scores as JSON
lines, one per step's round (``step``, ``round``, the round's mean ``reward``, ``rewards``).

Steps are numbered as the run's scalars and ledger number them (the count of
steps done). Only the steps the run's last checkpoint kept are scored: a
batch sampled ahead for a step the run never took, or journaled by steps
past the last checkpoint, is left out and counted in a note.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.cli.runs import note_if_training
from dew.errors import DewError

if TYPE_CHECKING:
    from dew.training.rollout_journal import Rolled

__all__ = ["RescoreError", "add_arguments", "parse_reward", "rescore", "run"]


class RescoreError(DewError, ValueError):
    """dew rescore was not told which reward to score with, or the reward failed on the journal."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN", type=Path,
                        help="a run's checkpoint directory (it holds rollouts.jsonl)")
    parser.add_argument("overrides", metavar="reward=NAME", nargs="*",
                        help="the registered reward to score with (reward=NAME), and its fields "
                             "(reward.FIELD=VALUE, the value read as YAML)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the new scores here as JSON lines, one per step's round (step, round, "
                             "the mean reward, every completion's rewards); never one of the run's own files")


def parse_reward(items: Sequence[str]) -> dict[str, Any]:
    """``reward=NAME`` and ``reward.FIELD=VALUE`` as ``{"name": NAME, FIELD: VALUE}``, each value
    read as a recipe override's is.

    >>> parse_reward(["reward=exact_match", "reward.key=answer", "reward.strip=false"])
    {'name': 'exact_match', 'key': 'answer', 'strip': False}
    >>> parse_reward(["reward=format", "reward.pattern=[0-9]+"])
    {'name': 'format', 'pattern': '[0-9]+'}
    """
    from dew.recipes.config import override_value

    spec: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not (key == "reward" or key.startswith("reward.")):
            raise RescoreError(f"{item!r} is not reward=NAME or reward.FIELD=VALUE; dew rescore takes "
                               "only the reward to score with, e.g. reward=exact_match reward.key=answer.")
        field = "name" if key == "reward" else key.removeprefix("reward.")
        if field in spec:  # the second would silently replace the first
            raise RescoreError(f"{key} is given twice ({item!r} after {key}={spec[field]!r}); dew rescore "
                               "scores with one reward: give each of its fields once.")
        spec[field] = value if key == "reward" else override_value(value)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RescoreError("Name the reward to score with: dew rescore RUN reward=NAME (dew describe "
                           "lists the registered rewards).")
    return spec


def _context(round_: Mapping[str, Any]) -> dict[str, Any]:
    """What the reward reads besides the completions, as the rollout handed it (arrays per key)."""
    context: dict[str, Any] = {k: np.asarray(v) for k, v in (round_.get("context") or {}).items()}
    context["prompt_text"] = list(round_.get("prompts") or [])
    return context


def rescore(run_dir: str | Path, reward: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every journaled round of the steps run_dir's last checkpoint kept, scored with reward
    (``{"name": ..., **fields}``).

    One row per round: ``step`` (the count of steps done, as the scalars
    number it), ``round``, ``journaled`` (the rewards the run trained on) and
    ``rewards`` (the new ones), in step order.
    """
    from dew.training.rollout_journal import kept_rollouts

    return _scored(kept_rollouts(run_dir, batches=False).entries, reward, run_dir)


def _values(scorer: Any, name: str, completions: list[Any], round_: Mapping[str, Any], step: int) -> np.ndarray:
    """The reward's scores of one round's completions: one finite number each, or an error naming
    which of those it broke."""
    try:
        returned = scorer(completions, _context(round_))
        values = np.asarray(returned)
    except DewError:
        raise
    except Exception as error:  # noqa: BLE001 - the reward's own code: named, not a traceback
        raise RescoreError(f"The reward {name!r} raised {type(error).__name__}: {error} on step {step}'s "
                           "completions; fix the reward, or choose another.") from None
    if isinstance(returned, Mapping | str | bytes) or values.dtype.kind not in "biuf":  # as training refuses
        raise RescoreError(f"The reward {name!r} returned {type(returned).__name__} {returned!r:.80} for step "
                           f"{step}'s completions, which are no numbers (text of a number is not one): a reward "
                           "returns one number per completion.")
    values = values.astype(np.float64)
    if values.shape != (len(completions),):
        raise RescoreError(f"The reward {name!r} returned an array of shape {values.shape} for step {step}'s "
                           f"{len(completions)} completions: a reward returns one number per completion.")
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise RescoreError(f"The reward {name!r} returned {values[bad[0]]} for step {step}'s completion "
                           f"{int(bad[0])} ({completions[int(bad[0])]!r}); {bad.size} of {len(completions)} values "
                           "are not finite. A reward returns a finite number for every completion.")
    return values


def _scored(entries: Sequence[Rolled], reward: Mapping[str, Any], run_dir: str | Path) -> list[dict[str, Any]]:
    from dew import registry
    from dew.recipes.components import problems_of

    fields = {k: v for k, v in reward.items() if k != "name"}
    problems = problems_of("rewards", str(reward["name"]), fields)  # as dew train --check reads objective.reward
    if problems:
        raise RescoreError("; ".join(f"{'.'.join(('reward', *path))}: {message}" for path, message in problems))
    try:
        scorer = registry.rewards.build(str(reward["name"]), **fields)
    except (ValueError, TypeError) as error:  # a field the reward's own checks refuse
        raise RescoreError(f"The reward {reward['name']!r} refused its fields {fields}: {error}") from None
    rows = []
    for entry in entries:
        for index, round_ in enumerate(entry.transcript):
            completions = list(round_.get("completions") or [])
            values = _values(scorer, str(reward["name"]), completions, round_, entry.step + 1)
            rows.append({"step": entry.step + 1, "round": index, "journaled": list(round_.get("rewards") or []),
                         "rewards": values.tolist()})
    if not rows:
        raise RescoreError(f"The journal in {str(run_dir)!r} holds no transcripts to score: its rollout "
                           "kept no text (it is not Transcribed).")
    return rows


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def _checked_out(out: Path, run_dir: Path) -> Path:
    """--out, refused when it is a directory, lies inside a step kept in a run (whose files are
    checked by their hashes), or is an existing file other than an earlier rescore's scores: the
    scores are written over the path given, and a run's files, or a user's, are not dew rescore's to
    replace."""
    from dew.recipes.resuming import kept_step_around

    if out.is_dir():
        raise RescoreError(f"--out {str(out)!r} is a directory; give the file to write the scores to "
                           f"(e.g. {str(out / 'rescored.jsonl')!r}).")
    under = next((parent for parent in out.parents if parent.exists()), None)
    if under is not None and not under.is_dir():  # refused before the scoring, not after its table
        raise RescoreError(f"--out {str(out)!r} lies under {str(under)!r}, which is a file; give a path in a "
                           "directory.")
    step = kept_step_around(out)
    if step is not None:
        raise RescoreError(f"--out {str(out)!r} lies in step {step.name} kept in the run {str(step.parent)!r}, "
                           "among the files dew resumes and exports from; write the scores outside the step.")
    if out.exists() and not _rescored(out):
        if out.resolve().is_relative_to(run_dir.resolve()):
            raise RescoreError(f"--out {str(out)!r} is one of the files of the run {str(run_dir)!r}, which dew "
                               "rescore only reads; write the scores to a new file, or one outside the run.")
        raise RescoreError(f"--out {str(out)!r} holds a file dew rescore did not write, which the scores would "
                           "replace; give a new path, or remove that file first.")
    return out


def _rescored(path: Path) -> bool:
    """Whether path holds scores an earlier dew rescore wrote (its first line is one of their rows)."""
    try:
        with path.open(encoding="utf-8") as handle:
            row = json.loads(handle.readline())
    except (OSError, ValueError):
        return False
    return isinstance(row, dict) and set(row) == _SCORE_KEYS


_SCORE_KEYS = frozenset({"step", "round", "reward", "rewards"})


def _write_scores(out: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """The scores as JSON lines, written beside out and renamed into place: a failure leaves no
    half-written file, and a link planted at out is replaced, never written through."""
    from dew.telemetry.render import write_file

    text = "".join(json.dumps({"step": row["step"], "round": row["round"], "reward": _mean(row["rewards"]) if row["rewards"] else None,
                               "rewards": row["rewards"]}) + "\n" for row in rows)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file(out, text.encode("utf-8"))
    except OSError as error:
        from dew.errors import out_of_space

        fix = ("free space on its disk (or raise the file-size limit, ulimit -f), or give a path on another"
               if out_of_space(error) else "give a path in a directory you can write to")
        raise RescoreError(f"Could not write --out {str(out)!r}: {error.strerror or error}; {fix}.") from None


def run(args: argparse.Namespace) -> int:
    from dew.training.rollout_journal import kept_rollouts

    try:
        spec = parse_reward(args.overrides)
        if args.out is not None:
            _checked_out(args.out, args.run_dir)
        kept = kept_rollouts(args.run_dir, batches=False)
        rows = _scored(kept.entries, spec, args.run_dir)
    except DewError as error:  # one line: what is wrong and what to do
        print(f"dew rescore: {error}", file=sys.stderr)
        return 2
    note_if_training("rescore", args.run_dir)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    name = spec["name"]
    print(f"{'step':>6}  {'completions':>11}  {'journaled':>10}  {name:>10}")
    for step, found in by_step.items():
        old = [v for r in found for v in r["journaled"]]
        new = [v for r in found for v in r["rewards"]]
        print(f"{step:>6}  {len(new):>11}  {_mean(old):>10.4f}  {_mean(new):>10.4f}")
    old = [v for r in rows for v in r["journaled"]]
    new = [v for r in rows for v in r["rewards"]]
    print(f"{'all':>6}  {len(new):>11}  {_mean(old):>10.4f}  {_mean(new):>10.4f}")
    if kept.past:
        print(f"({kept.past} journaled step(s) past the last checkpoint, step {kept.through}, left out: a batch "
              "sampled ahead for a step the run did not take, or steps no checkpoint kept)")
    if args.out is not None:
        try:
            _write_scores(args.out, rows)
        except RescoreError as error:
            print(f"dew rescore: {error}", file=sys.stderr)
            return 2
        print(f"Wrote {args.out}")
    return 0
