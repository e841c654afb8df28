"""What a run folder says about resuming: where the run started, the lines it prints about its
folder, and the command that continues it.

Kept apart from dew.recipes.folder (which reads run folders through the
recipe schema) so that the run itself, below the schema, can print them, and
so that opening a run (dew.recipes.opening, beside folder) can read its
recipe's relative paths from where it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dew.errors import DewError
from dew.recipes.errors import RecipeError

__all__ = ["STARTED", "StartFolderGoneWarning", "changes_line", "installing_what_it_trained_with", "kept_step_around", "origin",
           "pretrained_origin", "resume_command", "resuming_line", "run_command", "shown", "started_from", "started_in", "step_kept_in_run",
           "the_run_folder", "tracker_folders", "upgrade_line"]

STARTED = "started.json"  # beside run.json: the timestamp and working directory a run started with


class StartFolderGoneWarning(UserWarning):
    """The folder a run was trained from is gone: its recipe's relative paths are read from here."""
_STAMP = r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d"


def shown(path: str | os.PathLike[str]) -> str:
    """path as a person types it here: relative to the working directory when inside it."""
    path = Path(path)
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def resume_command(directory: str | os.PathLike[str]) -> str:
    """The command that continues the run in directory, ready to paste (a folder whose name reads
    as an option is given as ./NAME).

    >>> resume_command("/somewhere/else/runs/tiny lm")
    "dew train --resume '/somewhere/else/runs/tiny lm'"
    >>> resume_command("--foo")
    'dew train --resume ./--foo'
    """
    return run_command("train --resume", directory)


def run_command(command: str, directory: str | os.PathLike[str]) -> str:
    """``dew COMMAND DIRECTORY`` ready to paste, the folder quoted as resume_command quotes it.

    >>> run_command("eval", "runs/tiny lm")
    "dew eval 'runs/tiny lm'"
    """
    where = shown(directory)
    return f"dew {command} {shlex.quote('./' + where if where.startswith('-') else where)}"


def resuming_line(directory: str | os.PathLike[str], resumed_at: int, steps: int, trained_for: int | None) -> str:
    """The one line a run that found its folder's checkpoints prints: it resumes (or is done),
    and how to start fresh instead."""
    where = shown(directory)
    before = "" if trained_for is None or trained_for == steps else \
        f" (its checkpoints trained with trainer.steps={trained_for})"
    fresh = (f"to start fresh instead, train the recipe (not --resume) with trainer.checkpoint_dir set to a "
             f"new folder, or remove {where}")
    if resumed_at >= steps:
        return (f"{where} already holds step {resumed_at}{before}, at or past trainer.steps={steps}: "
                f"nothing to train; to train further, {resume_command(directory)} trainer.steps=N, N the "
                f"step to finish at counted from the run's start (trainer.steps={resumed_at + 100} trains 100 "
                f"more; +100 reads as 100); {fresh}.")
    return f"Resuming {where} at step {resumed_at}{before}, to step {steps}; {fresh}."


def changes_line(before: Mapping[str, object], now: Mapping[str, object], *, cwd: Path) -> str | None:
    """The line a resume prints when its recipe differs from the one the checkpoints trained with
    (a batch size, a learning rate an override changed); None when only trainer.steps did, which
    the resuming line says, or where the run lives (its folders, which a moved run's resume
    rewrites). A path written relative then absolute is the same path.

    >>> changes_line({"data": {"batch": 8}}, {"data": {"batch": 16}}, cwd=Path("/"))
    'The recipe differs from the one its checkpoints trained with: data.batch 8 -> 16.'
    """
    from dew.tracking.rows import locates_the_run, recipe_fields

    old, new = recipe_fields(before), recipe_fields(now)

    def same(a: object, b: object) -> bool:
        if a == b:
            return True
        return (isinstance(a, str) and isinstance(b, str) and "/" in a + b
                and os.path.normpath(cwd / a) == os.path.normpath(cwd / b))

    changed = [k for k in sorted(set(old) | set(new)) if k != "trainer.steps" and not locates_the_run(k)
               and not same(old.get(k, "unset"), new.get(k, "unset"))]
    if not changed:
        return None
    said = ", ".join(f"{k} {old.get(k, 'unset')} -> {new.get(k, 'unset')}" for k in changed[:8])
    more = f" and {len(changed) - 8} more (dew train --check shows the recipe)" if len(changed) > 8 else ""
    return f"The recipe differs from the one its checkpoints trained with: {said}{more}."


def upgrade_line(step: int, meta: Mapping[str, object]) -> str | None:
    """The line a resume prints when another dew wrote its step (the step's meta records which);
    None when this dew did, or the step does not say.

    >>> upgrade_line(4, {"dew": {"dew-core": "0.0.1"}}).startswith("Step 4 was written by dew-core 0.0.1;")
    True
    """
    from dew.versions import described, installed, not_installed, writer

    written = writer(meta)
    if written is None or not not_installed(written):
        return None
    return (f"Step {step} was written by {described(written)}; this is {described(installed())}. The run's run.json "
            "keeps the model as it was trained; a default of the objective or data that changed between "
            "them changes how it goes on (dew diff RUN OTHER compares two runs).")


def origin(run: Path, template: str | None) -> tuple[str | None, Path]:
    """The timestamp and working directory the run in folder run started with."""
    saved = run / STARTED
    if saved.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            data = json.loads(saved.read_text())
            return str(data["timestamp"]), Path(data["cwd"])
    if not template:
        return None, Path.cwd()
    # An older folder: its path is the template expanded, so it gives the timestamp back.
    pattern = re.escape(os.path.normpath(template)).replace(re.escape("{timestamp}"), f"(?P<stamp>{_STAMP})")
    found = re.search(rf"(?:^|/){pattern}$", str(run))
    if found is None:
        return None, Path.cwd()
    stamp = found.groupdict().get("stamp")
    root = Path(str(run)[: found.start()] or "/") if not Path(template).is_absolute() else Path.cwd()
    timestamp = None if stamp is None else stamp[:10] + "_" + stamp[11:].replace("-", ":")
    return timestamp, root


def started_from(run: str | os.PathLike[str]) -> Path:
    """The working directory the run in folder run started in, where its recipe's relative paths
    (a tokenizer file, data files, init.pretrained) start; this one for a folder that is no run."""
    directory = Path(os.path.abspath(Path(run).expanduser()))
    template = None
    if not (directory / STARTED).is_file():  # an older folder: its checkpoint_dir gives the start back
        with contextlib.suppress(OSError, ValueError, AttributeError):
            template = (json.loads((directory / "run.json").read_text()).get("trainer") or {}).get("checkpoint_dir")
    return origin(directory, template)[1]


def pretrained_origin(run: str | os.PathLike[str], init: Mapping[str, Any] | None) -> Path | None:
    """The folder of published weights a run started from (None: none): its recipe's
    init.pretrained, or that of the run its init.run names, followed back run by run (each
    relative path read from where its own run started). init is the run's recipe's init section."""
    folder, seen = Path(os.path.abspath(Path(run).expanduser())), set()
    while isinstance(init, Mapping) and folder not in seen:
        seen.add(folder)
        start = started_from(folder)
        if init.get("pretrained"):
            return start / str(init["pretrained"])
        if not init.get("run"):
            return None
        folder = Path(os.path.abspath(start / str(init["run"])))
        try:
            init = json.loads((folder / "run.json").read_text()).get("init")
        except (OSError, ValueError, AttributeError):  # the run it started from is gone or unreadable
            return None
    return None


def tracker_folders(run: str | os.PathLike[str], recipe: Mapping[str, Any] | None = None) -> list[Path]:
    """The folders the run's local trackers wrote their journals in, as its recipe (run.json, unless
    given) names them: a relative one from where the run started, not from here."""
    directory = Path(run)
    if recipe is None:
        with contextlib.suppress(OSError, ValueError):
            recipe = json.loads((directory / "run.json").read_text())
    trackers = (recipe or {}).get("trackers") if isinstance(recipe, Mapping) else None
    start = started_from(directory)
    return [start / Path(tracker["directory"]).expanduser() for tracker in trackers or []
            if isinstance(tracker, Mapping) and tracker.get("name") == "local"
            and isinstance(tracker.get("directory"), str) and "{" not in tracker["directory"]]


@contextlib.contextmanager
def started_in(run: str | os.PathLike[str]) -> Iterator[None]:
    """Within it, the working directory is started_from(run), so the relative paths of the run's
    recipe name what they named when it trained, wherever the command reading the run is typed."""
    cwd = started_from(run)
    here = Path.cwd()
    if cwd != here and not cwd.exists():
        import warnings

        warnings.warn(StartFolderGoneWarning(
            f"The folder {shown(run)} was trained from, {cwd}, is gone, so the relative paths of its recipe "
            "(data files, a tokenizer) are read from here instead; run the command from a folder that holds "
            "them as they were, or give them as absolute paths."), stacklevel=3)
    if cwd == here or not cwd.is_dir():
        yield
        return
    try:
        os.chdir(cwd)
    except OSError:  # a folder this user may not enter (another's home): paths read from here, as given
        yield
        return
    try:
        yield
    finally:
        os.chdir(here)


@contextlib.contextmanager
def installing_what_it_trained_with(run: Path) -> Iterator[None]:
    """Read a run's recipe inside this block: a refusal because a component it names is no longer
    registered is raised again with a line per such component naming the distribution (and version)
    that registered it when the run started (started.json), and how to install it."""
    try:
        yield
    except RecipeError as error:
        lines = [*_missing_distributions(run), *_another_dew(run)]
        if not lines:
            raise
        raise RecipeError("\n".join([str(error), *lines])) from None  # every command prints the message


def _another_dew(run: Path) -> list[str]:
    """A line saying which dew wrote the run's newest step, when it is not this one (a field it
    records that this dew renamed or does not know is then no mistake of the run's)."""
    from dew.checkpoints.store import Store
    from dew.versions import described, installed, not_installed, writer

    try:
        steps = Store(run, local=False).committed()
        written = writer(json.loads((run / str(steps[-1]) / "dew.json").read_text()).get("meta")) if steps else None
    except (OSError, ValueError, AttributeError, DewError):
        return []
    if written is None or not not_installed(written):
        return []
    pins = " ".join(f"'{name}=={version}'" for name, version in sorted(written.items()))
    return [f"The run's newest step was written by {described(written)}; this is {described(installed())}. "
            f"Read it with the dew that wrote it (pip install {pins}), or resume it with this one "
            "giving key=value overrides for the fields above."]


def _missing_distributions(run: Path) -> list[str]:
    from dew import registry as registries

    try:
        recorded = json.loads((run / STARTED).read_text()).get("components") or {}
    except (OSError, ValueError, AttributeError):
        return []
    from dew.versions import component_versions

    lines = []
    for key, made_by in sorted(recorded.items()) if isinstance(recorded, dict) else ():
        group, _, name = str(key).partition("/")
        if group not in registries.GROUPS:
            continue
        distribution, _, version = str(made_by).partition(" ")
        kind = registries.registry(group).kind
        if name not in registries.registry(group):
            lines.append(f"The run trained with {kind} {name!r} from {distribution} {version}: "
                         f"pip install '{distribution}=={version}' to read it again.")
            continue
        now = component_versions([(group, name)]).get(key)
        if now is not None and now != made_by:  # registered still, by another version (or distribution)
            lines.append(f"The run trained with {kind} {name!r} from {distribution} {version}; installed is {now}: "
                         f"pip install '{distribution}=={version}' to read it as it trained, or give the "
                         "fields the new version takes as key=value overrides.")
    return lines


def step_kept_in_run(folder: Path) -> int | None:
    """The step number when folder is a step kept inside a run (a numbered folder beside the run's
    run.json), else None."""
    return int(folder.name) if folder.name.isdigit() and (folder.parent / "run.json").is_file() else None


def kept_step_around(path: Path) -> Path | None:
    """The step kept in a run that path is, or lies in (its files are checked by their hashes, so no
    command writes among them); None where it is no such step's."""
    return next((folder for folder in (path.absolute(), *path.absolute().parents)
                 if step_kept_in_run(folder) is not None), None)


def the_run_folder(path: str | os.PathLike[str]) -> str:
    """A sentence pointing from a folder that is not a run's to the run's own, or "" when there is none
    to point to: a step kept inside a run names the run (and --step), and a local tracker's folder
    beside the checkpoints names the checkpoint folder its journal records."""
    folder = Path(os.path.abspath(Path(path).expanduser()))
    step = step_kept_in_run(folder)
    if step is not None:
        return (f" {shown(folder)} is step {step} kept inside the run {shown(folder.parent)}: give "
                f"that folder (with --step {step}, where the command takes one, for this step).")
    checkpoints = _checkpoints_of_tracker(folder)
    if checkpoints is not None:
        return (f" {shown(folder)} is where the run's tracker wrote; its checkpoints and run.json are in "
                f"{shown(checkpoints)}: give that folder.")
    return ""


def _checkpoints_of_tracker(folder: Path) -> Path | None:
    """The checkpoint folder a local tracker's journal in folder records (its first run_started
    record's recipe), found from where that run started; None when it names none that holds a run."""
    try:
        with open(folder / "records.jsonl", encoding="utf-8") as handle:
            config = json.loads(handle.readline())["record"]["config"]
        written = str(config["trainer"]["checkpoint_dir"])
        trackers = [str(t["directory"]) for t in config.get("trackers") or [] if t.get("name") == "local"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    for directory in trackers:
        if "{" in directory or "{" in written or "://" in written:
            continue
        suffix = os.path.normpath(directory)
        if Path(suffix).is_absolute():
            start = Path.cwd()
        elif str(folder).endswith("/" + suffix):
            start = Path(str(folder)[: -len(suffix) - 1] or "/")
        else:
            continue
        candidate = Path(os.path.normpath(start / Path(written).expanduser()))
        if candidate != folder and (candidate / "run.json").is_file():
            return candidate
    return None
