"""A Hugging Face ``tokenizer.json`` as a dew tokenizer, loaded from a local file.

It has ByteTokenizer's surface (``vocab_size``, ``eos_id``, ``encode``,
``decode``) plus ``encode_batch``, which tokenizes many documents at once in
the tokenizers library's Rust threads. Nothing is fetched from the hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dew.data.base import listed_ids
from dew.data.errors import MissingFileError, MissingKeyError, UnreadableTokenizerError

if TYPE_CHECKING:
    import tokenizers

    from dew.data.chat_template import ChatTemplate

__all__ = ["EOS_CANDIDATES", "HFTokenizer", "vocabulary"]

# Special tokens that end a document in common tokenizer.json files, tried in order.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|im_end|>")


@dataclass(frozen=True)
class HFTokenizer:
    """Wraps a ``tokenizers.Tokenizer``; build it with ``HFTokenizer.from_file``.

    eos_id is the end-of-document id that TokenWindows appends after every
    document: the id of ``eos_token`` when given, else of the first of
    EOS_CANDIDATES the vocabulary holds. stop_ids are further ids that end a
    generated continuation (a model directory's ``eos_token_id`` list); they
    change nothing a reader encodes. chat_source is the chat template a
    tokenizer folder ships (with chat_tokens, the special tokens in its scope),
    compiled on first use as ``chat_template``.
    """

    tokenizer: tokenizers.Tokenizer
    eos_id: int
    fingerprint: str = field(default="", compare=False)
    stop_ids: tuple[int, ...] = field(default=(), compare=False)
    chat_source: str | None = field(default=None, compare=False, repr=False)
    chat_tokens: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, eos_token: str | None = None) -> HFTokenizer:
        """Load a tokenizer.json; MissingFileError, UnreadableTokenizerError or MissingKeyError
        when it cannot serve."""
        from tokenizers import Tokenizer

        file = Path(path)
        if not file.is_file():
            plain = "/" not in os.fspath(path) and "." not in os.fspath(path)  # a name, not a path
            raise MissingFileError(
                f"The tokenizer {os.fspath(path)!r} does not exist. Pass "
                + ("'byte' (dew's byte-level tokenizer, the one name dew knows), " if plain else "")
                + "a checkpoint's folder (its tokenizer.json with tokenizer_config.json, which carries the chat "
                "template and special tokens) or the path of a Hugging Face tokenizer.json (tokenizer.save(path) "
                "writes one)."
            )
        try:
            tokenizer = Tokenizer.from_file(os.fspath(file))
        except Exception as error:  # noqa: BLE001 - the Rust library raises a bare Exception
            raise UnreadableTokenizerError(
                f"The tokenizer file {os.fspath(path)!r} cannot be read as a Hugging Face "
                f"tokenizer.json ({error}). Point it at the tokenizer.json of a Hugging Face "
                f"directory, or write one with tokenizer.save(path)."
            ) from None
        candidates = (eos_token,) if eos_token is not None else EOS_CANDIDATES
        eos_id = next((tokenizer.token_to_id(t) for t in candidates if tokenizer.token_to_id(t) is not None), None)
        if eos_id is None:
            raise MissingKeyError(
                f"The tokenizer {os.fspath(path)!r} has no end-of-document token among "
                f"{list(candidates)}. Name the token that ends a document in its vocabulary: as "
                f"eos_token in a tokenizer_config.json beside it, then give the folder as the "
                f"tokenizer (a recipe's data.tokenizer), or from Python with "
                f"HFTokenizer.from_file(path, eos_token=...)."
            )
        fingerprint = hashlib.sha256(file.read_bytes() + str(eos_id).encode()).hexdigest()
        return cls(tokenizer, int(eos_id), fingerprint)

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """Load a tokenizer directory's tokenizer.json, ending documents with the eos_token its
        tokenizer_config.json names (else the first of EOS_CANDIDATES the vocabulary holds), and
        continuations also at the eos_token_id ids of its generation_config.json (config.json's where it lists
        none, as transformers' generate reads them)."""

        from dew.data.chat_template import template_and_tokens

        folder = Path(path)
        source, tokens = template_and_tokens(folder)  # the template and the special tokens in its scope
        loaded = cls.from_file(folder / "tokenizer.json", eos_token=tokens.get("eos_token")).stopping_with(
            folder, tokens)
        named = dataclasses.replace(loaded, chat_tokens=tuple(sorted(tokens.items())))  # kept for an export
        return named if source is None else named.chatting_with(source, tokens)

    def stopping_with(self, folder: str | os.PathLike[str], tokens: Mapping[str, str] | None = None) -> HFTokenizer:
        """This tokenizer, ending continuations also where its folder's checkpoint ends them: at the
        eos_token its tokenizer_config.json names (a chat model's end of turn) and the eos_token_id
        ids of its generation_config.json (config.json's where it lists none). A tokenizer.json given alone stops where
        the folder it sits in says, as the folder given does; its end-of-document id stays its own.
        tokens are the folder's special tokens where the caller has read them already."""
        import json

        from dew.data.chat_template import template_and_tokens

        folder = Path(folder)
        named = (template_and_tokens(folder)[1] if tokens is None else tokens).get("eos_token")
        listed: list[object] = [] if named is None else [self.tokenizer.token_to_id(named)]
        for name in ("generation_config.json", "config.json"):  # config.json's only where the first lists none,
            with contextlib.suppress(OSError, ValueError, AttributeError):  # as transformers' generate reads them
                ids = json.loads((folder / name).read_text(encoding="utf-8")).get("eos_token_id")
                if ids is not None:
                    listed.append(ids)
                    break
        return self.stopping_at(*listed)

    @property
    def special_tokens(self) -> dict[str, str]:
        """The special tokens (bos, eos, pad, unk) its folder's tokenizer_config.json names, which an
        export writes back beside tokenizer.json ({} for a tokenizer.json given alone)."""
        return dict(self.chat_tokens)

    def chatting_with(self, source: str, special_tokens: Mapping[str, str]) -> HFTokenizer:
        """This tokenizer with a chat template's text (and the special tokens in its scope)."""
        return dataclasses.replace(self, chat_source=source, chat_tokens=tuple(sorted(special_tokens.items())))

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The chat template the tokenizer's folder ships, compiled in jinja's sandbox (None: none)."""
        if self.chat_source is None:
            return None
        from dew.data.chat_template import ChatTemplate

        return ChatTemplate(self.chat_source, dict(self.chat_tokens))

    def stopping_at(self, *listed: object) -> HFTokenizer:
        """This tokenizer, ending continuations also at the ids listed (eos_token_id values: an id
        or a list of them; what is not an id is left out). An id may lie past the tokenizer's own
        vocabulary, in the model's padded one, as transformers' generate stops there too."""
        stops = tuple(dict.fromkeys(i for i in [*self.stop_ids, *listed_ids(*listed)] if i != self.eos_id))
        return dataclasses.replace(self, stop_ids=stops)

    @cached_property
    def prefix(self) -> tuple[int, ...]:
        """The ids this tokenizer.json's post-processor puts before a text (Llama's and Gemma's
        beginning-of-text id; none for Qwen's): what dew.data.base.prompt_ids starts a prompt with."""
        plain = list(self.tokenizer.encode("a", add_special_tokens=False).ids)
        marked = list(self.tokenizer.encode("a", add_special_tokens=True).ids)
        for start in range(len(marked) - len(plain) + 1):
            if marked[start:start + len(plain)] == plain:
                return tuple(int(i) for i in marked[:start])
        return ()

    @property
    def vocab_size(self) -> int:
        """The number of ids, special tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_eos: bool = False) -> list[int]:
        """The ids of text (no special tokens added), followed by eos_id when add_eos."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return ids + [self.eos_id] if add_eos else ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of text and each token's character span [start, end) in it."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [(int(start), int(end)) for start, end in encoding.offsets]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ids of many documents at once, each as an int32 array (no eos)."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text the ids spell, skipping special tokens."""
        return self.tokenizer.decode(_listed(ids), skip_special_tokens=True)

    def decode_verbatim(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text the ids spell with their special tokens (a chat template's markers), as
        transformers' decode gives it by default; encode reads them back to the same ids."""
        return self.tokenizer.decode(_listed(ids), skip_special_tokens=False)


def _listed(ids: Iterable[int] | np.ndarray) -> list[int]:
    flat = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids)).reshape(-1)
    return [int(i) for i in flat]


def vocabulary(tokenizer: object) -> dict[str, int] | None:
    """The id a library tokenizer (an HFTokenizer, or a ``tokenizers.Tokenizer``) gives each token,
    added ones included; None for any other. Two tokenizers spell text as the same ids when these
    are equal (two of the same size can differ, as Llama 2's and Mistral's do)."""
    from tokenizers import Tokenizer

    inner = tokenizer.tokenizer if isinstance(tokenizer, HFTokenizer) else tokenizer
    return dict(inner.get_vocab(with_added_tokens=True)) if isinstance(inner, Tokenizer) else None
