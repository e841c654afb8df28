"""A run is one folder: where a recipe trains, how it is resumed by name, and what a run that
never started leaves behind (nothing).

A recipe's ``trainer.checkpoint_dir`` names the run's folder; ``run.json``
there is the recipe as written, placeholders included, and the shipped
recipes journal into the same folder. A folder named after ``{timestamp}``
is a new one at every ``dew train RECIPE``, so that command cannot resume
it; ``dew train --resume RUN`` does: it reads ``RUN/run.json`` back, forces
the checkpoints into RUN, and expands every ``{timestamp}`` as the first
run did, in the working directory it started in, so the checkpoints and
the journal continue together. ``started.json`` beside run.json records
that timestamp and directory (a run folder from before it existed gives
them up by matching its path against the recipe's ``checkpoint_dir``).

A run that fails before it kept anything (a missing teacher, a base run
that is not there, a mesh that does not fit) removes the folders it
created, so no empty run folder is left for every later command to trip
over; one that kept a checkpoint or logged a step keeps its folder, and its
error says how to resume it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from dew.errors import raised_from
from dew.recipes.errors import RecipeError
from dew.recipes.named_paths import absolute_in as _absolute
from dew.recipes.named_paths import fields_naming
from dew.recipes.resuming import (
    STARTED,
    installing_what_it_trained_with,
    origin,
    resume_command,
    run_command,
    shown,
    step_kept_in_run,
)

if TYPE_CHECKING:
    from dew.recipes.config import RunConfig
    from dew.training.runtime.preemption import Preempted, UnsavedStopError
    from dew.training.state import TrainState

__all__ = [
    "STARTED",
    "ExportedModelFolderError",
    "NestedRunFolderError",
    "NotARunFolderError",
    "RunFolder",
    "SharedTrackerFolderWarning",
    "check_in",
    "resumed",
    "stopped_line",
    "train_in",
]


class SharedTrackerFolderWarning(UserWarning):
    """A copied run resumes with a tracker folder outside its own that the original run writes to."""


# What a run writes into its folder before its first step: nothing worth keeping on its own.
_BOOKKEEPING = frozenset({"run.json", STARTED, "records.jsonl", "ledger.jsonl", ".dew-writer.json"})


class NotARunFolderError(RecipeError):
    """``dew train --resume RUN`` was given a path that holds no run.json a run wrote."""


class ExportedModelFolderError(RecipeError):
    """trainer.checkpoint_dir names a folder that holds an exported model rather than a run."""


class NestedRunFolderError(RecipeError):
    """trainer.checkpoint_dir names a numbered folder inside another run, where that run keeps its steps."""


_FRESH_TRIES = 5  # seconds a fresh run waits for a timestamp whose folder no run has taken


@dataclass(frozen=True)
class RunFolder:
    """Where a run lives: its folder (None without checkpoints), its timestamp, the working
    directory its recipe's relative paths start from, and whether it is resumed by name."""

    directory: Path | None
    timestamp: str | None
    cwd: Path
    resumed: bool = False

    def entered(self, out: TextIO | None = None) -> contextlib.AbstractContextManager[None]:
        """Where the recipe's relative paths start: a resumed run's own working directory (entered
        for the length of the block, said on out, stdout by default), else the current one."""
        return _inside(self.cwd, out or sys.stdout) if self.resumed else contextlib.nullcontext()

    @classmethod
    def new(cls, config: RunConfig) -> RunFolder:
        """The folder a fresh ``dew train RECIPE`` trains into, its timestamp taken now.

        A rank of a process pool joins its pool first, so that every rank takes
        process 0's clock and names the same folder. A folder named by the
        timestamp that an earlier run already took (one started in the same
        second) is passed over for the next second's.
        """
        from dew.training.runtime.process import run_timestamp

        if config.trainer.multi_host:
            from dew.recipes.run import join_pool

            join_pool(config)
        stamp = run_timestamp()
        if "{timestamp}" in (config.trainer.checkpoint_dir or "") and not config.trainer.multi_host:
            for _ in range(_FRESH_TRIES):  # a run started in the same second as the last: its own folder
                taken = _directory(config, stamp, Path.cwd())
                if taken is None or not taken.exists():
                    break
                time.sleep(1.0 - time.time() % 1.0 + 0.01)
                stamp = run_timestamp()
        return cls(_directory(config, stamp, Path.cwd()), stamp, Path.cwd())

    def directories(self, config: RunConfig) -> list[Path]:
        """Every folder the run writes: its checkpoints, and each tracker's directory."""
        found = [] if self.directory is None else [self.directory]
        for tracker in config.trackers:
            where = tracker.fields.get("directory")
            if isinstance(where, str) and "://" not in where and self.timestamp is not None:
                found.append(_absolute(_expand(where, self.timestamp), self.cwd))
        return list(dict.fromkeys(found))

    def record(self, config: RunConfig) -> None:
        """Write started.json into the folder (made here) before the run's first step: the timestamp
        and working directory, and the distribution (with its version) registering each component
        the recipe names, so a reader of the run after a plugin was uninstalled is told what to
        install. Written first, it survives a kill -9 at any step; the first writer's timestamp and
        folder stay. A resume with a component from another version of its distribution says so
        and records the version that trains from here."""
        if self.directory is None or self.timestamp is None:
            return
        from dew.versions import component_versions

        target = self.directory / STARTED
        components = component_versions(named_components(config))
        if target.exists():
            _record_upgrades(target, components)
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with target.open("x") as out:
                out.write(json.dumps({"timestamp": self.timestamp, "cwd": str(self.cwd),
                                      "components": components}) + "\n")
        except FileExistsError:
            return  # another process started the folder first; its record stands
        except OSError:
            return  # a folder that cannot be written: the run's checkpoints say so, by field


def _record_upgrades(target: Path, components: dict[str, str]) -> None:
    """Say which of a resumed run's components now come from another version than the one that
    trained it, and record the new ones in started.json (written whole, then swapped in)."""
    from dew import registry as registries

    try:
        started = json.loads(target.read_text())
        recorded = started.get("components") or {}
    except (OSError, ValueError, AttributeError):
        return
    changed = {key: made for key, made in components.items() if key in recorded and recorded[key] != made}
    if not changed:
        return
    for key, made in sorted(changed.items()):
        group, _, name = key.partition("/")
        print(f"The run trained with {registries.registry(group).kind} {name!r} from {recorded[key]}; it goes "
              f"on with {made}.", flush=True)
    from dew.telemetry.render import write_file

    started["components"] = {**recorded, **changed}
    with contextlib.suppress(OSError):  # a folder that cannot be written: the run's checkpoints say so
        write_file(target, (json.dumps(started) + "\n").encode())


def named_components(config: RunConfig) -> list[tuple[str, object]]:
    """Every (registry group, name) the recipe names: its model, objective (and the reward,
    environment or teacher given inside it), data reader, trackers and evaluation tasks."""
    named: list[tuple[str, object]] = [("objectives", config.objective.name), ("datasets", config.data.name)]
    if config.model is not None:
        named.append(("models", config.model.name))
    for key, group in (("reward", "rewards"), ("environment", "environments"), ("teacher", "models")):
        inner = config.objective.fields.get(key)
        named.append((group, inner.get("name") if isinstance(inner, dict) else inner))
    named += [("trackers", tracker.name) for tracker in config.trackers]
    named += [("evaluations", entry.task) for entry in config.trainer.evaluate]
    return named


def _expand(value: str, timestamp: str) -> str:
    from dew.recipes.run import expand

    return str(expand(value, timestamp))


def _directory(config: RunConfig, timestamp: str, cwd: Path) -> Path | None:
    where = config.trainer.checkpoint_dir
    if where is None or "://" in where:
        return None  # no folder, or a bucket: nothing here to resume by name
    return _absolute(_expand(where, timestamp), cwd)


# -- resuming by name -------------------------------------------------------------------------


def _redacted(data: object, prefix: str = "") -> list[str]:
    from dew.telemetry.redaction import is_redacted

    if isinstance(data, dict):
        return [p for key, value in data.items() for p in _redacted(value, f"{prefix}{key}.")]
    if isinstance(data, list):
        return [p for index, value in enumerate(data) for p in _redacted(value, f"{prefix}{index}.")]
    return [prefix[:-1]] if isinstance(data, str) and is_redacted(data) else []


def resumed(run: str | os.PathLike[str], overrides: Sequence[str] = ()) -> tuple[RunConfig, RunFolder]:
    """The recipe of the run in folder run (its run.json, with overrides) and the folder to
    continue: its checkpoints stay in run, its placeholders expand as they first did."""
    from dew.recipes.config import RUN_FILE, RunConfig, apply_overrides

    directory = Path(os.path.abspath(Path(run).expanduser()))
    saved = directory / RUN_FILE
    if not saved.is_file():
        what = "does not exist" if not directory.exists() else f"holds no {RUN_FILE}"
        raise NotARunFolderError(
            f"{shown(directory)} {what}, so there is no run to resume: --resume takes the folder "
            f"`dew train` printed (it holds {RUN_FILE}); to start a run, give its recipe instead "
            "(dew train RECIPE).")
    try:
        data = json.loads(saved.read_text())
    except (OSError, ValueError) as error:
        raise NotARunFolderError(f"{shown(saved)} cannot be read as a run's recipe ({error}).") from None
    trainer = (data.get("trainer") or {}) if isinstance(data, dict) else {}
    template = trainer.get("checkpoint_dir")
    timestamp, cwd = origin(directory, template)
    given = {override.split("=", 1)[0].strip() for override in overrides}
    _refuse_another_folder(overrides, timestamp, cwd, directory)
    followed = _followed(data, template, timestamp, cwd, directory, given)
    # A pool's run records the trainer.multi_host=true dew launch gave its ranks; --resume is one
    # process (a pool resumes with dew launch), which would look for a pool to join and fail.
    alone = ["trainer.multi_host=false"] if trainer.get("multi_host") else []
    # The run resumes inside the folder it started in, where its recipe's checkpoint_dir names it
    # again; moved, or given another on the command line, the folder is named as it is now. (It
    # was named so always, and run.json then held this machine's absolute path for the recipe's.)
    here = [] if _in_place(template, timestamp, cwd, directory) and "trainer.checkpoint_dir" not in given \
        else [f"trainer.checkpoint_dir={directory}"]
    data = apply_overrides(data, [*alone, *followed, *overrides, *here])
    hidden = _redacted(data)
    if hidden:
        raise RecipeError(
            f"{shown(saved)} holds redacted secrets ({', '.join(hidden)}), which a run never writes "
            f"down; give them again: {resume_command(directory)} "
            + " ".join(f"{key}=..." for key in hidden))
    with installing_what_it_trained_with(directory):
        config = RunConfig.parse(data, str(saved))
    return config, RunFolder(directory, timestamp, cwd, resumed=True)


def _refuse_another_folder(overrides: Sequence[str], timestamp: str | None, cwd: Path, directory: Path) -> None:
    """A resume continues in its own folder: a trainer.checkpoint_dir naming another is refused,
    not dropped."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.strip() != "trainer.checkpoint_dir":
            continue
        named = _absolute(_expand(value.strip(), timestamp or ""), cwd) if value.strip() else None
        if named is None or not _same_folder(named, directory):
            raise RecipeError(
                f"--resume {shown(directory)} continues the run in its own folder, so "
                f"trainer.checkpoint_dir={value.strip()} cannot move it; leave the override out, or start a "
                f"new run from its recipe in another folder (dew train RECIPE trainer.checkpoint_dir=NEW, "
                f"with init.run={shown(directory)} to start from its weights).")


def _in_place(template: object, timestamp: str | None, cwd: Path, directory: Path) -> bool:
    """Whether the run's checkpoint_dir, expanded as it started (timestamp, cwd), names directory."""
    if not isinstance(template, str) or "://" in template or (timestamp is None and "{timestamp}" in template):
        return False
    started = _absolute(_expand(template, timestamp or ""), cwd)
    return _same_folder(started, directory)


def _same_folder(path: Path, directory: Path) -> bool:
    """Whether path names directory, by its name or as the same folder on disk (a link to it)."""
    return path == directory or (path.is_dir() and os.path.samefile(path, directory))


def _followed(data: object, template: object, timestamp: str | None, cwd: Path, directory: Path,
              given: set[str]) -> list[str]:
    """Overrides that keep each tracker writing inside the run's folder where the folder is now
    (given: the keys the command line sets, which need no word).

    A folder moved or copied since the run started still names its old path in its trackers'
    directories: resumed, its scalars went back there (into the original's journal, for a copy)
    while its checkpoints stayed here. A tracker directory inside the folder the run started in
    follows the folder; one elsewhere stays where the recipe put it.
    """
    if not isinstance(data, dict) or not isinstance(template, str) or "://" in template:
        return []
    if timestamp is None and "{timestamp}" in template:
        # Where the run started is unknown (a folder moved before it recorded its start): a
        # tracker whose directory is written as the checkpoints' (or inside it) still follows.
        return [f"trackers.{index}.directory={directory / where[len(template):].lstrip('/')}"
                for index, tracker in enumerate(data.get("trackers") or [])
                if isinstance(tracker, dict) and isinstance(where := tracker.get("directory"), str)
                and (where == template or where.startswith(template.rstrip("/") + "/"))]
    if _in_place(template, timestamp, cwd, directory):
        return []  # where it started, spelt the same or through a link
    started = _absolute(_expand(template, timestamp or ""), cwd)
    out = []
    for index, tracker in enumerate(data.get("trackers") or []):
        where = tracker.get("directory") if isinstance(tracker, dict) else None
        if not isinstance(where, str) or "://" in where:
            continue
        path = _absolute(_expand(where, timestamp or ""), cwd)
        beside = _beside(path, started, directory)
        if path == started or started in path.parents:
            out.append(f"trackers.{index}.directory={directory / path.relative_to(started)}")
        elif beside is not None and beside.is_dir():  # moved or copied with the folder it sits beside
            out.append(f"trackers.{index}.directory={beside}")
        elif (started / "run.json").is_file() and f"trackers.{index}.directory" not in given:
            warnings.warn(SharedTrackerFolderWarning(
                f"This run is a copy of {shown(started)}, and its trackers.{index}.directory ({shown(path)}) is "
                f"the original's, so its scalars join the original's there. To keep them apart, resume with "
                f"trackers.{index}.directory=DIR."), stacklevel=2)
    return out


def _beside(path: Path, started: Path, directory: Path) -> Path | None:
    """Where path (outside the folder the run started in) sits now, when the folder moved with the
    folder they share below the filesystem's root: ``exp/ckpt`` and ``exp/logs`` copied to ``b/ckpt``
    give ``b/logs``. None when the run's folder did not keep its place under that shared folder."""
    shared = Path(os.path.commonpath([path, started]))
    tail = started.relative_to(shared).parts
    if shared == Path(shared.anchor) or directory.parts[-len(tail):] != tail:
        return None
    return Path(*directory.parts[: -len(tail)]) / path.relative_to(shared)


# -- training in a folder -----------------------------------------------------------------------


@contextlib.contextmanager
def _inside(cwd: Path, out: TextIO) -> Iterator[None]:
    here = Path.cwd()
    if cwd != here and not cwd.exists():  # a run copied from another machine, or its project moved
        print(f"The folder the run started in, {cwd}, is gone: its recipe's relative paths (data files, a "
              f"tokenizer, task files) are read from here, {here}, instead; where they are elsewhere, give "
              "them as overrides with absolute paths (data.files=/path/...).", file=out, flush=True)
    if cwd == here or not cwd.is_dir():
        yield
        return
    print(f"Resuming in {cwd}, where the run started (its recipe's relative paths, and those of "
          "overrides given now, start there).", file=out, flush=True)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(here)


def _holds_only(directory: Path, name: str) -> bool:
    return [p.name for p in directory.rglob("*")] in ([], [name])


def _kept_nothing(directory: Path) -> bool:
    """Whether directory holds only what a run writes before its first step."""
    for path in directory.rglob("*"):
        if path.is_dir():
            continue
        if path.name not in _BOOKKEEPING or path.parent != directory:
            return False
    return True


def train_in(config: RunConfig, folder: RunFolder) -> TrainState:
    """Train config in folder; return the final TrainState.

    Folders the run created are removed when it fails before keeping
    anything; otherwise its error carries the command that resumes it. A
    stop on request (Preempted) passes through, for the caller to say how
    to resume.
    """
    from dew.training.runtime.preemption import Preempted

    _refuse_exported(folder.directory)
    created = {d: _first_missing(d) for d in folder.directories(config) if not d.exists()}
    try:
        folder.record(config)
        with folder.entered():
            return config.train(timestamp=folder.timestamp)
    except Preempted:
        raise
    except BaseException as error:
        from dew.checkpoints.errors import CheckpointLeaseHeldError

        if raised_from(error, CheckpointLeaseHeldError):
            # Refused because another process writes the folder (both started at once): the
            # folders are that process's, which trains on in them; this one leaves them alone.
            raise
        removed = [d for d in created if d.is_dir() and _kept_nothing(d)]
        # started.json alone (written before the first step) is not something the run wrote
        started_only = all(_holds_only(d, STARTED) for d in removed)
        for directory in removed:
            shutil.rmtree(directory, ignore_errors=True)
            _remove_empty_parents(directory, created[directory])
        if isinstance(error, Exception):
            _trace_to_fields(config, error, folder)
            # A run whose folder was there before (a resume) kept what it had: only a fresh run's
            # folders hold nothing once their first writes are undone.
            fresh = folder.directory is None or folder.directory in created
            if removed and not started_only and fresh:
                error.add_note(f"Nothing was kept: the run failed before its first checkpoint or log "
                               f"({', '.join(map(shown, removed))} removed).")
            elif fresh and created and not any(d.exists() for d in created):
                error.add_note("Nothing was kept: the run failed before it wrote anything.")
            elif folder.directory is not None and (folder.directory / "run.json").is_file():
                error.add_note(_resume_note(folder.directory, config.trainer.steps, error))
        elif folder.directory is not None and (folder.directory / "run.json").is_file() and not removed:
            # A stop before the loop's own watch (a --resume's restore): where the run is, and how on.
            error.add_note(_resume_note(folder.directory, config.trainer.steps, error))
        raise


def check_in(config: RunConfig, folder: RunFolder | None) -> None:
    """Refuse, as ``dew train --check``, what a run of config would refuse before its first step,
    reading no data, no weight, and writing nothing: the hook plugins it loads, its XLA flags, its
    model and objective (the tokenizer's files included), the variables the objective's init would
    make (traced, none drawn: LoRA targets the model lacks), the starting weights' descriptions
    (check_initial, and an objective's own: ChecksOwnWeights) and its evaluation tasks (their record files). What is traced is traced on the
    CPU, so a check opens no accelerator. An error naming a path is traced to the recipe field that
    names it, as a run's is; folder (a resumed run's) is where the recipe's relative paths start,
    else the current directory."""
    import jax

    from dew import plugins
    from dew.objectives.base import ChecksBatchRows, ChecksOwnWeights
    from dew.recipes.run import build_evaluations, build_parts, check_initial
    from dew.training.runtime.process import check_xla_flags

    where = folder or RunFolder(None, None, Path.cwd())
    platforms = jax.config.values["jax_platforms"]
    jax.config.update("jax_platforms", "cpu")  # no accelerator is opened (or its memory taken) to check
    try:
        plugins.manager()  # an installed hook plugin every run would refuse
        check_xla_flags(config.trainer.xla_flags or ())  # XLA aborts a run on a flag it does not know
        with where.entered(out=sys.stderr):
            parts = build_parts(config, with_data=False)
            check_initial(config, parts.objective)
            if isinstance(parts.objective, ChecksOwnWeights):  # a distillation's teacher
                parts.objective.check_own_weights()
            jax.eval_shape(lambda: parts.objective.init(jax.random.key(0)))
            if isinstance(parts.objective, ChecksBatchRows):  # the whole batch: each process's share waits
                parts.objective.check_rows(config.data.batch)
            build_evaluations(config, parts)
    except Exception as error:
        _trace_to_fields(config, error, where)
        raise
    finally:
        jax.config.update("jax_platforms", platforms)


def _refuse_exported(directory: Path | None) -> None:
    """Refuse a run folder that holds an exported model (its config.json) and no run: the run's
    steps would sit beside the model, and dew generate, eval and export would then read the run.
    Refuse a numbered folder inside another run too: that run would take it for one of its steps."""
    if directory is not None and step_kept_in_run(directory) is not None:
        raise NestedRunFolderError(
            f"trainer.checkpoint_dir={shown(directory)} is a numbered folder inside the run "
            f"{shown(directory.parent)}, which would take it for its step {directory.name} (and set it aside "
            "as damaged). Set trainer.checkpoint_dir to a folder outside that run, or one not named by a number.")
    if directory is None or not (directory / "config.json").is_file() or (directory / "run.json").is_file():
        return
    raise ExportedModelFolderError(
        f"trainer.checkpoint_dir={shown(directory)} holds an exported model (its config.json), not a run: "
        "training there would write the run's steps beside the model, and dew generate, eval and export "
        "would read the run instead of it. Set trainer.checkpoint_dir to a new folder; to start from the "
        f"model, set init.pretrained={shown(directory)}.")


def _trace_to_fields(config: RunConfig, error: Exception, folder: RunFolder) -> None:
    """Note on error each recipe field that names the path it is about, with what to do there."""
    for field, path in fields_naming(config, error, cwd=folder.cwd, timestamp=folder.timestamp):
        error.add_note(_field_note(field, path, error))


def _field_note(field: str, path: Path, error: Exception) -> str:
    """The note tracing error to the recipe field that names its path, with what to do about it:
    only a path that is not there is to be created; one that is there is wrong as it is."""
    if _writing_failed(error) and field.rsplit(".", 1)[-1].endswith(("directory", "dir")):
        from dew.errors import out_of_space

        if out_of_space(error):
            return (f"The recipe's {field} names it: free space on its disk (or raise the file-size limit, "
                    f"ulimit -f), or point {field} at another disk.")
        return f"The recipe's {field} names it: point {field} at a directory this process can write."
    if _writing_failed(error):  # a URI or a file, not a directory to write in: the error says what
        return f"The recipe's {field} names it."
    if not path.exists():
        return (f"The recipe's {field} names it: create it first (a shipped recipe's description says "
                f"how), or point {field} at one that exists.")
    return f"The recipe's {field} names it."


def _writing_failed(error: Exception) -> bool:
    """Whether error is a write the run could not make (a full disk, a read-only directory, a file
    in the way): asking to create what the error names would mislead."""
    from dew.checkpoints.errors import CheckpointDirectoryError, CheckpointWriteError
    from dew.errors import RunFileWriteError
    from dew.tracking.background import TrackerWriteError
    from dew.training.runtime.process import CompilationCacheError

    return isinstance(error, CheckpointDirectoryError | CheckpointWriteError | TrackerWriteError
                      | RunFileWriteError | CompilationCacheError)


def _first_missing(directory: Path) -> Path:
    """The outermost folder of directory's path that does not exist yet (what mkdir -p makes)."""
    top = directory
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    return top


def _remove_empty_parents(directory: Path, top: Path) -> None:
    """Remove the folders between directory and top (included) that a run created and left empty."""
    current = directory.parent
    while top in (current, *current.parents) and current.is_dir() and not any(current.iterdir()):
        current.rmdir()
        if current == top:
            break
        current = current.parent


def _latest(directory: Path) -> int | None:
    from dew.checkpoints.store import Store

    with contextlib.suppress(Exception):
        kept = Store(directory, local=False).committed()
        return kept[-1] if kept else None
    return None


def _resume_note(directory: Path, steps: int | None, error: BaseException) -> str:
    """What a failed (or stopped) run kept, and the command that goes on from it; a run whose checkpoints
    already reach its steps has nothing left to train (what failed came after its last step); one whose
    every kept step is damaged has nothing to go on from."""
    from dew.checkpoints.errors import CheckpointCorruptedError

    if isinstance(error, CheckpointCorruptedError) and error.good is None:
        return (f"The run is in {shown(directory)}, and none of its kept steps is intact, so it cannot be "
                "resumed: restore the steps' files from a copy, or train it again in a new folder "
                "(trainer.checkpoint_dir=...); the damaged steps stay where they are.")
    latest = _latest(directory)
    resume = resume_command(directory)
    fixed = "once fixed, " if isinstance(error, Exception) else ""  # a stop has nothing to fix
    if latest is not None and steps is not None and latest >= steps:
        score = run_command("eval", directory)
        return (f"The run is in {shown(directory)}: its checkpoints reach step {latest}, the last of its "
                f"{steps}, so its training is done and only what a fit reports after its last step (the "
                f"closing validation, goodput, sample) was not written. {fixed.capitalize()}{score} scores it again; "
                f"to train further, {resume} trainer.steps=N.")
    kept = f"its newest checkpoint is step {latest}" if latest is not None else \
        "it kept no checkpoint yet, so it starts over"
    return f"The run is in {shown(directory)} ({kept}); {fixed}resume it with: {resume}"


def stopped_line(stop: Preempted | UnsavedStopError, folder: RunFolder, config: RunConfig) -> str:
    """What ``dew train`` prints when a signal stopped the run (a Preempted, or an UnsavedStopError
    when nothing could be written): where, and how on. A rank of a pool is resumed by starting
    the pool again, in this folder."""
    from dew.training.runtime.preemption import INTERRUPTED_STATUS, UnsavedStopError

    what = "interrupted (Ctrl-C)" if stop.status == INTERRUPTED_STATUS else "preempted"
    if isinstance(stop, UnsavedStopError) or folder.directory is None:
        return (f"{what} at step {stop.step}; no checkpoints are kept (trainer.checkpoint_dir is "
                "unset), so nothing was written and running again starts over.")
    kept = f"{what} at step {stop.step}; its checkpoint, data position and journal are in {shown(folder.directory)}."
    if not config.trainer.multi_host:
        return f"{kept} Resume with: {resume_command(folder.directory)}"
    if "{timestamp}" in (config.trainer.checkpoint_dir or ""):
        return (f"{kept} To resume, start the pool again with trainer.checkpoint_dir="
                f"{shlex.quote(shown(folder.directory))} (the recipe's {config.trainer.checkpoint_dir} "
                "names a new folder at every start).")
    return f"{kept} To resume, start the pool again (the same dew launch, or the same job)."
