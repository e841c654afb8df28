"""A Pretrained directory's tokenizer: written beside the weights, read back as dew's own.

A tokenizer that wraps a Hugging Face ``tokenizers.Tokenizer`` (dew-data's
HFTokenizer) is written as ``tokenizer.json``, which transformers reads too.
dew's ByteTokenizer is written as the byte-level ``tokenizer.json`` that
gives every byte its own value as id (and ``<|endoftext|>`` 256), so
transformers encodes text exactly as dew does; config.json also names it
under ``"dew"``, and dew reads it back as a ByteTokenizer. Both are read back
through ``dew.data``, which says what to install when dew-data is absent.

A directory transformers wrote keeps more beside ``tokenizer.json``: the
special tokens, the chat template (in ``tokenizer_config.json`` or its own
``chat_template.jinja``) and the stop ids of ``generation_config.json``.
:class:`TokenizerFiles` keeps those files as they were written and writes
them back unchanged, so an export carries the template a user chats with.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from dew.data.base import NamesSpecialTokens, WithEos, chat_template_of, stop_ids_of

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

    from dew.data.base import Tokenizer

__all__ = ["KEPT_FILES", "TOKENIZER_FILE", "TokenizerFiles", "byte_level", "read_tokenizer",
           "write_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
END_OF_TEXT = "<|endoftext|>"
# Files beside tokenizer.json that say how the tokenizer is used; kept verbatim.
KEPT_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json", "added_tokens.json", "generation_config.json")
# config.json's ids of special tokens (eos_token_id is a list in Llama 3's).
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _content(token: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


@dataclass(frozen=True)
class TokenizerFiles:
    """A Hugging Face directory's tokenizer settings, kept as written.

    texts maps each file of KEPT_FILES that was there to its text; ids holds
    config.json's special-token ids (bos, eos, pad), which an export writes
    back into its config.json.
    """

    texts: Mapping[str, str] = field(default_factory=dict)
    ids: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: Path, config: Mapping[str, Any]) -> TokenizerFiles | None:
        """The settings in directory (None when it holds none of them)."""
        texts = {name: (directory / name).read_text() for name in KEPT_FILES if (directory / name).is_file()}
        ids = {key: config[key] for key in TOKEN_IDS if config.get(key) is not None}
        return cls(texts, ids) if texts or ids else None

    def write(self, directory: Path) -> None:
        """Write every kept file into directory, as it was read."""
        for name, text in self.texts.items():
            (directory / name).write_text(text)

    @property
    def config(self) -> dict[str, Any]:
        """tokenizer_config.json as a mapping ({} when absent)."""
        text = self.texts.get("tokenizer_config.json")
        return json.loads(text) if text else {}

    @property
    def chat_template(self) -> str | None:
        """The chat template the files hold (dew.data.chat_template.template_source; None: none)."""
        from dew.data.chat_template import template_source

        return template_source(self.texts)

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos/eos/pad/unk tokens by name, from tokenizer_config.json or special_tokens_map.json."""
        found: dict[str, str] = {}
        sources = [self.config]
        if "special_tokens_map.json" in self.texts:
            sources.append(json.loads(self.texts["special_tokens_map.json"]))
        for source in sources:
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                token = _content(source.get(key))
                if token is not None:
                    found.setdefault(key, token)
        return found


def _byte_characters() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, as byte-level tokenizers use."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + extra)
            extra += 1
    return characters


def byte_level(eos_id: int = 256) -> HFTokenizer:
    """A ``tokenizers.Tokenizer`` whose id of each byte is the byte, and eos_id ends a document."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {character: byte for byte, character in _byte_characters().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True)])
    if tokenizer.token_to_id(END_OF_TEXT) != eos_id:
        raise ValueError(f"the byte-level tokenizer put {END_OF_TEXT} at "
                         f"{tokenizer.token_to_id(END_OF_TEXT)}, not {eos_id}")
    return tokenizer


@runtime_checkable
class _Saveable(Protocol):
    """A tokenizer the tokenizers library writes as a tokenizer.json (what HFTokenizer wraps)."""

    def save(self, path: str) -> None: ...

    def id_to_token(self, id: int) -> str | None: ...

    def token_to_id(self, token: str) -> int | None: ...


@runtime_checkable
class _Wrapping(Protocol):
    """A tokenizer that wraps another under ``tokenizer`` (HFTokenizer: a tokenizers.Tokenizer)."""

    @property
    def tokenizer(self) -> object: ...


def write_tokenizer(tokenizer: object, directory: Path) -> dict[str, Any] | None:
    """Write tokenizer (one with an eos_id) into directory; return what config.json records of it (None: nothing)."""
    if tokenizer is None:
        return None
    if not isinstance(tokenizer, WithEos) or tokenizer.eos_id is None:
        raise TypeError(f"dew saves a tokenizer with its end-of-document id (eos_id); "
                        f"{type(tokenizer).__name__} names none.")
    inner = tokenizer.tokenizer if isinstance(tokenizer, _Wrapping) else None
    recorded: dict[str, Any] = {"kind": "file", "eos_id": int(tokenizer.eos_id)}
    stops = [i for i in stop_ids_of(tokenizer) if i != int(tokenizer.eos_id)]
    if stops:  # further ids a continuation ends at (an RL policy's stop token): read back with it
        recorded["stop_ids"] = stops
    if type(tokenizer).__name__ == "ByteTokenizer":
        recorded["kind"] = "byte"
        try:
            inner = byte_level(int(tokenizer.eos_id))
        except ImportError:  # the tokenizers library (dew-data[hf]) is absent: dew alone reads it
            return recorded
    if not isinstance(inner, _Saveable):  # a library's tokenizer, or none wrapped
        return {"kind": "unsaved",
                "type": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"}
    inner.save(str(directory / TOKENIZER_FILE))
    # transformers' AutoTokenizer then reads the file as it is, adding no tokens of its own.
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                "eos_token": inner.id_to_token(int(tokenizer.eos_id)),
                                "clean_up_tokenization_spaces": False}
    # The tokenizer folder's special tokens (bos, pad, ...) and chat template, which an export's reader needs.
    named = tokenizer.special_tokens if isinstance(tokenizer, NamesSpecialTokens) else {}
    for key, token in sorted(named.items()):
        if key != "eos_token" and key.endswith("_token") and inner.token_to_id(token) is not None:
            settings[key] = token
    template = chat_template_of(tokenizer)
    if template is not None:
        settings["chat_template"] = template.source
    if recorded["kind"] == "byte":  # dew reads "<|endoftext|>" in a text as its 13 bytes; so does transformers
        settings["split_special_tokens"] = True
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
    return recorded


def read_tokenizer(directory: Path, recorded: dict[str, Any] | None, eos_id: int | None,
                   files: TokenizerFiles | None = None) -> Tokenizer | None:
    """The tokenizer saved in directory, or None when it holds none dew can rebuild.

    Its end-of-document token is the one dew recorded, else the tokenizer's
    own ``eos_token`` (tokenizer_config.json), else config.json's
    eos_token_id (the first, when it is a list). Every id of generation_config.json's
    eos_token_id ends a continuation, or of config.json's where it lists none (HFTokenizer.stop_ids).
    """
    import dew.data

    stops = (recorded or {}).get("stop_ids") or []
    if recorded is not None and recorded.get("kind") == "byte":
        return dew.data.ByteTokenizer().stopping_at(stops)
    file = directory / TOKENIZER_FILE
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        inner = Tokenizer.from_file(str(file))
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        from dew.pretrained.errors import DamagedFileError

        raise DamagedFileError(f"{file} is not a tokenizer the tokenizers library reads ({error}); "
                               "copy the model's tokenizer.json there again.") from None
    token = None
    eos = (recorded or {}).get("eos_id")
    if eos is not None:
        token = inner.id_to_token(int(eos))
    if token is None and files is not None:
        named = files.special_tokens.get("eos_token")
        token = named if named is not None and inner.token_to_id(named) is not None else None
    if token is None and eos_id is not None:
        first = eos_id[0] if isinstance(eos_id, list | tuple) and eos_id else eos_id
        token = inner.id_to_token(int(first)) if isinstance(first, int) else None
    # A continuation ends at any id of generation_config.json's eos_token_id, or of config.json's where
    # it lists none: transformers' generate reads config.json's only to make a missing generation config.
    generation = files.texts.get("generation_config.json") if files is not None else None
    listed = None
    if generation:
        with contextlib.suppress(ValueError, AttributeError):  # transformers itself reads a damaged one
            listed = json.loads(generation).get("eos_token_id")
    tokenizer = dew.data.HFTokenizer.from_file(file, eos_token=token).stopping_at(
        eos_id if listed is None else None, listed, stops)
    if files is None or files.chat_template is None:
        return tokenizer
    from dew.data.chat_template import special_tokens

    return tokenizer.chatting_with(files.chat_template, special_tokens(files.config))
