"""A Pretrained directory's tokenizer: written beside the weights, read back as dew's own.

A tokenizer that wraps a Hugging Face ``tokenizers.Tokenizer`` (dew-data's
HFTokenizer) is written as ``tokenizer.json``, which transformers reads too.
dew's ByteTokenizer is written as the byte-level ``tokenizer.json`` that
gives every byte its own value as id (and ``<|endoftext|>`` 256), so
transformers encodes text exactly as dew does; config.json also names it
under ``"dew"``, and dew reads it back as a ByteTokenizer. Both are read back
through ``dew.data``, which says what to install when dew-data is absent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILE", "byte_level", "read_tokenizer", "write_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
END_OF_TEXT = "<|endoftext|>"


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


def byte_level(eos_id: int = 256) -> Any:
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


def write_tokenizer(tokenizer: Any, directory: Path) -> dict[str, Any] | None:
    """Write tokenizer into directory; return what config.json records of it (None: nothing)."""
    if tokenizer is None:
        return None
    inner = getattr(tokenizer, "tokenizer", None)  # any tokenizer: HFTokenizer wraps a saveable one
    recorded: dict[str, Any] = {"kind": "file", "eos_id": int(tokenizer.eos_id)}
    if type(tokenizer).__name__ == "ByteTokenizer":
        recorded["kind"] = "byte"
        try:
            inner = byte_level(int(tokenizer.eos_id))
        except ImportError:  # the tokenizers library (dew-data[hf]) is absent: dew alone reads it
            return recorded
    if inner is None or getattr(inner, "save", None) is None:  # a library's tokenizer, or not
        return {"kind": "unsaved",
                "type": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"}
    inner.save(str(directory / TOKENIZER_FILE))
    # transformers' AutoTokenizer then reads the file as it is, adding no tokens of its own.
    settings = {"tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": inner.id_to_token(int(tokenizer.eos_id)),
                "clean_up_tokenization_spaces": False}
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
    return recorded
    return {"kind": "unsaved", "type": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"}


def read_tokenizer(directory: Path, recorded: dict[str, Any] | None, eos_id: int | None) -> Any:
    """The tokenizer saved in directory, or None when it holds none dew can rebuild."""
    import dew.data

    if recorded is not None and recorded.get("kind") == "byte":
        return dew.data.ByteTokenizer()
    file = directory / TOKENIZER_FILE
    if not file.is_file():
        return None
    eos = (recorded or {}).get("eos_id", eos_id)
    token = None
    if eos is not None:
        from tokenizers import Tokenizer

        token = Tokenizer.from_file(str(file)).id_to_token(int(eos))
    return dew.data.HFTokenizer.from_file(file, eos_token=token)
