"""The text of a continuation as it reads after its prompt.

A tokenizer whose decoder strips one leading space (Llama 2's and
Mistral's SentencePiece ``tokenizer.json``: ``▁the`` decodes to ``the`` at the
start of a text) drops the space between a prompt and its continuation when
the continuation is decoded alone. The continuation is read instead as the
text the prompt's last tokens and it decode to, past what those tokens decode
to alone, as transformers' text-generation pipeline reads it.

>>> words = {1: "▁def", 2: "▁x"}
>>> decode = lambda ids: "".join(words[i] for i in ids).replace("▁", " ").removeprefix(" ")
>>> decode([2, 2]), continued(decode, [1], [2, 2])
('x x', ' x x')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["continued", "reader"]

CONTEXT = 16  # the prompt's last tokens a continuation is decoded after


def reader(decode: Callable[[Sequence[int]], str], prompt: Sequence[int]) -> Callable[[Sequence[int]], str]:
    """A continuation's text after prompt (see continued), the prompt's last tokens decoded once for
    every continuation read (a stop-string check reads one at every decode call)."""
    context = [int(i) for i in prompt[-CONTEXT:]]
    head = decode(context) if context else ""

    def text(generated: Sequence[int]) -> str:
        if not generated:
            return ""
        if not context:
            return decode(list(generated))
        whole = decode([*context, *generated])
        return whole[len(head):] if whole.startswith(head) else decode(list(generated))

    return text


def continued(decode: Callable[[Sequence[int]], str], prompt: Sequence[int], generated: Sequence[int]) -> str:
    """generated's text after prompt: decoded after the prompt's last tokens, less their own text.

    Where the two do not decode to a prefix of one text (a character whose bytes the prompt's
    tokens split), generated is decoded alone.
    """
    return reader(decode, prompt)(generated)
