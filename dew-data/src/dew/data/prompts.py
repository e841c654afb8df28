"""Prompts: prompt records from JSONL files, for the objectives that sample their own completions.

GRPO and its family, and PPO, read prompts and let a reward score what the
policy writes after them. Each line holds a prompt (``prompt_key``) and,
beside it, whatever the reward reads: every other key of the records rides
along as a column of the batch, which the rollout hands the reward as its
context (``ExactMatch`` reads ``answer``). A column of whole numbers, or of
numbers, stays numbers; any other becomes text (a value's ``str``, a nested
one's JSON), held as its UTF-8 bytes (int32, padded with -1), which the
rewards read back as text. Every record holds the same keys.

A prompt is text, or messages (TRL's conversational prompt-only records: a
system turn, earlier turns), which the chat template renders with its
generation prompt, as the policy is asked to answer (``chat_template``,
else the one a tokenizer folder ships); messages that end with an
assistant's turn are continued from its text instead, as TRL's
``continue_final_message`` does (a prefilled ``<think>``). Each prompt also rides
along as the record gave it, whole (its JSON as text, under ``prompt_given``), so a
reward model of another tokenizer reads the prompt rather than the policy's
rendering of it (a prompt the policy sees cut rides along as null, and the reward
reads what the policy saw). Text starts as transformers'
``tokenizer(text)`` starts it (a beginning-of-text id first, where the
tokenizer adds one), as ``dew generate`` starts a prompt. A prompt longer
than ``length`` tokens keeps its last ones, with a ``TruncatedWarning``.

>>> import json, tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "q.jsonl").write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\\n")
>>> record = Prompts(files=str(folder / "q.jsonl")).records()[0]
>>> record["prompt"][: record["prompt_length"]].tolist(), record["answer"].tolist()
([50, 43, 50, 61], [52])
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dew.data.base import PROMPT_GIVEN, Dataset, EosTokenizer, prefix_of, prompt_ids
from dew.data.chat import TruncatedWarning, check_messages
from dew.data.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    no_template_for,
    reader_chat_template,
)
from dew.data.errors import EmptyDatasetError, MalformedRecordError, MissingKeyError
from dew.data.sources import ArrayRecords, json_records
from dew.data.token_windows import resolve_tokenizer
from dew.data.videos import load_records

__all__ = ["Prompts"]

_RESERVED = ("prompt", "prompt_length", PROMPT_GIVEN)  # the columns the rollout reads the prompts from


@dataclass(frozen=True)
class Prompts:
    """Prompt records from JSONL files, with what a reward reads beside them (see the module docstring).

    files is a glob, a file or a list of them; tokenizer ``"byte"``, a
    tokenizer folder or its tokenizer.json; chat_template a template's text
    or a ``.jinja`` file (a tokenizer folder's own is used without it).
    """

    files: str | Sequence[str]
    tokenizer: Any = "byte"
    prompt_key: str = "prompt"
    length: int = 512
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.files, str | os.PathLike):
            object.__setattr__(self, "files", tuple(os.fspath(f) for f in self.files))
        if self.length < 1:
            raise ValueError(f"Prompts.length must be at least 1, got {self.length}.")

    def text_tokenizer(self) -> EosTokenizer:
        """The tokenizer the prompts are written in (``"byte"`` names ByteTokenizer)."""
        return resolve_tokenizer(self.tokenizer)

    def _lines(self) -> list[tuple[str, dict[str, Any]]]:
        out = list(json_records(self.files))
        if not out:
            raise EmptyDatasetError(f"The prompt files {self.files!r} hold no record.")
        return out

    def _prompt(self, tokenizer: EosTokenizer, chat: ChatTemplate | None, where: str, record: dict[str, Any]) -> list[int]:
        if self.prompt_key not in record:
            raise MissingKeyError(f"{where} has no prompt under {self.prompt_key!r} (keys: {sorted(record)}); set "
                                  "prompt_key= to the key the records use.")
        prompt = record[self.prompt_key]
        if isinstance(prompt, str):
            return prompt_ids(tokenizer, prompt)
        if not isinstance(prompt, list):
            raise MalformedRecordError(f"{where} holds a {type(prompt).__name__} under {self.prompt_key!r}, not "
                                       'text or a list of messages ([{"role": "user", "content": "..."}]).')
        messages = check_messages(prompt, f"the prompt of {where}")
        if chat is None:
            raise no_template_for(where, "its prompt", self.tokenizer, "the prompt")
        # The template writes its own beginning-of-text token and opens the assistant's turn; an
        # assistant's turn the prompt ends with is continued, cut after its text (transformers'
        # continue_final_message, which TRL asks for there).
        final = messages[-1]
        if final.get("role") != "assistant":
            return [int(i) for i in tokenizer.encode(chat.text(messages, add_generation_prompt=True))]
        rendered, content = chat.text(messages), str(final.get("content") or "").strip()
        at = rendered.rfind(content) if content else -1
        if at < 0:
            raise ChatTemplateError(f"{where}: the chat template does not write the prompt's final assistant text "
                                    "as given, so it cannot be continued; end the prompt with a user turn.")
        return [int(i) for i in tokenizer.encode(rendered[: at + len(content)])]

    def records(self) -> ArrayRecords:
        """Every record: ``prompt`` (ids, right-padded with 0), ``prompt_length`` and the other keys."""
        tokenizer = self.text_tokenizer()
        lines = self._lines()
        start = prefix_of(tokenizer)  # the beginning-of-text ids a cut prompt keeps first
        chat = reader_chat_template(self.chat_template, self.tokenizer)  # read and compiled once
        prompts, cut, first, given = [], 0, "", []
        for where, record in lines:
            ids = self._prompt(tokenizer, chat, where, record)
            if not ids:
                raise MalformedRecordError(f"{where} holds an empty prompt, which gives the policy nothing to "
                                           "continue; give it text, or leave the record out.")
            whole = len(ids) <= self.length
            if not whole:
                kept = start if ids[: len(start)] == start else []
                ids = kept + ids[len(ids) - self.length + len(kept):]
                cut, first = cut + 1, first or where
            prompts.append(ids)
            given.append(json.dumps(record[self.prompt_key] if whole else None))
        if cut:
            warnings.warn(TruncatedWarning(
                f"{cut} prompt(s) were longer than length={self.length} tokens and kept their last ones (the "
                f"first: {first}); raise length to keep them whole."), stacklevel=2)
        width = max(len(p) for p in prompts)
        padded = np.zeros((len(prompts), width), np.int32)
        for row, ids in enumerate(prompts):
            padded[row, : len(ids)] = ids
        columns = {"prompt": padded, "prompt_length": np.asarray([len(p) for p in prompts], np.int32)}
        # Each prompt as given (null where the policy sees it cut: a reward reads what the policy saw).
        columns[PROMPT_GIVEN] = _column(given)
        # The prompts as written stand beside their ids, which the position's fingerprint already holds.
        return ArrayRecords({**columns, **_beside(lines, self.prompt_key)}, unhashed=(PROMPT_GIVEN,))

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A shuffled, endless, resumable stream of the records, batch rows at a time, with a seeded
        val_fraction of them held out for validation (none by default)."""
        return load_records(self.records(), batch=batch, seed=seed, val_fraction=val_fraction,
                            val_seed=val_seed, workers=workers, prefetch=prefetch)


def _beside(lines: list[tuple[str, dict[str, Any]]], prompt_key: str) -> dict[str, np.ndarray]:
    """The records' other keys as columns: every record holds each key any record holds."""
    names = list(dict.fromkeys(name for _, record in lines for name in record if name != prompt_key))
    for name in names:
        if name in _RESERVED:
            where = next(where for where, record in lines if name in record)
            raise MalformedRecordError(f"{where} holds {name!r}, a column the rollout fills from the prompt; "
                                       "rename that key in the records.")
    columns: dict[str, np.ndarray] = {}
    for name in names:
        holder = next(where for where, record in lines if name in record)
        values = []
        for where, record in lines:
            if name not in record:
                raise MissingKeyError(f"{where} has no {name!r}, which {holder} holds beside its prompt; give "
                                      "every record the same keys.")
            if record[name] is None:  # its str would reach a reward as the text "None"
                raise MalformedRecordError(f"{where} holds null under {name!r}, where a reward reads text or a "
                                           "number; give it a value, or leave the key out of every record.")
            values.append(record[name])
        columns[name] = _column(values)
    return columns


def _column(values: list[Any]) -> np.ndarray:
    """Whole numbers as int64, numbers as float64, when every value is one (and fits); anything else as
    its text's UTF-8 bytes, padded with -1: a value's str, a nested one's JSON."""
    if all(isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63 for v in values):
        return np.asarray(values, np.int64)
    if all(isinstance(v, float) for v in values):
        return np.asarray(values, np.float64)
    texts = [(json.dumps(v) if isinstance(v, dict | list) else str(v)).encode() for v in values]
    out = np.full((len(texts), max(1, max(len(t) for t in texts))), -1, np.int32)
    for row, text in enumerate(texts):
        out[row, : len(text)] = list(text)
    return out
