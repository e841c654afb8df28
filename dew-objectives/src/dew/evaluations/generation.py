"""GenerationTask: greedy answers scored by exact match or by a regular expression (GSM8K style).

Each JSONL record holds a prompt and its reference answer::

    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\\n#### 7"}

The model continues ``template`` (filled from the record's fields) greedily
through ``dew.sampling.generate`` for at most ``max_new_tokens`` tokens,
stopping at the end-of-document id; the text is cut at the first of
``stop`` (one text, or a list of them). With ``pattern`` the prediction is
the first match of it in the text (its first group when it has one); with
``answer_pattern`` the reference is what that finds in the answer (GSM8K's
``#### (.*)``). Both are compared after stripping surrounding whitespace,
with every match of each ``ignore`` expression removed from both first and, with
``ignore_case``, in lower case: lm-eval's ``regexes_to_ignore`` and
``ignore_case``, so GSM8K's ``[",", "\\$", "\\.$"]`` scores "1,600." as 1600. ``exact_match`` is
the share of records whose prediction equals the reference. The records
are split into global batches of ``batch`` prompts and each process
generates its share of every batch; the counts are summed over processes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from dew.data.base import eos_id_of, prompt_ids, stop_ids_of
from dew.data.tokenizers import drawable_vocab
from dew.evaluations.base import (
    Subject,
    TaskFileError,
    check_task_file,
    filled_template,
    read_task_file,
    record_text,
    share_rows,
)
from dew.evaluations.scoring import task_mesh
from dew.sampling import Sampling, generate
from dew.training.placement.mesh import data_partition

if TYPE_CHECKING:
    from flax.linen import Module
    from jax.sharding import Mesh

__all__ = ["AnswerRecord", "GenerationTask"]


@dataclass(frozen=True)
class AnswerRecord:
    """One record: where it is, the prompt the model continues and the reference answer."""

    line: int
    prompt: str
    reference: str


def _first(pattern: re.Pattern[str], text: str) -> str | None:
    """The first match's first group that matched (lm-eval's RegexFilter takes the first non-empty one,
    so a pattern of alternatives, one group each, reads whichever branch matched), or the whole match
    when the pattern has no group."""
    found = pattern.search(text)
    if found is None:
        return None
    if not pattern.groups:
        return found.group(0)
    matched = [group for group in found.groups() if group is not None]
    return next((group for group in matched if group), matched[0] if matched else None)


@dataclass(frozen=True)
class GenerationTask:
    """Exact match of greedy generations against reference answers (see the module docstring)."""

    scores_causal_text: ClassVar[bool] = True  # dew.evaluations.base.ScoresCausalText
    file_fields: ClassVar[tuple[str, ...]] = ("file",)  # dew.evaluations.base.ReadsFiles

    file: str
    prompt_key: str = "question"
    answer_key: str = "answer"
    template: str | None = None
    max_new_tokens: int = 64
    pattern: str | None = None
    answer_pattern: str | None = None
    stop: str | Sequence[str] = field(default_factory=tuple)  # one text, or several
    ignore: str | Sequence[str] = field(default_factory=tuple)  # expressions removed before comparing
    ignore_case: bool = False
    batch: int = 8

    def __post_init__(self) -> None:
        # one string is one stop text (or expression), as lm-eval's until: "..." (a tuple of it
        # would stop at each letter)
        for name in ("stop", "ignore"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        for name, value in (("pattern", self.pattern), ("answer_pattern", self.answer_pattern),
                            *(("stop", each) for each in self.stop)):
            if value == "":  # found at the start of every text: each answer would be the empty text
                raise TaskFileError(f"GenerationTask.{name} is empty, which every text holds at its start, so "
                                    "each answer would be the empty text; leave it out (null) to compare the "
                                    "whole text.")
        for name, value in (("pattern", self.pattern), ("answer_pattern", self.answer_pattern),
                            *(("ignore", each) for each in self.ignore)):
            if value is not None:
                try:
                    re.compile(value)
                except re.error as error:
                    raise TaskFileError(f"GenerationTask.{name} {value!r} is not a regular expression: {error}.") \
                        from None
        for name in ("max_new_tokens", "batch"):
            if getattr(self, name) < 1:
                raise TaskFileError(f"GenerationTask.{name}={getattr(self, name)!r}; it is at least 1.")
        check_task_file(self.file)
        self.problems()  # every record read once here: a bad one is refused before the run trains

    def problems(self) -> list[AnswerRecord]:
        """Every record of the file with its reference answer (TaskFileError names a bad line)."""
        answers = None if self.answer_pattern is None else re.compile(self.answer_pattern)
        out = []
        for line, record in read_task_file(self.file):
            where = f"Line {line} of {os.fspath(self.file)!r}"
            keys = (self.answer_key,) + (() if self.template else (self.prompt_key,))
            missing = [k for k in keys if k not in record]
            if missing:
                raise TaskFileError(f"{where} has no key {missing[0]!r} (it has {sorted(record)}); set "
                                    "prompt_key= and answer_key= to the keys it uses.")
            empty = [k for k in keys if record[k] is None]
            if empty:  # str(None) would be scored as the text "None"
                raise TaskFileError(f"{where} holds null under {empty[0]!r}; give it a value, or leave the "
                                    "record out.")
            prompt = (filled_template(self.template, record, where) if self.template
                      else record_text(record, self.prompt_key, where))
            reference = record_text(record, self.answer_key, where)
            if answers is not None:
                found = _first(answers, reference)
                if found is None:
                    raise TaskFileError(f"{where}: answer_pattern {self.answer_pattern!r} finds nothing in "
                                        f"the answer {reference[:80]!r}.")
                reference = found
            out.append(AnswerRecord(line, prompt, reference.strip()))
        if not out:
            raise TaskFileError(f"The task file {os.fspath(self.file)!r} holds no record.")
        return out

    def check_model(self, model: Module) -> int | None:
        """The ids left for a prompt in the model's length (None: unbounded); TaskFileError when
        max_new_tokens leaves none (dew.evaluations.base.ChecksModel, checked as a run schedules it)."""
        limit = getattr(model, "max_seq_len", None)  # any decoder; dew's say how long they read
        if limit is None:
            return None
        room = int(limit) - self.max_new_tokens
        if room < 1:
            raise TaskFileError(f"GenerationTask.max_new_tokens={self.max_new_tokens} leaves no room for a "
                                f"prompt in the model's max_seq_len={limit}; ask for fewer new tokens.")
        return room

    def prediction(self, text: str) -> str | None:
        """What a generated text answers: cut at stop, then the pattern's match (None: no match)."""
        for marker in self.stop:
            if marker in text:
                text = text[: text.index(marker)]
        if self.pattern is None:
            return text.strip()
        found = _first(re.compile(self.pattern), text)
        return None if found is None else found.strip()

    def matches(self, prediction: str | None, reference: str) -> bool:
        """Whether a prediction answers the reference, once ignore and ignore_case are applied to both."""
        if prediction is None:
            return False

        def normal(text: str) -> str:
            for expression in self.ignore:
                text = re.sub(expression, "", text)
            return text.strip().lower() if self.ignore_case else text.strip()

        return normal(prediction) == normal(reference)

    def generations(self, subject: Subject, *, mesh: Mesh | None = None) -> dict[int, str]:
        """This process's generated texts, by record number. A prompt longer than the model leaves
        room for (max_seq_len less max_new_tokens) keeps its last ids, as MultipleChoice cuts a row."""
        problems = self.problems()
        partition = data_partition(task_mesh(mesh))
        tokenizer = subject.text_tokenizer("GenerationTask", "prompts")
        eos = eos_id_of(tokenizer)
        prompts = [prompt_ids(tokenizer, p.prompt) or [int(eos)] for p in problems]  # type: ignore[arg-type]  # an empty prompt needs an eos
        room = self.check_model(subject.model)
        if room is not None:
            prompts = [ids[-room:] for ids in prompts]  # a long prompt keeps its end, as the harnesses cut one
        out: dict[int, str] = {}
        variables = _process_local(subject.variables)
        for mine in share_rows(len(problems), max(self.batch, partition.shares), partition):
            kept = [int(r) for r in mine if r >= 0]
            rows = [prompts[r] for r in kept] or [prompts[0]]  # every process generates each batch
            made = generate(subject.model, variables, rows, self.max_new_tokens, jax.random.key(0),
                            Sampling(temperature=0.0), eos_id=stop_ids_of(tokenizer),
                            vocab=drawable_vocab(tokenizer))
            for r, new in zip(kept, made.new_tokens, strict=False):
                out[r] = tokenizer.decode([int(t) for t in new])
        return out

    def evaluate(self, subject: Subject, *, mesh: Mesh | None = None) -> dict[str, float]:
        """exact_match over the records, and how many were scored."""
        problems = self.problems()
        right = sum(self.matches(self.prediction(text), problems[r].reference)
                    for r, text in self.generations(subject, mesh=mesh).items())
        if jax.process_count() > 1:
            right = int(np.asarray(multihost_utils.process_allgather(np.asarray(right, np.int64))).sum())
        return {"exact_match": right / len(problems), "records": float(len(problems))}


def _process_local(variables: Any) -> Any:
    """variables whole on this process. A process pool's run holds them sharded over every
    process's devices, and each process generates its own rows, each finishing when it does:
    decoding with the pool's arrays would make every call a collective the others never reach
    (it failed fetching an array it cannot address). Gathered once, each decodes on its own."""
    return jax.tree.map(
        lambda leaf: np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable else leaf, variables)
