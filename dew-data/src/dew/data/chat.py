"""Chat and ChatPreferences: conversations rendered with the model's own chat template.

A conversation is a ``messages`` list of ``{"role", "content"}`` records
(roles ``system``, ``user``, ``assistant`` and ``tool``; an assistant turn
may carry ``tool_calls`` instead of content), one per JSONL line or per row
of a Parquet or Arrow shard. Each is rendered with the tokenizer's chat
template (``dew.data.chat_template``: sandboxed Jinja), tokenized whole, and
scored only where the assistant wrote (``loss_mask``), as transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks it.

``Chat`` packs the conversations end to end into rows of ``length + 1`` ids
with ``segment_ids`` (1, 2, ... per conversation; 0 marks padding), like
PromptCompletion, for LMObjective. A conversation longer than a row keeps
its first ``length + 1`` tokens (one warning counts them).

``ChatPreferences`` reads preference pairs for DPO and the post-training
objectives: ``chosen`` and ``rejected`` conversations (each whole, or
continuing a shared ``prompt`` list of messages), one pair per row:
``chosen``, ``rejected`` (right-padded ids), their masks (the assistant's
tokens after the shared prompt) and ``prompt_length`` (the tokens the two
share from the start).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from dew.data.base import Dataset, EosTokenizer
from dew.data.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    given_chat_template,
    read_chat_template,
)
from dew.data.errors import EmptyDatasetError, MalformedRecordError
from dew.data.packing import packed_rows
from dew.data.shards import Shards, expand_shards
from dew.data.sources import ArrayRecords
from dew.data.stream import record_dataset
from dew.data.token_windows import resolve_tokenizer, split_records

__all__ = ["ROLES", "Chat", "ChatPreferences", "ChatRecordError", "Conversation", "TruncatedWarning", "assistant_speaks"]


class _EncodesOffsets(Protocol):
    """What a chat reader asks of its tokenizer: ids and the character span each id covers."""

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

ROLES = ("system", "user", "assistant", "tool")


class ChatRecordError(MalformedRecordError):
    """A conversation record is not a list of messages with known roles."""


class TruncatedWarning(UserWarning):
    """Conversations longer than a row were cut to fit it."""


@dataclass(frozen=True)
class Conversation:
    """One rendered conversation: its ids and the mask of the assistant's tokens, and where it came from."""

    where: str
    ids: np.ndarray
    mask: np.ndarray


def check_messages(messages: object, where: str) -> list[dict[str, Any]]:
    """The messages as plain dicts (keys whose value is null dropped), or ChatRecordError naming where."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatRecordError(f"{where} holds {type(messages).__name__} {str(messages)[:60]!r} where a "
                              "conversation goes; a conversation is a non-empty list of messages.")
    out = []
    for number, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatRecordError(f"Message {number} of {where} is a {type(message).__name__}, not a "
                                  "{role, content} object.")
        role = message.get("role")
        if role not in ROLES:
            raise ChatRecordError(
                f"Message {number} of {where} has role {role!r}; the roles are {', '.join(ROLES)}. "
                "Rename the role, or drop the message.")
        content = message.get("content")
        if content is not None and not isinstance(content, str):  # a list of parts, a number: not text
            raise ChatRecordError(
                f"Message {number} of {where} has content of type {type(content).__name__} "
                f"({str(content)[:60]!r}); a message's content is text. Give it as a string (the text "
                "parts of a list joined).")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def assistant_speaks(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether an assistant turn of messages says something to learn: text, or a tool call. Turns
    that are all empty would train on the end-of-turn token alone."""
    return any(m.get("role") == "assistant" and (str(m.get("content") or "").strip() or m.get("tool_calls"))
               for m in messages)


@dataclass(frozen=True)
class _ChatFiles:
    """What both chat readers share: the files, the tokenizer and its template."""

    files: str | Sequence[str]
    tokenizer: object  # "byte", a tokenizer folder or file, or a tokenizer object: resolve_tokenizer's
    chat_template: str | None
    length: int

    @cached_property
    def _tokenizer(self) -> EosTokenizer:
        # A tokenizer.json given without chat_template= names the folder the template is read from:
        # the tokenizer is read with that folder's end tokens too, so the run stops where the
        # template ends a turn (<|eot_id|>), not at the end-of-text token alone.
        given = self.tokenizer
        if self.chat_template is None and isinstance(given, str | os.PathLike) \
                and Path(given).expanduser().name == "tokenizer.json" and Path(given).expanduser().is_file():
            given = Path(given).expanduser().parent
        return resolve_tokenizer(given)

    def text_tokenizer(self) -> EosTokenizer:
        """The tokenizer object this reader encodes with."""
        return self._tokenizer

    @cached_property
    def template(self) -> ChatTemplate:
        """The chat template: chat_template (its text, or a .jinja file) or the tokenizer's own."""
        if self.chat_template is not None:
            return given_chat_template(self.chat_template, self.tokenizer)
        if not isinstance(self.tokenizer, str | os.PathLike) or os.fspath(self.tokenizer) == "byte":
            raise MalformedRecordError(
                "This chat reader's tokenizer carries no chat template; give tokenizer= the folder of "
                "a model's tokenizer (tokenizer.json and tokenizer_config.json), or chat_template=.")
        return read_chat_template(self.tokenizer)

    def column(self, key: str) -> tuple[Shards, list[Any]]:
        shards = Shards(expand_shards(self.files), key)
        return shards, shards.values(0, len(shards))

    def prompt_ids(self, messages: list[dict[str, Any]], where: str) -> np.ndarray:
        """The ids of messages as a prompt the model answers: rendered with the generation prompt."""
        tokenizer = cast(_EncodesOffsets, self.text_tokenizer())
        with _naming(where):
            text = self.template.text(messages, add_generation_prompt=True)
        return np.asarray(tokenizer.encode_offsets(text)[0], np.int32)

    def encode(self, messages: list[dict[str, Any]], where: str) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's ids and its assistant mask."""
        # resolve_tokenizer's own (ByteTokenizer, HFTokenizer) encode offsets; an object given must too
        tokenizer = cast(_EncodesOffsets, self.text_tokenizer())
        with _naming(where):
            rendered = self.template.render(messages)
        ids, offsets = tokenizer.encode_offsets(rendered.text)
        from dew.data.chat_template import assistant_mask

        return np.asarray(ids, np.int32), assistant_mask(offsets, rendered.spans)


@contextlib.contextmanager
def _naming(where: str) -> Iterator[None]:
    """A template's refusal of a record names the record (its file and row), so it can be found."""
    try:
        yield
    except ChatTemplateError as error:
        raise ChatTemplateError(f"{error} (the conversation in {where})") from None


def _warn_unscored(count: int, first: str, why: str, what: str = "conversation(s)") -> None:
    """Say how many records were left out with nothing to score, and where the first is."""
    if count:
        from dew.data.prompt_completion import NothingToScoreWarning

        warnings.warn(NothingToScoreWarning(f"{count} {what} {why} (the first: {first}), so they were left out."),
                      stacklevel=3)


def _warn_truncated(count: int, first: str, limit: int, stacklevel: int = 3, *, dropped: int = 0,
                    what: str = "conversation(s)") -> None:
    """Say how many records a row's limit cut, and how many of those it left nothing to score."""
    if count:
        left = (f"; {dropped} of them kept no assistant token to score within it and were left out"
                if dropped else "")
        warnings.warn(TruncatedWarning(
            f"{count} {what} were longer than a row of length + 1 = {limit} tokens and were cut to fit "
            f"it (the first: {first}){left}. Raise length to keep them whole."), stacklevel=stacklevel)


class _ChatReader:
    """What Chat and ChatPreferences share: their files settled, one _ChatFiles, its tokenizer, and
    their rows as records and as a Dataset."""

    files: str | Sequence[str]
    tokenizer: object
    chat_template: str | None
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.files, str | os.PathLike):
            object.__setattr__(self, "files", tuple(os.fspath(f) for f in self.files))
        if self.length < 1:
            raise ValueError(f"{type(self).__name__}.length must be at least 1, got {self.length}.")

    @cached_property
    def _shared(self) -> _ChatFiles:
        return _ChatFiles(self.files, self.tokenizer, self.chat_template, self.length)

    def text_tokenizer(self) -> EosTokenizer:
        """The tokenizer object this reader encodes with."""
        return self._shared.text_tokenizer()

    def rows(self) -> dict[str, np.ndarray]:
        """The encoded records as columns of equal length (each reader's own layout)."""
        raise NotImplementedError

    def records(self) -> ArrayRecords:
        """The rows (Chat's packed conversations, ChatPreferences' pairs) as a record source for
        train_stream (and a mixture)."""
        return ArrayRecords(self.rows())

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A Dataset over the rows, a seeded val_fraction of them held out, the rest streamed."""
        train, val = split_records(self.records(), val_fraction, val_seed)
        return record_dataset(train, val, batch=batch, seed=seed, workers=workers, prefetch=prefetch)


@dataclass(frozen=True)
class Chat(_ChatReader):
    """Conversations as packed rows of ``text``, ``loss_mask`` and ``segment_ids``.

    files are ``.jsonl``, ``.parquet`` or ``.arrow`` shards (paths, globs or
    folders) with a ``messages_key`` column; tokenizer is a model's tokenizer
    folder (its chat template is used) or a tokenizer.json; chat_template
    overrides the template (its text, or a ``.jinja`` file); length is the
    model's window.
    """

    files: str | Sequence[str]
    tokenizer: Any
    chat_template: str | None = None
    length: int = 1024
    messages_key: str = "messages"
    pack: bool = True

    def conversations(self) -> Iterator[tuple[str, list[dict[str, Any]]]]:
        """(where, messages) of every record, checked."""
        shards, values = self._shared.column(self.messages_key)
        for row, messages in enumerate(values):
            where = shards.where(row)
            yield where, check_messages(messages, where)

    def encoded(self) -> list[Conversation]:
        """Every conversation's ids and assistant mask, cut to a row."""
        limit = self.length + 1
        out, cut, first, dropped = [], 0, "", 0
        empty, first_empty = 0, ""
        for where, messages in self.conversations():
            ids, mask = self._shared.encode(messages, where)
            whole = bool(mask.any()) and assistant_speaks(messages)
            if not whole:  # no assistant turn, or only empty ones
                empty, first_empty = empty + 1, first_empty or where
            if len(ids) > limit:
                cut, first = cut + 1, first or where
                ids, mask = ids[:limit], mask[:limit]
                dropped += int(whole and not mask.any())
            if whole and mask.any():
                out.append(Conversation(where, ids, mask))
        _warn_truncated(cut, first, limit, dropped=dropped)
        _warn_unscored(empty, first_empty, "hold no assistant turn with text to score")
        if not out and dropped:  # every scored turn lay past the row: the window is the cause, not the data
            raise EmptyDatasetError(
                f"{self.files!r} holds no conversation whose assistant turns begin within a row of "
                f"{limit} tokens: {dropped} lost every turn they score when cut to it (the first {first}). "
                "Raise length (the model's window), or shorten the conversations.")
        if not out:
            raise EmptyDatasetError(f"{self.files!r} holds no conversation with an assistant turn to score.")
        return out

    def rows(self) -> dict[str, np.ndarray]:
        """text, loss_mask and segment_ids, each [rows, length + 1] int32."""
        tokenizer = self.text_tokenizer()
        return packed_rows(self.encoded(), self.length + 1, int(tokenizer.eos_id), pack=self.pack)


@dataclass(frozen=True)
class ChatPreferences(_ChatReader):
    """Preference pairs of conversations as rows for DPO (see the module docstring).

    Each record holds ``chosen_key`` and ``rejected_key`` message lists, and
    optionally ``prompt_key``, a list both continue (or a text: see ``_prompt``); the rows are named
    ``chosen`` and ``rejected`` whatever the keys. A pair with a side that says nothing is left out.
    """

    files: str | Sequence[str]
    tokenizer: Any
    chat_template: str | None = None
    length: int = 1024
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    prompt_key: str = "prompt"

    def pairs(self) -> Iterator[tuple[str, list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]]:
        """(where, prompt, chosen messages, rejected messages) of every record, the prompt prepended
        to both sides; without a prompt_key, the prompt is the messages both sides open with."""
        shards = Shards(expand_shards(self.files), self.chosen_key)
        rejected = Shards(expand_shards(self.files), self.rejected_key).values(0, len(shards))
        prompts = Shards(expand_shards(self.files), self.prompt_key, optional=True).values(0, len(shards))
        for row, chosen in enumerate(shards.values(0, len(shards))):
            where = shards.where(row)
            if isinstance(chosen, str):  # TRL's standard (text) preference records: another reader's
                raise ChatRecordError(
                    f"{where} holds text under {self.chosen_key!r}, where chat_preferences reads a conversation; "
                    "for text pairs use prompt_completion with completion_key: chosen and rejected_key: rejected.")
            prompt = self._prompt(prompts[row], chosen, where)
            a = prompt + check_messages(chosen, f"the chosen side of {where}")
            b = prompt + check_messages(rejected[row], f"the rejected side of {where}")
            shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            yield where, a[:max(shared, len(prompt))], a, b

    @staticmethod
    def _prompt(given: Any, chosen: Any, where: str) -> list[dict[str, Any]]:
        """The messages a record's prompt adds before both sides. A text prompt beside conversations
        that hold the user's turn already (UltraFeedback's layout) is a copy of it and adds nothing,
        as TRL reads it; beside the assistant's turns alone, it is the user's turn."""
        if given is None:
            return []
        if isinstance(given, str):
            sides = check_messages(chosen, f"the chosen side of {where}")
            return [] if any(m["role"] != "assistant" for m in sides) else [{"role": "user", "content": given}]
        return check_messages(given, f"the prompt of {where}")

    def rows(self) -> dict[str, np.ndarray]:
        """chosen, rejected, chosen_mask, rejected_mask [pairs, length + 1] and prompt_length [pairs]."""
        limit = self.length + 1
        kept, cut, first, dropped = [], 0, "", 0
        same, first_same = 0, ""
        for where, prompt, chosen, rejected in self.pairs():
            sides = [self._shared.encode(messages, where) for messages in (chosen, rejected)]
            asked = self._shared.prompt_ids(prompt, where) if prompt else np.zeros(0, np.int32)
            long = any(len(ids) > limit for ids, _ in sides)
            if long:
                cut, first = cut + 1, first or where
                sides = [(ids[:limit], mask[:limit]) for ids, mask in sides]
            (a, _), (b, _) = sides
            if all(len(ids) >= len(asked) and np.array_equal(ids[: len(asked)], asked) for ids in (a, b)):
                common = len(asked)  # the prompt as the model is asked it: the generation prompt ends it
            else:  # a template that renders the prompt otherwise inside the conversation: shared tokens
                common = int(np.argmin(np.append(a[: len(b)] == b[: len(a)], False)))
            masks = [np.where(np.arange(len(mask)) >= common, mask, 0) for _, mask in sides]
            speaks = all(assistant_speaks(messages[len(prompt):]) for messages in (chosen, rejected))
            if speaks and all(m.any() for m in masks):
                kept.append((sides, masks, common))
            elif long and speaks:
                dropped += 1
            else:  # the two sides the same after the prompt (or one with no assistant text)
                same, first_same = same + 1, first_same or where
        _warn_truncated(cut, first, limit, stacklevel=2, dropped=dropped, what="preference pair(s)")
        _warn_unscored(same, first_same, "have no assistant text on one side that differs from the other",
                       "preference pair(s)")
        if not kept:
            raise EmptyDatasetError(f"{self.files!r} holds no preference pair with assistant tokens to score.")
        # The rows keep DPO's names whatever the records call their sides (prompt_completion's too).
        out = {name: np.zeros((len(kept), limit), np.int32)
               for name in ("chosen", "rejected", "chosen_mask", "rejected_mask")}
        lengths = np.zeros(len(kept), np.int32)
        for i, (sides, masks, common) in enumerate(kept):
            for name, (ids, _), mask in zip(("chosen", "rejected"), sides, masks, strict=True):
                out[name][i, : len(ids)] = ids
                out[f"{name}_mask"][i, : len(mask)] = mask
            lengths[i] = common
        return {**out, "prompt_length": lengths}
