"""Where two runs part: their kept states, their logged losses and their recipes, compared.

Every kept step's manifest records a digest of each leaf of the state
(``dew.checkpoints.integrity``), the same whatever the sharding, so two
runs' states are compared step by step without reading an array: the first
kept step at which a leaf's digest differs, and which leaves. Asked to
(``load``), the differing leaves of that step and of the last common step
are read (Orbax partial restores, one step of one run at a time) for their
largest elementwise gap. The logged losses come from the runs' journals
(``scalars.jsonl``), the recipes from their ``run.json``, and the versions
of the distributions that registered their components from ``started.json``.

Two runs whose every common kept step has the same digests and whose losses
are equal are identical through the last of those steps. Runs of different
models are compared on the leaves both hold with the same path and shape.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dew.errors import DewError
from dew.tree_paths import key_name

__all__ = ["LeafGap", "LossGap", "NotARunDirectoryError", "RunDiff", "diff_runs", "gap_width", "load_leaves"]

LOSS = "train/loss"


class NotARunDirectoryError(DewError, FileNotFoundError):
    """A path given as a run holds neither a recipe (run.json) nor a kept step."""


@dataclass(frozen=True)
class LeafGap:
    """The largest elementwise difference of one leaf at one step, and the largest magnitude there."""

    path: str
    step: int
    gap: float
    scale: float

    @property
    def relative(self) -> float:
        return self.gap / self.scale if self.scale else (0.0 if self.gap == 0 else math.inf)


@dataclass(frozen=True)
class LossGap:
    step: int
    a: float
    b: float


@dataclass(frozen=True)
class RunDiff:
    """How two runs compare (see the module docstring); ``verdict`` sums it up."""

    a: str
    b: str
    recipe: tuple[tuple[str, Any, Any], ...]
    models_differ: tuple[str, ...]
    common_steps: tuple[int, ...]
    first_state_step: int | None
    differing: tuple[str, ...]  # the leaves that differ at first_state_step, in the state's order
    incomparable: tuple[str, ...]
    gaps: tuple[LeafGap, ...]
    loss_steps: tuple[int, ...]
    first_loss: LossGap | None  # the first logged loss beyond the tolerance
    largest_loss: LossGap | None
    rtol: float
    atol: float
    notes: tuple[str, ...] = field(default=())
    weights_compared: bool = True  # some parameter leaf is held by both runs in one shape and dtype
    recipes_compared: bool = True  # both runs' run.json were read

    @property
    def bitwise(self) -> bool:
        losses_equal = self.largest_loss is None or _same(self.largest_loss.a, self.largest_loss.b)
        return (self.first_state_step is None and not self.incomparable and losses_equal
                and bool(self.common_steps))

    @property
    def within_tolerance(self) -> bool:
        """Nothing differs beyond the tolerances: states equal or (loaded) close, losses close."""
        if self.first_loss is not None or self.incomparable or not self.common_steps:
            return False
        if self.first_state_step is None:
            return True
        return bool(self.gaps) and all(g.gap <= self.atol + self.rtol * g.scale for g in self.gaps)

    @property
    def uncompared(self) -> bool:
        """No state was compared (no kept step is common to both runs) and no logged loss parts them:
        nothing says whether the runs agree."""
        return not self.common_steps and self.first_loss is None

    @property
    def through(self) -> int:
        return max([*self.common_steps, *self.loss_steps], default=0)


def _same(x: float, y: float) -> bool:
    """Two logged losses are the same number: equal, or both NaN (a diverged run and its rerun).

    >>> _same(float("nan"), float("nan")), _same(1.0, 1.0), _same(float("nan"), 1.0)
    (True, True, False)
    """
    return x == y or (math.isnan(x) and math.isnan(y))


def gap_width(x: float, y: float) -> float:
    """How far apart two logged losses are: 0 when the same, infinite when only one is NaN."""
    if _same(x, y):
        return 0.0
    width = abs(x - y)
    return math.inf if math.isnan(width) else width


def _dotted(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested recipe as dotted keys (lists by index).

    >>> _dotted({"optimizer": {"learning_rate": 0.1}, "trackers": [{"name": "local"}]})
    {'optimizer.learning_rate': 0.1, 'trackers.0.name': 'local'}
    """
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_dotted(item, f"{prefix}{key}."))
        return out
    if isinstance(value, list | tuple) and value:
        out = {}
        for index, item in enumerate(value):
            out.update(_dotted(item, f"{prefix}{index}."))
        return out
    return {prefix[:-1]: value}


def _recipe(run: Path, notes: list[str]) -> dict[str, Any] | None:
    """The run's run.json (None when it has none, or, with a note, when it cannot be read)."""
    path = run / "run.json"
    if not path.is_file():
        return None
    try:
        recipe = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        notes.append(f"{path} cannot be read ({error}); that run's recipe is not compared")
        return None
    if not isinstance(recipe, dict):
        notes.append(f"{path} holds no recipe (a JSON {type(recipe).__name__}); that run's recipe is not compared")
        return None
    return recipe


def _installed(run: Path, notes: list[str]) -> dict[str, Any] | None:
    """The distribution and version that registered each component, as the run recorded them when it
    started (started.json's components; None for a run from before they were recorded, or, with a
    note, when started.json cannot be read)."""
    path = run / "started.json"
    try:
        recorded = json.loads(path.read_text(encoding="utf-8")).get("components")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        notes.append(f"{path} cannot be read ({error}); the versions that registered that run's components "
                     "are not compared")
        return None
    return recorded if isinstance(recorded, dict) else None


def _installed_diff(runs: Sequence[Path], notes: list[str]) -> list[tuple[str, Any, Any]]:
    """The components whose registering distribution or version differs between two runs that
    recorded them (a plugin upgraded between them), as installed.GROUP/NAME rows of the recipe diff."""
    left, right = (_installed(run, notes) for run in runs)
    if left is None or right is None:
        return []
    return [(f"installed.{key}", left.get(key), right.get(key)) for key in sorted(set(left) & set(right))
            if left.get(key) != right.get(key)]


def _kept(run: Path) -> list[int]:
    from dew.checkpoints.store import Store

    return Store(run, local=False).committed()


def _leaves(run: Path, step: int) -> list[Any]:
    from dew.checkpoints.restore import read_manifest

    return list(read_manifest(run / str(step), step).leaves)


def _journal(run: Path, recipe: Mapping[str, Any] | None) -> Path | None:
    """The run's scalars journal: in the run directory, or where its recipe's local tracker wrote
    (a relative directory from where the run started, not from where dew diff runs)."""
    from dew.recipes.resuming import tracker_folders

    if (run / "scalars.jsonl").is_file():
        return run / "scalars.jsonl"
    if recipe is None:
        return None
    return next((folder / "scalars.jsonl" for folder in tracker_folders(run, recipe)
                 if (folder / "scalars.jsonl").is_file()), None)


def _losses(journal: Path | None) -> dict[int, float]:
    """The logged loss at each step, as the run's steps stand (a resume's redone steps once)."""
    from dew.telemetry.render import read_scalars

    steps, values = read_scalars(journal).get(LOSS, ((), ())) if journal is not None else ((), ())
    return {int(step): float(value) for step, value in zip(steps, values, strict=True)}


_TOKEN = re.compile(r"\.(\w+)|\['((?:[^'\\]|\\.)*)'\]|\[(\d+)\]")


def _tokens(keystr: str) -> tuple[str, ...]:
    """A leaf path written by jax.tree_util.keystr, as its keys: .a['b'][0] -> ('a', 'b', '0')."""
    return tuple(next(g for g in match.groups() if g is not None) for match in _TOKEN.finditer(keystr))


def load_leaves(run: Path, step: int, paths: Sequence[str]) -> dict[str, Any]:
    """The arrays of the leaves at paths (manifest names) of a kept step, read alone (Orbax partial restore)."""
    import orbax.checkpoint as ocp

    wanted = {_tokens(p): p for p in paths}
    directory = run / str(step) / "state"
    # The handler, not a Checkpointer: the step's own metadata file sits beside state/, not in it, and a
    # Checkpointer warned for each read that it found none there.
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(directory).tree
        return _read_leaves(handler, directory, tree, wanted)
    finally:
        handler.close()


def _read_leaves(handler: Any, directory: Path, tree: Any, wanted: Mapping[tuple[str, ...], str]) -> dict[str, Any]:
    """The leaves of the saved tree at the wanted paths, read as numpy arrays (the rest left unread)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    def prune(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping):
            kept = {k: prune(v, (*path, str(k))) for k, v in node.items()}
            return {k: v for k, v in kept.items() if v is not None} or None
        if isinstance(node, list | tuple):
            items = [prune(v, (*path, str(i))) for i, v in enumerate(node)]
            return items if any(i is not None for i in items) else None
        if node is None or path not in wanted:
            return None
        return np.empty(tuple(node.shape), np.dtype(node.dtype))

    item = prune(tree, ())
    if item is None:
        return {}
    restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    read = handler.restore(directory, args=ocp.args.PyTreeRestore(item=item, restore_args=restore,
                                                                    partial_restore=True))
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(read)[0]:
        tokens = tuple(key_name(k) for k in path)
        if tokens in wanted:
            out[wanted[tokens]] = np.asarray(leaf)
    return out


def _gaps(a: Path, b: Path, step: int, paths: Sequence[str]) -> list[LeafGap]:
    import numpy as np

    left = load_leaves(a, step, paths)
    right = load_leaves(b, step, paths)
    out = []
    for path in paths:
        if path in left and path in right:
            x, y = left[path].astype(np.float64), right[path].astype(np.float64)
            out.append(LeafGap(path, step, float(np.max(np.abs(x - y))) if x.size else 0.0,
                               float(np.max(np.abs(y))) if y.size else 0.0))
    return out


def diff_runs(a: str | Path, b: str | Path, *, rtol: float = 1e-4, atol: float = 1e-6,
              load: bool = False) -> RunDiff:
    """Compare two run directories (see the module docstring)."""
    runs = [Path(r).expanduser().resolve() for r in (a, b)]
    notes: list[str] = []
    recipes = [_recipe(r, notes) for r in runs]
    kept = [_kept(r) if r.is_dir() else [] for r in runs]
    for run, recipe, steps in zip(runs, recipes, kept, strict=True):
        if recipe is None and not steps:
            held = "an unreadable run.json and no" if (run / "run.json").is_file() else "neither run.json nor a"
            from dew.recipes.resuming import the_run_folder

            raise NotARunDirectoryError(
                f"{run} is not a run directory: it holds {held} kept checkpoint step. Give the "
                f"directory dew train wrote (trainer.checkpoint_dir).{the_run_folder(run)}")
    recipe_diff: list[tuple[str, Any, Any]] = []
    models: tuple[str, ...] = ()
    if all(r is not None for r in recipes):
        left, right = _dotted(recipes[0]), _dotted(recipes[1])
        recipe_diff = [(k, left.get(k), right.get(k)) for k in sorted(set(left) | set(right))
                       if left.get(k) != right.get(k)]
        models = tuple(k for k, _, _ in recipe_diff if k == "model" or k.startswith("model."))
    elif not notes:
        notes.append("one run has no run.json; its recipe is not compared")
    recipe_diff += _installed_diff(runs, notes)
    common = sorted(set(kept[0]) & set(kept[1]))
    first_step, differing, incomparable = None, (), ()
    weights_compared = True
    for step in common:
        mine = {leaf.path: leaf for leaf in _leaves(runs[0], step)}
        theirs = {leaf.path: leaf for leaf in _leaves(runs[1], step)}
        same_shape = [p for p in mine if p in theirs and mine[p].shape == theirs[p].shape
                      and mine[p].dtype == theirs[p].dtype]
        if not incomparable:
            shaped = {p for p in mine if p in theirs} - set(same_shape)
            incomparable = tuple(sorted((set(mine) ^ set(theirs)) | shaped))
            weights_compared = any(p.startswith(".params") for p in same_shape)
        changed = tuple(p for p in same_shape if mine[p].digest != theirs[p].digest)
        if changed:
            first_step, differing = step, changed
            break
    gaps: list[LeafGap] = []
    if load and first_step is not None:
        gaps = _gaps(runs[0], runs[1], first_step, differing)
        last = common[-1]
        if last != first_step:
            mine = {leaf.path: leaf for leaf in _leaves(runs[0], last)}
            theirs = {leaf.path: leaf for leaf in _leaves(runs[1], last)}
            later = [p for p in mine if p in theirs and mine[p].shape == theirs[p].shape
                     and mine[p].digest != theirs[p].digest]
            gaps += _gaps(runs[0], runs[1], last, later)
    journals = [_journal(r, recipe) for r, recipe in zip(runs, recipes, strict=True)]
    for run, journal in zip(runs, journals, strict=True):
        if journal is not None and journal.parent != run:
            notes.append(f"{run}'s losses are read from {journal}, where its recipe's local tracker wrote")
    shared = (journals[0] is not None and journals[1] is not None and runs[0].resolve() != runs[1].resolve()
              and journals[0].resolve() == journals[1].resolve())
    if shared:
        notes.append(f"both runs name one journal, {journals[0]} (a copied run whose recipe still names the "
                     "original's tracker folder?): their losses are not compared")
        journals = [None, None]
    trained = [(recipe.get("objective") or {}).get("name") if isinstance(recipe, dict) else None for recipe in recipes]
    apart = None not in trained and trained[0] != trained[1] and None not in journals
    if apart:
        notes.append(f"the runs train different objectives ({trained[0]} and {trained[1]}): their losses "
                     "measure different things, so they are not compared")
        journals = [None, None]
    losses = [_losses(journal) for journal in journals]
    logged = sorted(set(losses[0]) & set(losses[1]))
    first_loss = largest = None
    for step in logged:
        x, y = losses[0][step], losses[1][step]
        gap = LossGap(step, x, y)
        far = not _same(x, y) and not (abs(x - y) <= atol + rtol * abs(y))
        if far and first_loss is None:
            first_loss = gap
        if largest is None or gap_width(x, y) > gap_width(largest.a, largest.b):
            largest = gap
    if not logged and not shared and not apart:
        notes.append("no logged loss common to both runs (their journals, scalars.jsonl, hold none)")
    if not common:
        notes.append("no kept step common to both runs; their states are not compared")
    return RunDiff(str(runs[0]), str(runs[1]), tuple(recipe_diff), models, tuple(common), first_step,
                   differing, incomparable, tuple(gaps), tuple(logged), first_loss, largest, rtol, atol,
                   tuple(notes), weights_compared, recipes_compared=all(r is not None for r in recipes))
