"""The evaluation-task protocol, what a task is given, and how a run schedules tasks.

A task (``EvaluationTask``) scores a ``Subject`` (a causal model, its
variables and its tokenizer) on its own records and returns its scores,
``{"accuracy": 0.62, "records": 500}``, the same on every process. It is
sharded like training: global batches of its records, each process reading
its share (``DataPartition`` of the mesh), the model's forward run on the
mesh, so a task's cost falls with the number of devices and its scores do
not change.

A run schedules tasks with ``Periodic`` (the recipe's ``trainer.evaluate``
list: ``[{task: ..., every: ...}]``): the Trainer calls each every ``every``
steps and at the last step, on the live parameters, and reports the scores
as ``eval/<name>/<score>`` to the trackers and the ``dew_evaluation`` hook.

>>> class Constant:
...     def evaluate(self, subject, *, mesh=None):
...         return {"accuracy": 0.5, "records": 2}
>>> periodic = Periodic("toy", Constant(), every=10, model=None, tokenizer=None)
>>> periodic.due(20, last=False), periodic.due(25, last=False), periodic.due(25, last=True)
(True, False, True)
>>> periodic({}, step=20).scores
{'eval/toy/accuracy': 0.5, 'eval/toy/records': 2.0}
"""

from __future__ import annotations

import json
import os
import string
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from dew.data.base import DataPartition
from dew.data.magic import compression_of
from dew.errors import DewError

if TYPE_CHECKING:
    from collections.abc import Callable

    from flax.linen import Module
    from jax.sharding import Mesh

    from dew.data.base import Tokenizer
    from dew.evaluations.config import EvaluateConfig
    from dew.objectives.base import Objective, Variables
    from dew.training.evaluation import Evaluation

__all__ = ["ChecksModel", "EvaluationTask", "Periodic", "ReadsFiles", "ReadsWholeSequence", "ScoresCausalText",
           "Subject", "TaskFileError", "file_fields",
           "UnscorableModelError", "check_task_file", "filled_template", "read_task_file", "record_text", "scheduled",
           "share_rows"]


class TaskFileError(DewError, ValueError):
    """A task's record file is missing, or a line of it is not a record the task can read."""


class UnscorableModelError(DewError, ValueError):
    """A task that scores a causal language model's text was given a model that is not one."""


@runtime_checkable
class ScoresCausalText(Protocol):
    """A task that scores text through a causal model's next-token predictions (its likelihoods or
    its greedy continuations): it needs the run's tokenizer and a model that reads left to right."""

    scores_causal_text: ClassVar[bool]


@runtime_checkable
class ReadsFiles(Protocol):
    """A task whose fields name files it reads (its records' file): ``dew eval RUN --task`` resolves
    those fields, and no others, from the folder the run trained in, as the run read them. A task
    that does not declare them is taken to read ``file`` alone."""

    file_fields: ClassVar[tuple[str, ...]]


def file_fields(task: object) -> tuple[str, ...]:
    """The fields naming files that task (a registered task class or an instance) reads."""
    return task.file_fields if isinstance(task, ReadsFiles) else ("file",)


@runtime_checkable
class ChecksModel(Protocol):
    """A task whose settings must fit the model it scores (a generation's new tokens within its
    length): checked as a recipe schedules it, so a run is refused before it trains rather than at
    its first evaluation."""

    def check_model(self, model: Module) -> object:
        """Raise TaskFileError naming the setting this model cannot take (what it returns is the task's)."""
        ...


@runtime_checkable
class ReadsWholeSequence(Protocol):
    """A model whose every position reads the whole sequence (a masked- or block-diffusion
    denoiser): its logits are no next-token predictions, so no causal text task can score it."""

    reads_whole_sequence: ClassVar[bool]


@dataclass(frozen=True)
class Subject:
    """What a task scores: a causal model (``model.apply(variables, ids) -> logits``), its
    variables and the tokenizer its text goes through."""

    model: Module
    variables: Variables
    tokenizer: Tokenizer | None  # None when neither the run's data nor its export supplied one

    def text_tokenizer(self, task: str, purpose: str) -> Tokenizer:
        """The tokenizer a text task needs (purpose: what it turns into ids), or an error saying
        where one comes from, and that a run without one (an image model's) cannot score text."""
        if self.tokenizer is None:
            raise TaskFileError(
                f"{task} needs the run's tokenizer to turn {purpose} into ids, and this run has none: its "
                "data reader names no tokenizer (or its export holds none). Text tasks score a language "
                "model; a run on images or on pre-tokenized ids without a tokenizer cannot take them.")
        return self.tokenizer


@runtime_checkable
class EvaluationTask(Protocol):
    """Scores a Subject on a task's records (see the module docstring).

    ``evaluate`` returns plain floats keyed by score name, identical on every
    process; ``records`` counts the task's records scored. mesh is the
    run's device mesh (None: every local device along the data axis).
    """

    def evaluate(self, subject: Subject, *, mesh: Mesh | None = None) -> Mapping[str, float]: ...


@dataclass(frozen=True)
class Periodic:
    """A task a run scores every ``every`` steps (and at its last step) under ``eval/<name>/``.

    served picks, from the variables it is called with, those model applies (a distillation's
    student among the run's); None takes them all.
    """

    name: str
    task: EvaluationTask
    every: int | None
    model: Module
    tokenizer: Tokenizer | None
    served: Callable[[Variables], Variables] | None = None

    def due(self, done: int, last: bool) -> bool:
        """Whether the task runs after step done."""
        return last or (self.every is not None and done % self.every == 0)

    def __call__(self, variables: Variables, *, mesh: Mesh | None = None, step: int = 0,
                 prefix: str = "eval") -> Evaluation:
        """Score variables; the Evaluation a tracker records, its scores under ``prefix/name/``."""
        from dew.training.evaluation import Evaluation

        began = time.perf_counter()
        chosen = variables if self.served is None else self.served(variables)
        usable = {k: v for k, v in chosen.items() if k != "cache"}
        scores = self.task.evaluate(Subject(self.model, usable, self.tokenizer), mesh=mesh)
        split = f"{prefix}/{self.name}"
        named = {f"{split}/{key}": float(value) for key, value in scores.items()}
        return Evaluation(step=int(step), split=split, scores=named, coordinated_batches=0,
                          records=int(scores.get("records", 0)), uneven_shards=False,
                          event_key=(int(step), zlib.crc32(split.encode())),
                          elapsed_seconds=time.perf_counter() - began)


def scheduled(config: EvaluateConfig, model: Module, tokenizer: Tokenizer | None,
              expand: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
              served: Callable[[Variables], Variables] | None = None,
              objective: Objective | type[Objective] | None = None) -> Periodic:
    """The Periodic a recipe's ``trainer.evaluate`` entry describes, its task built by the registry.

    expand, when given, rewrites the fields first (a recipe's ``{recipes}`` placeholders); served
    is Periodic's. objective, the run's (or its class, for an export recording it), refuses a text
    task where its model serves a score.
    """
    from dew import registry

    fields = config.fields if expand is None else expand(config.fields)
    task = registry.evaluations.build(config.task, **fields)
    if isinstance(task, ScoresCausalText):  # refused as the task is built, not at its first evaluation
        if isinstance(model, ReadsWholeSequence):
            raise UnscorableModelError(
                f"The task {config.task!r} scores a causal language model's next-token predictions, and this "
                f"run's model, {type(model).__name__}, reads the whole sequence at every position (a "
                "diffusion denoiser), so its logits predict no next token. Score the run with its objective's "
                "own metrics (dew eval RUN), or give the task a causal model's run.")
        if objective is not None and objective.serves_scores:
            kind = objective if isinstance(objective, type) else type(objective)
            raise UnscorableModelError(
                f"The task {config.task!r} scores a causal language model's next-token predictions, and the "
                f"objective these weights were trained with, {kind.__name__}, trains its model to serve a score "
                "(its decoder's token predictions never train), so the task would score untrained logits. "
                "Score them with the objective's own metrics (dew eval RUN), or give the task a language "
                "model.")
        if tokenizer is None:
            raise UnscorableModelError(
                f"The task {config.task!r} turns text into ids with the run's tokenizer, and this run has none: "
                "its data reader names no tokenizer (or its export holds none). Text tasks score a language "
                "model; a run on images or on pre-tokenized ids without a tokenizer cannot take them.")
    if isinstance(task, ChecksModel):
        task.check_model(model)
    return Periodic(config.name, task, config.every, model, tokenizer, served)


# -- what tasks share --------------------------------------------------------------------------

def check_task_file(path: str | os.PathLike[str]) -> Path:
    """The task file at path, checked to be one: a task checks it when it is built, so a recipe
    naming a missing file is refused before the run trains rather than at its first evaluation."""
    if not os.fspath(path).strip():  # Path("") is the working directory
        raise TaskFileError("The task's file is empty; pass the path of a JSONL file, one record per line "
                            "(file=PATH).")
    file = Path(path).expanduser()
    if file.is_dir():
        raise TaskFileError(f"The task file {os.fspath(path)!r} is a directory; pass the path of a "
                            "JSONL file in it, one record per line.")
    if not file.is_file():
        raise TaskFileError(f"The task file {os.fspath(path)!r} does not exist; pass the path of a "
                            "JSONL file, one record per line.")
    return file


def read_task_file(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of every non-blank line of a JSONL task file.

    A line that is not a JSON object raises TaskFileError naming the file and the line.
    """
    file = check_task_file(path)
    with file.open("rb") as handle:  # bytes, decoded a line at a time, so a bad one is named
        for number, raw in enumerate(handle, 1):
            if number == 1 and (packed := compression_of(raw)) is not None:
                raise TaskFileError(f"{os.fspath(path)!r} is compressed ({packed}), and a task reads a plain "
                                    "JSONL file; decompress it first (gunzip, say).")
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a first line's BOM is no text
            except UnicodeDecodeError as error:
                raise TaskFileError(f"Line {number} of {os.fspath(path)!r} is not UTF-8 text "
                                    f"({error.reason} at byte {error.start}); write the file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TaskFileError(f"Line {number} of {os.fspath(path)!r} is not valid JSON "
                                    f"({error.msg}); write one JSON object per line.") from None
            if not isinstance(record, dict):
                raise TaskFileError(f"Line {number} of {os.fspath(path)!r} holds a "
                                    f"{type(record).__name__}, not a JSON object.")
            yield number, record


def record_text(record: Mapping[str, Any], key: str, where: str) -> str:
    """The record's value under key as the text a task scores: a string or a number. A list or an
    object (a conversation's messages) would be scored as its Python repr, so it is refused."""
    value = record[key]
    if value is None or isinstance(value, list | dict):
        what = "null" if value is None else "a list" if isinstance(value, list) else "an object"
        raise TaskFileError(f"{where} holds {what} under {key!r}, where the task reads text; give it a string "
                            "(a conversation's messages joined into one text), or leave the record out.")
    return str(value)


def filled_template(template: str, record: Mapping[str, Any], where: str) -> str:
    """template filled from the record (str.format); a field it names whole that holds a list or an
    object is refused, as record_text refuses it (an index into one, {choices[0]}, is text), and a
    template the record cannot fill raises TaskFileError naming the record's keys."""
    try:
        for _, field, _, _ in string.Formatter().parse(template):
            if field and field in record:
                record_text(record, field, where)
        return template.format(**record)
    except TaskFileError:
        raise
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as error:
        raise TaskFileError(f"{where}: the template {template!r} cannot be filled from the record "
                            f"({type(error).__name__}: {error}); its keys are {sorted(record)}, and a literal "
                            "brace is written twice ({{ or }}).") from None


def share_rows(count: int, batch: int, partition: DataPartition) -> list[np.ndarray]:
    """This share's row numbers of each global batch of ``batch`` over ``count`` rows, -1 for padding.

    Global batch g holds rows [g*batch, (g+1)*batch); the last is padded to a
    whole batch with -1, so every process runs the same number of equally
    shaped batches. Share s of S reads rows [s*batch/S, (s+1)*batch/S) of each.
    """
    per = partition.rows(batch)
    batches = max(1, -(-count // batch))
    out = []
    for g in range(batches):
        rows = np.arange(g * batch + partition.share * per, g * batch + (partition.share + 1) * per)
        out.append(np.where(rows < count, rows, -1))
    return out
