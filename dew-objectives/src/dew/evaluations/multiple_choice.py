"""MultipleChoice: pick the answer the model finds most likely (HellaSwag, ARC, MMLU style).

Each JSONL record holds a context, its choices and the right one::

    {"context": "The capital of France is", "choices": ["Paris", "Rome"], "answer": 0}

``answer`` is the index of the right choice, a letter (``"B"``), the
choice's label when choices come labelled as ARC's do
(``{"text": [...], "label": ["A", "B", ...]}``), or the choice's own text
(``answer_is`` says which reading is meant where an answer allows both and
they differ); ``first_answer`` is the
number a file gives its first choice (Winogrande's ``"1"`` and ``"2"``:
``first_answer: 1``). Choices kept in fields of
their own (PIQA's ``sol1``, ``sol2``) are named as a list, ``choices_key:
[sol1, sol2]``, in order. ``template`` formats the
context from the record's fields (``"Question: {question}\\nAnswer:"``).

With ``blank`` (Winogrande's ``"_"``) the choices fill the context instead
of following it, as lm-eval's partial scoring does: each choice ends its own
context (the text before the blank, then the choice), and what follows the
blank, stripped, is the continuation scored after each, the same text for
every choice. ``accuracy_norm`` then divides by each filled context's
characters, as lm-eval does for such a task.

A choice is scored by the summed log-probability of its tokens after the
context, tokenized as the evaluation harnesses do: the context's trailing
spaces move to the front of the continuation (``separator + choice``), the
whole text is tokenized, and the continuation is what follows the
context's own tokens; an empty context starts from the end-of-document id.
A row longer than the model's window keeps its last ``max_seq_len + 1``
tokens. ``accuracy`` picks the largest sum; ``accuracy_norm`` the largest sum
per character of the choice (the separator is not counted, as in lm-eval's
``acc_norm``). All (record, choice) rows are scored in
global batches of ``batch`` rows, sharded over the mesh like training.
"""

from __future__ import annotations

import os
import string
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from dew.data.base import prefix_of, prompt_ids
from dew.evaluations.base import (
    Subject,
    TaskFileError,
    check_task_file,
    filled_template,
    read_task_file,
    record_text,
)
from dew.evaluations.scoring import loglikelihoods

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from dew.data.base import Tokenizer

__all__ = ["Choice", "ChoiceCutWarning", "MultipleChoice", "Question", "continuation_ids", "normalized_pick"]


class ChoiceCutWarning(UserWarning):
    """A choice is longer than the model reads at once: it is scored on its last ids alone."""


@dataclass(frozen=True)
class Question:
    """One record: where it is, its context, its choices and the index of the right one."""

    line: int
    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class Choice:
    """One scored row: the ids of context and continuation, and how many of them are the continuation."""

    ids: tuple[int, ...]
    scored: int
    characters: int


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer.encode(text)]


def continuation_ids(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:  # eos_id read
    """(context ids, continuation ids) as the evaluation harnesses split them (module docstring)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:  # the beginning-of-text id where the tokenizer has one, else end-of-document
        return prefix_of(tokenizer) or [int(tokenizer.eos_id)], _ids(tokenizer, continuation)
    whole = prompt_ids(tokenizer, context + continuation)
    head = prompt_ids(tokenizer, context)
    return whole[: len(head)], whole[len(head):]


@dataclass(frozen=True)
class MultipleChoice:
    """Accuracy over a JSONL file of multiple-choice records (see the module docstring)."""

    scores_causal_text: ClassVar[bool] = True  # dew.evaluations.base.ScoresCausalText
    file_fields: ClassVar[tuple[str, ...]] = ("file",)  # dew.evaluations.base.ReadsFiles

    file: str
    context_key: str = "context"
    choices_key: str | Sequence[str] = "choices"  # a list: one field per choice, in order
    answer_key: str = "answer"
    template: str | None = None
    separator: str = " "
    blank: str | None = None  # Winogrande's "_": each choice fills the context there (module docstring)
    first_answer: int = 0  # the number the file gives its first choice (Winogrande's: 1)
    answer_is: Literal["position", "text"] | None = None  # None: whichever reading the answer allows
    batch: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.choices_key, str):  # a recipe's list: held as a tuple, as a frozen task is
            object.__setattr__(self, "choices_key", tuple(self.choices_key))
        if self.batch < 1:
            raise TaskFileError(f"MultipleChoice.batch={self.batch!r}; it is at least 1.")
        if self.answer_is is not None and self.answer_is not in ("position", "text"):
            raise TaskFileError(f"MultipleChoice.answer_is={self.answer_is!r}; it is 'position' (an index, a "
                                "letter or a label) or 'text' (the right choice's own text).")
        if self.blank == "":
            raise TaskFileError("MultipleChoice.blank is empty, which every context holds everywhere; give the "
                                "mark each choice fills (Winogrande's '_'), or leave blank out.")
        check_task_file(self.file)
        self.questions()  # every record read once here: a bad one is refused before the run trains

    def _where(self, line: int) -> str:
        return f"Line {line} of {os.fspath(self.file)!r}"

    def _question(self, line: int, record: Mapping[str, Any]) -> Question:
        where = self._where(line)
        fields = (self.choices_key,) if isinstance(self.choices_key, str) else tuple(self.choices_key)
        for key in (*fields, self.answer_key) + (() if self.template else (self.context_key,)):
            if key not in record:
                raise TaskFileError(f"{where} has no key {key!r} (it has {sorted(record)}); set "
                                    "context_key=, choices_key= and answer_key= to the keys it uses.")
            if record[key] is None:  # str(None) would be scored as the text "None"
                raise TaskFileError(f"{where} holds null under {key!r}; give it a value, or leave the record out.")
        choices, labels = (record[fields[0]] if isinstance(self.choices_key, str)
                           else [record[key] for key in fields]), None
        if isinstance(choices, Mapping) and "text" in choices:  # ARC: {"text": [...], "label": [...]}
            choices, labels = choices["text"], choices.get("label")
            if labels is not None and (not isinstance(labels, list) or len(labels) != len(choices)):
                raise TaskFileError(f"{where}: {self.choices_key!r}.label must be a list of one label per "
                                    f"choice ({len(choices) if isinstance(choices, Sequence) else '?'}), got "
                                    f"{labels!r}; give each choice its label, or leave label out.")
        if (not isinstance(choices, Sequence) or isinstance(choices, str) or len(choices) < 2
                or not all(isinstance(c, str) for c in choices)):
            own = (" (choices kept in fields of their own are named as a list, choices_key: [sol1, sol2])"
                   if isinstance(choices, str) else "")
            raise TaskFileError(f"{where}: {self.choices_key!r} must be a list of at least two strings, "
                                f"got {choices!r}{own}.")
        context = (filled_template(self.template, record, where) if self.template
                   else record_text(record, self.context_key, where))
        if self.blank is not None:
            marks = context.count(self.blank)
            if marks != 1:
                raise TaskFileError(f"{where}: its context holds the blank {self.blank!r} {marks} times; each choice "
                                    "fills it at one place, so give a context with exactly one.")
            if not self.separator + context.split(self.blank)[1].strip():
                raise TaskFileError(f"{where}: nothing follows the blank {self.blank!r} and separator is '', so no "
                                    "token would be scored after the choices; give the context text after it.")
        elif any(not self.separator + choice for choice in choices):
            raise TaskFileError(f"{where}: a choice is empty and separator is '', so it would be scored on no "
                                "token at all; give every choice some text.")
        return Question(line, context, tuple(choices), self._answer(record[self.answer_key], choices, labels, where))

    def _answer(self, answer: Any, choices: Sequence[str], labels: Any, where: str) -> int:
        """The right choice's index: the answer read by position (an index, a letter, a label) or as a
        choice's own text. Where both readings name a choice and differ ("3" among the choices
        "3", "4", "5", "6"), answer_is says which is meant, and without it the record is refused."""
        position: int | None = None
        text: int | None = None
        if isinstance(answer, int) and not isinstance(answer, bool):
            position = answer - self.first_answer
        elif isinstance(answer, str):
            if labels is not None and answer in list(labels):
                position = list(labels).index(answer)
            elif answer.strip().isdigit():
                position = int(answer.strip()) - self.first_answer
            elif len(answer.strip()) == 1 and answer.strip().upper() in string.ascii_uppercase:
                position = string.ascii_uppercase.index(answer.strip().upper())
            if answer in choices:
                text = list(choices).index(answer)
        if position is not None and not 0 <= position < len(choices):
            position = None  # "y" among two choices is no letter of theirs, though it may be one's text
        if self.answer_is == "position":
            text = None
        elif self.answer_is == "text":
            position = None
        if position is not None and text is not None and position != text:
            raise TaskFileError(
                f"{where}: the answer {answer!r} is the text of choice {text + self.first_answer} and also names "
                f"choice {position + self.first_answer} by its position; set answer_is='text' or "
                "answer_is='position' to say how the file's answers read.")
        index = text if position is None else position
        if index is None:
            raise TaskFileError(f"{where}: the answer {answer!r} names none of its {len(choices)} choices; give "
                                f"its index (from {self.first_answer}: first_answer), its letter, its label, or "
                                "its text.")
        return index

    def scored(self, question: Question) -> list[tuple[str, str]]:
        """Each choice's (context, continuation): the context then the choice, or with a blank the
        context filled by the choice then the text after the blank (module docstring)."""
        if self.blank is None:
            return [(question.context, self.separator + choice) for choice in question.choices]
        before, after = question.context.split(self.blank)
        return [(before + choice, self.separator + after.strip()) for choice in question.choices]

    def normalizing(self, question: Question) -> list[str]:
        """The texts accuracy_norm divides each choice's score by the characters of: the choices, or
        with a blank the filled contexts (as lm-eval normalizes a task whose choices are contexts)."""
        if self.blank is None:
            return list(question.choices)
        return [context for context, _ in self.scored(question)]

    def questions(self) -> list[Question]:
        """Every record of the file, checked (TaskFileError names a bad line)."""
        found = [self._question(line, record) for line, record in read_task_file(self.file)]
        if not found:
            raise TaskFileError(f"The task file {os.fspath(self.file)!r} holds no record.")
        return found

    def rows(self, tokenizer: Tokenizer, limit: int | None) -> list[Choice]:
        """Every (question, choice) row in order, cut to the last limit ids."""
        out, cut = [], []
        for question in self.questions():
            for context, continuation in self.scored(question):
                head, tail = continuation_ids(tokenizer, context, continuation)
                if not tail:  # its log-likelihood would be 0, the likeliest a choice can be: always picked
                    raise TaskFileError(
                        f"{self._where(question.line)}: its context with {continuation!r} after it tokenizes into no "
                        f"more ids than the context alone (context ending {context[-20:]!r}: the tokenizer merges the "
                        "choice into its last ids), so no id of the choice would be scored and it would win with a "
                        "log-likelihood of 0. End the context at a word's end and let the separator (' ') start "
                        "each choice, or leave the record out.")
                ids = (head + tail)[-limit:] if limit else head + tail
                if len(tail) > len(ids) - 1:
                    cut.append(question.line)
                out.append(Choice(tuple(ids), min(len(tail), len(ids) - 1), len(continuation)))
        if cut:
            warnings.warn(ChoiceCutWarning(
                f"{len(cut)} choice(s) of {os.fspath(self.file)!r} (the first on line {cut[0]}) are longer than the "
                f"model's window of {(limit or 1) - 1} positions, so each is scored on its last {(limit or 1) - 1} ids "
                "alone and its likelihood is not the whole choice's; lm-evaluation-harness refuses such a choice."),
                stacklevel=2)
        return out

    def choice_scores(self, subject: Subject, *, mesh: Mesh | None = None) -> list[np.ndarray]:
        """Each question's summed log-probability of every choice, in file order."""
        questions = self.questions()
        window = getattr(subject.model, "max_seq_len", None)  # any flax Module: unbounded if it has none
        rows = self.rows(subject.text_tokenizer("MultipleChoice", "choices"), None if window is None else window + 1)
        sums = loglikelihoods(subject.model, subject.variables, [(r.ids, r.scored) for r in rows],
                              batch=self.batch, mesh=mesh)
        bounds = np.cumsum([0] + [len(q.choices) for q in questions])
        return [sums[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def evaluate(self, subject: Subject, *, mesh: Mesh | None = None) -> dict[str, float]:
        """accuracy and accuracy_norm over the records, and how many were scored."""
        questions = self.questions()
        right = right_norm = 0
        for question, scores in zip(questions, self.choice_scores(subject, mesh=mesh), strict=True):
            right += int(np.argmax(scores)) == question.answer
            right_norm += normalized_pick(scores, self.normalizing(question)) == question.answer
        count = len(questions)
        return {"accuracy": right / count, "accuracy_norm": right_norm / count, "records": float(count)}


def normalized_pick(scores: np.ndarray, choices: Sequence[str]) -> int:
    """The choice with the largest summed log-probability per character of the choice itself:
    lm-eval's acc_norm, which does not count the separator before it; an empty choice, which
    it divides by zero characters, is never picked over one with text."""
    lengths = np.asarray([len(choice) for choice in choices], np.float64)
    per = np.divide(np.asarray(scores, np.float64), lengths, out=np.full(len(lengths), -np.inf), where=lengths > 0)
    return int(np.argmax(per))
