"""PromptCompletion: prompt/completion records as rows for supervised fine-tuning.

Each JSONL line holds a prompt and a completion (``prompt_key``,
``completion_key``). A record becomes the ids of its prompt, then of its
completion, then the end-of-document id; only the completion and the
end-of-document id are scored (``loss_mask``).

With a chat template (``chat_template``: its text or a ``.jinja`` file; else
the one a tokenizer folder ships, in ``chat_template.jinja`` or
``tokenizer_config.json``; else a ``transformers`` tokenizer's own) a record
is the conversation of one user turn and one assistant turn: the prompt is
what the template renders for the user turn with the assistant's generation
prompt, the completion what the assistant turn adds after it, the
template's end of turn included (TRL's reading of conversational
prompt/completion records), and no end-of-document id is added. A record
may give its prompt or completion as messages (``[{"role": "user",
"content": ...}]``, TRL's conversational form: a system turn, earlier
turns), rendered the same way; such a record needs a chat template. Without
one, ``template`` (``"{prompt}"`` by default) formats the prompt. A
``tokenizer.json`` path is the tokenizer alone: name its folder to use the
template and end-of-document token published beside it.

With ``label_key`` (TRL's unpaired preference records, ``{"prompt",
"completion", "label"}``) each record is one row of what KTO reads instead:
``completion`` (the prompt's ids and the completion's), ``completion_mask``,
``prompt_length`` and ``label`` (1 for a desirable completion, 0 for an
undesirable one), never packed. With ``rejected_key`` (TRL's preference
records, ``{"prompt", "chosen", "rejected"}``, with ``completion_key:
chosen``) each record is one pair of what DPO and the reward model read:
``chosen``, ``rejected``, their masks and ``prompt_length``.

With ``pack`` (the default) records are laid end to end, first come first
served, into rows of ``length + 1`` ids, each numbered in ``segment_ids``
(1, 2, ...; 0 marks padding), so LMObjective keeps attention inside each
one. Without it every record has a row of its own. A record too long for a
row keeps its completion and drops the start of its prompt; a completion
that alone does not fit fails, naming the record and the limit. A record
with nothing to score (an empty or blank completion) is skipped with a warning
naming it.

>>> import json, tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "sft.jsonl").write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\\n")
>>> rows = PromptCompletion(files=str(folder / "sft.jsonl"), length=8).rows()
>>> rows["text"][0].tolist(), rows["loss_mask"][0].tolist()
([50, 43, 50, 61, 52, 256, 256, 256, 256], [0, 0, 0, 0, 1, 1, 0, 0, 0])
"""

from __future__ import annotations

import json
import os
import string
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dew.data.base import Dataset, EosTokenizer, Tokenizer, prefix_of
from dew.data.base import prompt_ids as start_ids
from dew.data.chat import TruncatedWarning, assistant_speaks, check_messages
from dew.data.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    no_template_for,
    reader_chat_template,
)
from dew.data.errors import DataError, EmptyDatasetError, MalformedRecordError, MissingKeyError
from dew.data.packing import packed_rows
from dew.data.sources import ArrayRecords, json_records
from dew.data.stream import record_dataset
from dew.data.token_windows import resolve_tokenizer, split_records

__all__ = ["CompletionTooLongError", "NothingToScoreWarning", "PromptCompletion"]

Turns = str | list[dict[str, Any]]  # a record's prompt or completion: text, or messages


@runtime_checkable
class _AppliesChatTemplate(Protocol):
    """A tokenizer that renders its own chat template (transformers' tokenizers)."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool) -> str: ...


class CompletionTooLongError(DataError, ValueError):
    """A record's completion does not fit in one row, so it could not be scored whole."""


class NothingToScoreWarning(UserWarning):
    """A record leaves no token to score (its completion is empty); it is skipped."""


@dataclass(frozen=True)
class Encoded:
    """One record's ids and its mask (1 where scored), with where it came from."""

    where: str
    ids: np.ndarray
    mask: np.ndarray
    label: int | None = None  # KTO's: 1 desirable, 0 undesirable (with label_key)


def _template_problem(template: object) -> str | None:
    """What keeps str.format from filling template with the prompt alone (no {prompt}, another
    field, a lone brace), or None. Literal braces, as in JSON, are written twice: {{ and }}."""
    if not isinstance(template, str):
        return None  # its type is the recipe's schema's to refuse
    if "{prompt}" not in template:
        return f"PromptCompletion.template must contain '{{prompt}}', got {template!r}."
    advice = "write a literal brace twice ({{ or }}), e.g. 'Answer in JSON like {{\"a\": 1}}. {prompt}'"
    try:
        named = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        return f"PromptCompletion.template {template!r} cannot be filled ({error}); {advice}."
    others = [name for name in named if name != "prompt"]
    if others:
        return (f"PromptCompletion.template {template!r} names {', '.join('{' + n + '}' for n in others)}, "
                f"but only {{prompt}} is filled in; {advice}.")
    return None


@dataclass(frozen=True)
class PromptCompletion:
    """Prompt/completion JSONL files as rows of ``text``, ``loss_mask`` and ``segment_ids``.

    files are paths or globs of ``.jsonl`` files; length is the model's window
    (rows hold length + 1 ids, as TokenWindows' do); tokenizer is ``"byte"``,
    a tokenizer folder, a tokenizer.json path or an object with ``encode`` and
    ``eos_id``; chat_template a chat template's text or ``.jinja`` file (a
    tokenizer folder's own is used without it).
    """

    files: str | Sequence[str | os.PathLike[str]]
    length: int = 1024
    tokenizer: Any = "byte"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    template: str = "{prompt}"
    pack: bool = True
    chat_template: str | None = None
    label_key: str | None = None
    rejected_key: str | None = None

    def text_tokenizer(self) -> EosTokenizer:
        """The tokenizer object this reader encodes with (``"byte"`` names ByteTokenizer)."""
        return resolve_tokenizer(self.tokenizer)

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """A template str.format cannot fill, refused from the recipe (``dew train --check``)."""
        problem = _template_problem(fields.get("template", "{prompt}"))
        return [] if problem is None else [(("template",), problem)]

    def __post_init__(self) -> None:
        if not isinstance(self.files, str | os.PathLike):
            object.__setattr__(self, "files", tuple(os.fspath(f) for f in self.files))
        if self.length < 1:
            raise ValueError(f"PromptCompletion.length must be at least 1, got {self.length}.")
        problem = _template_problem(self.template)
        if problem is not None:
            raise ValueError(problem)
        if self.label_key is not None and self.rejected_key is not None:
            raise ValueError("PromptCompletion takes label_key= (KTO's unpaired records) or rejected_key= "
                             "(preference pairs), not both.")

    # -- records -----------------------------------------------------------------------
    def pairs(self) -> Iterator[tuple[str, Turns, Turns, int | None]]:
        """(where, prompt, completion, label) of every record, where being 'file:line'; prompt and
        completion each text, or messages (a conversational record's); label None without label_key."""
        for where, record in json_records(self.files):
            yield (where, self._turns(record, self.prompt_key, where), self._turns(record, self.completion_key, where),
                   self._label(record, where))

    def _turns(self, record: dict[str, Any], key: str, where: str) -> Turns:
        """The text (or messages) under key, checked."""
        if key not in record:
            named = "prompt_key=, completion_key=" + (" and rejected_key=" if self.rejected_key else "")
            alone = (" (prompts alone, for GRPO or PPO to complete, are the prompts reader's)"
                     if key == self.completion_key else "")
            raise MissingKeyError(f"{where} has no text under {key!r} (keys: {sorted(record)}); set {named} to the "
                                  f"keys the records use{alone}.")
        value = record[key]
        if value is None and key != self.prompt_key:  # a completion with no text, as "" is: left out, warned
            return ""
        if isinstance(value, list):  # conversational: messages, checked as the chat readers check them
            return check_messages(value, f"the {key} of {where}")
        if not isinstance(value, str):
            raise MalformedRecordError(
                f"{where} holds a {type(value).__name__} under {key!r} ({json.dumps(value)[:40]}), not text or a "
                'list of messages; write it as a JSON string (in quotes), or as [{"role": "user", "content": "..."}].')
        return value

    def _label(self, record: dict[str, Any], where: str) -> int | None:
        if self.label_key is None:
            return None
        label = record.get(self.label_key)
        if isinstance(label, float) or label not in (True, False, 0, 1):
            raise MalformedRecordError(
                f"{where} holds {json.dumps(label)} under {self.label_key!r} where a label goes: true (a "
                "desirable completion) or false (an undesirable one), or 1 or 0; set label_key= to the key "
                "the records use.")
        return int(label)

    def chat(self) -> ChatTemplate | None:
        """The chat template records are rendered with: chat_template, else the tokenizer folder's;
        None when there is neither (a transformers tokenizer renders its own: see turns)."""
        return reader_chat_template(self.chat_template, self.tokenizer)

    def turns(self, tokenizer: object, prompt: Turns, completion: Turns, where: str,
              chat: ChatTemplate | None) -> tuple[str, str] | None:
        """(prompt, completion) as a chat template renders the record's turns (text is one user turn,
        then one assistant turn); None when no template applies."""
        user = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        reply = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
        both = [*user, *reply]
        if chat is not None:
            head, whole = chat.text(user, add_generation_prompt=True), chat.text(both)
        elif isinstance(tokenizer, _AppliesChatTemplate) and tokenizer.chat_template:
            # A tokenizer from transformers carries its chat template, and renders it itself.
            head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            whole = tokenizer.apply_chat_template(both, tokenize=False, add_generation_prompt=False)
        elif isinstance(prompt, str) and isinstance(completion, str):
            return None
        else:
            raise no_template_for(where, "its turns", self.tokenizer, "the record's prompt and completion")
        if not whole.startswith(head):
            raise ChatTemplateError(
                f"{where}: the chat template renders the user turn with its generation prompt as "
                f"{head[-40:]!r}, which the whole conversation does not start with, so the "
                "completion cannot be told from the prompt. Give chat_template= a template whose "
                "generation prompt begins the assistant's turn.")
        return head, whole[len(head):]

    def encoded(self) -> list[Encoded]:
        """Every record's ids and mask, fitted to a row: a prompt too long loses its first tokens after
        the beginning-of-text id, with a TruncatedWarning counting them."""
        tokenizer = resolve_tokenizer(self.tokenizer)
        chat = self.chat()
        limit = self.length + 1
        out, shortened, first = [], 0, ""
        start = prefix_of(tokenizer)  # the beginning-of-text id a cut prompt keeps
        for where, prompt, completion, label in self.pairs():
            if _says_nothing(completion):
                warnings.warn(f"{where} has an empty (or blank) completion, so it leaves nothing to score; it is "
                              "skipped.", NothingToScoreWarning, stacklevel=2)
                continue
            prompt_ids, completion_ids = self._sides(tokenizer, chat, where, prompt, completion)
            fitted = self._fitted(prompt_ids, len(completion_ids), start, where)
            if len(fitted) < len(prompt_ids):
                shortened, first = shortened + 1, first or where
            prompt_ids = fitted
            ids = np.asarray(prompt_ids + completion_ids, np.int32)
            mask = np.concatenate([np.zeros(len(prompt_ids), np.int32), np.ones(len(completion_ids), np.int32)])
            out.append(Encoded(where, ids, mask, label))
        if shortened:
            _warn_cut(shortened, first, limit, stacklevel=3)
        if not out:
            raise EmptyDatasetError(f"{self.files!r} holds no record with a completion to score.")
        return out

    def _sides(self, tokenizer: EosTokenizer, chat: ChatTemplate | None, where: str, prompt: Turns,
               completion: Turns, *, joined: bool = True) -> tuple[list[int], list[int]]:
        """The prompt's ids and the completion's, with the completion's end.

        joined: the ids of the whole text, split where they leave the prompt's (a token merged
        across the boundary, as "\n" + "\n", goes with the completion), as TRL's SFT tokenizes a
        prompt and its completion; else each side on its own, as TRL's DPO rows are.
        """
        turns = self.turns(tokenizer, prompt, completion, where, chat)
        if turns is not None:
            # A chat template writes its own beginning-of-text token and ends the turn itself.
            head, tail, end = turns[0], turns[1], []
            encoded = _ids
        else:
            # Text starts as transformers starts it (the tokenizer's beginning-of-text id
            # first, where it has one), and the completion ends with the end-of-document id.
            assert isinstance(prompt, str) and isinstance(completion, str)  # turns renders messages
            head, tail, end = self.template.format(prompt=prompt), completion, [int(tokenizer.eos_id)]
            encoded = start_ids
        first = encoded(tokenizer, head)
        if not joined:
            return first, _ids(tokenizer, tail) + end
        whole = encoded(tokenizer, head + tail) + end
        split = next((i for i, (a, b) in enumerate(zip(first, whole, strict=False)) if a != b),
                     min(len(first), len(whole)))
        return whole[:split], whole[split:]

    def _fitted(self, prompt_ids: list[int], completion: int, start: list[int], where: str) -> list[int]:
        """The prompt cut to leave a completion of that many ids room in a row: its front goes, its
        beginning-of-text id stays, as the model expects it; CompletionTooLongError when none fits."""
        limit = self.length + 1
        if completion > limit:
            raise CompletionTooLongError(
                f"{where}: the completion is {completion} tokens with its end (the end-of-document id, or the "
                f"chat template's end of turn), more than a row of length + 1 = {limit} holds. Raise length (the "
                "model's window) or shorten or drop this record.")
        cut = max(0, len(prompt_ids) + completion - limit)
        if not cut:
            return prompt_ids
        keep = min(len(start), limit - completion) if prompt_ids[: len(start)] == start else 0
        return prompt_ids[:keep] + prompt_ids[keep + cut:]

    def preference_rows(self) -> dict[str, np.ndarray]:
        """With rejected_key: chosen and rejected (the prompt's ids and each completion's, padded with
        the end-of-document id to length + 1), their masks over the completions, and prompt_length;
        a prompt too long for the longer side loses its front for both."""
        tokenizer = resolve_tokenizer(self.tokenizer)
        chat, start, width = self.chat(), prefix_of(tokenizer), self.length + 1
        rows: dict[str, list[np.ndarray]] = {"chosen": [], "rejected": [], "chosen_mask": [], "rejected_mask": []}
        lengths, shortened, first = [], 0, ""
        ties, first_tie, empty, first_empty = 0, "", 0, ""
        assert self.rejected_key is not None
        for where, record in json_records(self.files):
            prompt = self._turns(record, self.prompt_key, where)
            given = {name: self._turns(record, key, where)
                     for name, key in (("chosen", self.completion_key), ("rejected", self.rejected_key))}
            if any(_says_nothing(completion) for completion in given.values()):
                empty, first_empty = empty + 1, first_empty or where  # its loss would score the end id alone
                continue
            sides = {name: self._sides(tokenizer, chat, where, prompt, completion, joined=False)
                     for name, completion in given.items()}
            if sides["chosen"][1] == sides["rejected"][1]:
                ties, first_tie = ties + 1, first_tie or where
            head = sides["chosen"][0]
            fitted = self._fitted(head, max(len(tail) for _, tail in sides.values()), start, where)
            if len(fitted) < len(head):
                shortened, first = shortened + 1, first or where
            for name, (_, tail) in sides.items():
                ids = np.full(width, int(tokenizer.eos_id), np.int32)
                mask = np.zeros(width, np.int32)
                ids[: len(fitted) + len(tail)] = fitted + tail
                mask[len(fitted): len(fitted) + len(tail)] = 1
                rows[name].append(ids)
                rows[f"{name}_mask"].append(mask)
            lengths.append(len(fitted))
        if shortened:
            _warn_cut(shortened, first, width, stacklevel=3)
        if empty:
            warnings.warn(f"{empty} preference pair(s) give an empty (or blank) chosen or rejected completion (the first at "
                          f"{first_empty}), which leaves only the end-of-document id to compare; they were left "
                          "out.", NothingToScoreWarning, stacklevel=3)
        if ties:  # kept, so positions and counts stay the records'; a loss gets no gradient from them
            warnings.warn(f"{ties} preference pair(s) give the same chosen and rejected completion (the first "
                          f"at {first_tie}): they prefer nothing, so they teach nothing and hold the "
                          "accuracy down. Drop them from the data.", NothingToScoreWarning, stacklevel=3)
        if not lengths:
            raise EmptyDatasetError(f"{self.files!r} holds no preference pair.")
        return {**{name: np.stack(values) for name, values in rows.items()},
                "prompt_length": np.asarray(lengths, np.int32)}

    def rows(self) -> dict[str, np.ndarray]:
        """text, loss_mask and segment_ids, each [rows, length + 1] int32; with label_key, KTO's
        completion and completion_mask [rows, length + 1], prompt_length and label [rows]; with
        rejected_key, the preference pairs (preference_rows)."""
        if self.rejected_key is not None:
            return self.preference_rows()
        tokenizer = resolve_tokenizer(self.tokenizer)
        if self.label_key is None:
            return packed_rows(self.encoded(), self.length + 1, int(tokenizer.eos_id), pack=self.pack)
        encoded = self.encoded()
        completion = np.full((len(encoded), self.length + 1), int(tokenizer.eos_id), np.int32)
        mask = np.zeros_like(completion)
        for row, record in enumerate(encoded):
            completion[row, : len(record.ids)] = record.ids
            mask[row, : len(record.mask)] = record.mask
        return {"completion": completion, "completion_mask": mask,
                "prompt_length": np.asarray([int(np.argmax(r.mask)) for r in encoded], np.int32),
                "label": np.asarray([r.label for r in encoded], np.int32)}

    def records(self) -> ArrayRecords:
        """The rows as a record source for train_stream."""
        return ArrayRecords(self.rows())

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A Dataset over the rows, a seeded val_fraction of them held out, the rest streamed."""
        train, val = split_records(self.records(), val_fraction, val_seed)
        return record_dataset(train, val, batch=batch, seed=seed, workers=workers, prefetch=prefetch)


def _warn_cut(shortened: int, first: str, limit: int, *, stacklevel: int) -> None:
    warnings.warn(TruncatedWarning(
        f"{shortened} record(s) were longer than a row of length + 1 = {limit} tokens, so their "
        f"prompts lost their first tokens (the first: {first}); the completions are whole. Raise "
        "length to keep the prompts whole."), stacklevel=stacklevel)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer.encode(text)]


def _says_nothing(completion: Turns) -> bool:
    """Whether a completion has no text to learn: text that is empty or blank, or assistant turns all so
    (a blank text and a blank assistant turn are one record written two ways, and are read alike)."""
    if isinstance(completion, str):
        return not completion.strip()
    return not completion or not assistant_speaks(completion)
