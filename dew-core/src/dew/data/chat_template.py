"""A model's chat template, rendered in a sandbox, with the spans the assistant generates.

A chat template is a Jinja program shipped with a tokenizer (``chat_template``
in ``tokenizer_config.json``, or a ``chat_template.jinja`` file beside it)
that turns a list of messages into the text the model reads. It comes with
the model, from whoever published it, so it runs in Jinja's
``ImmutableSandboxedEnvironment``, as transformers runs it, with the same
helpers (``raise_exception``, ``strftime_now``, a ``tojson`` that does not
escape HTML) and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) in scope.

Which characters the assistant wrote: templates that mark them with
``{% generation %}...{% endgeneration %}`` say so directly, and the spans are
recorded while rendering (as transformers' ``return_assistant_tokens_mask``
does). For templates without markers, each assistant turn's span is found by
rendering the conversation up to it with the generation prompt and up to its
end: what lies between is the turn. A template that rewrites earlier turns
(so one rendering is not a prefix of the next) is refused by name.

Tokens are then scored (``mask``) when they overlap an assistant span, using
the tokenizer's character offsets over the whole rendered text, exactly as
transformers computes its assistant mask.

>>> template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}"
...                         "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}"
...                         "{% endif %}{% endfor %}")
>>> rendered = template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
>>> rendered.text, rendered.spans
('<user>hi<assistant>yo', ((19, 21),))
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.data.errors import DataError, MissingFileError

if TYPE_CHECKING:
    import jinja2
    import jinja2.nodes
    import jinja2.parser

_Track = Callable[[list[str], list[tuple[int, int]]], AbstractContextManager[None]]

__all__ = ["TEMPLATE_FILES", "ChatTemplate", "ChatTemplateError", "Rendered", "assistant_mask", "chat_template_in",
           "given_chat_template", "no_template_for", "read_chat_template", "reader_chat_template", "special_tokens",
           "template_and_tokens", "template_source", "tokens_beside"]

# The files of a tokenizer folder a chat template is read from, in the order they are tried.
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")

_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_LONGEST = 1 << 24  # the most items a template may build by repetition (a rendered chat is far shorter)
# The widths and precisions a %-format or a str.format field asks for: '%20000000d', '{:>20000000}'.
_PERCENT = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d*))?")
_BRACED = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _too_wide(text: str) -> bool:
    """Whether a format string asks for a field wider than _LONGEST (its digits read as text first)."""
    numbers = [n for pair in _PERCENT.findall(text) for n in pair if n]
    numbers += [n for spec in _BRACED.findall(text) for n in re.findall(r"\d+", spec)]
    return any(len(n) > 9 or int(n) > _LONGEST for n in numbers)


class ChatTemplateError(DataError, ValueError):
    """A chat template is missing, fails to render a conversation, or cannot mark assistant turns."""


@dataclass(frozen=True)
class Rendered:
    """A conversation as text, and the character spans [start, end) the assistant wrote."""

    text: str
    spans: tuple[tuple[int, int], ...]


def _environment() -> tuple[jinja2.Environment, _Track]:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tracking: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("dew_generation",
                                                                                       default=None)

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: record where its output lands."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller: Callable[[], str]) -> str:
            text = caller()
            state = tracking.get()
            if state is not None:
                blocks, spans = state
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def check_sizes(what: str, values: Iterable[Any]) -> None:
        """Refuse a number past _LONGEST among values, or a format asking for a field that wide: padding
        (``'x'.ljust(n)``, ``center(n)``, ``'%*d'``, ``'{:>n}'``) builds strings as long as its number."""
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _LONGEST:
                raise jinja2.sandbox.SecurityError(f"the template gives {what} the number {value}, more than "
                                                   f"the {_LONGEST} dew renders")
            if isinstance(value, str) and _too_wide(value):
                raise jinja2.sandbox.SecurityError(f"the template formats with {what} a field wider than the "
                                                   f"{_LONGEST} characters dew renders")

    class Bounded(ImmutableSandboxedEnvironment):
        """jinja2's sandbox, with repetition, powers and padding bounded: a checkpoint's template is
        another's text, and ``{{ 'x' * 3000000000 }}`` or ``{{ 'x'.ljust(3000000000) }}`` asks for
        gigabytes in a few bytes."""

        intercepted_binops = frozenset({"*", "**", "%"})

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's
            check_sizes(getattr(__obj, "__name__", "a call"),  # any callable: its name for the message
                        [getattr(__obj, "__self__", None), *args, *kwargs.values()])
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj: Any, attribute: str) -> Any:
            if isinstance(obj, str) and attribute in ("format", "format_map"):  # the sandbox wraps these itself
                check_sizes(attribute, [obj])
            return super().getattr(obj, attribute)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "%":
                check_sizes("%", [left, *(right if isinstance(right, tuple) else (right,))])
            sized = (str, list, tuple)
            if operator == "*" and isinstance(right, int) and isinstance(left, sized):
                left, right = right, left
            if operator == "*" and isinstance(left, int) and isinstance(right, sized) \
                    and left * len(right) > _LONGEST:
                raise jinja2.sandbox.SecurityError(f"the template repeats a value to {left * len(right)} "
                                                   f"items, more than the {_LONGEST} dew renders")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) \
                    and right * max(abs(left), 2).bit_length() > 8 * _LONGEST:
                raise jinja2.sandbox.SecurityError(f"the template raises {left} to the power {right}, a "
                                                   "number larger than dew renders")
            return super().call_binop(context, operator, left, right)

    environment = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = tojson

    def bounded(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            check_sizes(f"the filter {name}", [*args, *kwargs.values()])
            return function(*args, **kwargs)
        return checked

    # Filters are called directly, not through the sandbox's call: each one is bounded as a call is.
    environment.filters = {name: bounded(name, f) for name, f in environment.filters.items()}
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    @contextmanager
    def track(blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
        token = tracking.set((blocks, spans))
        try:
            yield
        finally:
            tracking.reset(token)

    return environment, track


class ChatTemplate:
    """A Jinja chat template compiled in a sandbox; ``render`` a list of messages.

    special_tokens (``{"eos_token": "<|im_end|>", ...}``) are in the
    template's scope, as transformers puts its tokenizer's there.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("A chat template is a non-empty Jinja string.")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._compile()

    def _compile(self) -> None:
        import jinja2

        environment, self._track = _environment()
        try:
            self._template = environment.from_string(self.source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(f"The chat template does not parse: {error.message} (line {error.lineno}).") \
                from None

    def __getstate__(self) -> tuple[str, dict[str, str]]:
        return self.source, self.special_tokens

    def __setstate__(self, state: tuple[str, dict[str, str]]) -> None:
        self.source, self.special_tokens = state
        self._compile()

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's text with ``{% generation %}``."""
        return bool(_MARKER.search(self.source))

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                context: Mapping[str, object]) -> tuple[str, list[tuple[int, int]]]:
        import jinja2

        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            with self._track(blocks, spans):
                for block in self._template.generate(messages=list(messages),
                                                     add_generation_prompt=add_generation_prompt,
                                                     **{**self.special_tokens, **context}):
                    blocks.append(block)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"The chat template refused the conversation: {error}") from None
        return "".join(blocks), spans

    def text(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
             **context: object) -> str:
        """The conversation as the model reads it."""
        return self._render(messages, add_generation_prompt, context)[0]

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
               **context: object) -> Rendered:
        """The text and the assistant's spans (see the module docstring)."""
        text, spans = self._render(messages, add_generation_prompt, context)
        if self.marks_generation:
            return Rendered(text, tuple(spans))
        found = []
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self._render(messages[:index], True, context)[0]
            through = self._render(messages[: index + 1], False, context)[0]
            asked = self._render(messages[: index + 1], True, context)[0]
            ignores_prompt = asked == through  # the template writes no generation prompt
            if not asked.startswith(through):
                # A template that closes a conversation it is not asked to continue with a special
                # token (Phi-3's eos_token): the turn is what comes before it.
                ending = next((token for token in self.special_tokens.values() if token
                               and through.endswith(token) and asked.startswith(through[: -len(token)])), "")
                through = through[: len(through) - len(ending)]
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatTemplateError(
                    "This chat template has no {% generation %} markers and renders the earlier turns "
                    f"of a conversation otherwise once assistant message {index} follows them (Qwen 3's "
                    "drops the reasoning of all but the last assistant turn), so where each assistant "
                    "turn lies in the whole cannot be found. Give the reader chat_template=, a template "
                    "that wraps each assistant turn in {% generation %}...{% endgeneration %} (as TRL's "
                    "training templates do), or train on conversations of one assistant turn."
                )
            start, end = len(before), len(through)
            content = message.get("content")
            if index and ignores_prompt and isinstance(content, str) and content:
                # The template ignores add_generation_prompt, so the turn's own header (ChatML's
                # <|im_start|>assistant) follows the prompt: the assistant's text starts at its content.
                start = max(start, through.find(content, start))
            found.append((start, end))
        return Rendered(text, tuple(found))


def assistant_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap an assistant span (transformers' rule)."""
    mask = np.zeros(len(offsets), np.int32)
    span = 0
    for token, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[token] = 1
    return mask


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens a tokenizer_config.json names (``bos_token``, ``eos_token``, ...), as text."""
    out = {}
    for name in _SPECIAL:
        text = _token_text(config.get(name))
        if text is not None:
            out[name] = text
    return out


def tokens_beside(tokenizer: object) -> dict[str, str]:
    """The special tokens of the tokenizer_config.json beside a tokenizer path (its folder, or the
    folder of its tokenizer.json); {} for "byte", a tokenizer object, or a folder without one."""
    if not isinstance(tokenizer, str | os.PathLike) or os.fspath(tokenizer) == "byte":
        return {}
    path = Path(tokenizer).expanduser()
    config = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
    return special_tokens(json.loads(config.read_text(encoding="utf-8"))) if config.is_file() else {}


def given_chat_template(given: str, tokenizer: object) -> ChatTemplate:
    """A reader's ``chat_template`` field: a ``.jinja`` file, or the template's own text, with the
    special tokens of the tokenizer_config.json beside the reader's tokenizer. A value without any
    Jinja (``{{ }}`` or ``{% %}``) is a file's path: one that names no file is refused, where it was
    rendered as a template of constant text (every record the same, and nothing to score)."""
    path = os.path.expanduser(given)
    if given.endswith(".jinja") and os.path.isfile(path):
        return read_chat_template(given)
    if "{{" not in given and "{%" not in given:
        if not os.path.isfile(path):
            raise MissingFileError(
                f"chat_template {given!r} names no file (a relative path starts at {os.getcwd()}) and holds no "
                "Jinja ({{ }} or {% %}) to be a template's own text; give the path of a .jinja file, or the "
                "template's text.")
        return ChatTemplate(Path(path).read_text(encoding="utf-8"), tokens_beside(tokenizer))
    return ChatTemplate(given, tokens_beside(tokenizer))


def reader_chat_template(given: str | None, tokenizer: object) -> ChatTemplate | None:
    """The template a reader renders its records with: its chat_template field, else the one its
    tokenizer folder ships; None when there is neither (a tokenizer.json alone names no template)."""
    if given is not None:
        return given_chat_template(given, tokenizer)
    if isinstance(tokenizer, str | os.PathLike) and Path(tokenizer).expanduser().is_dir():
        return chat_template_in(tokenizer)
    return None


def no_template_for(where: str, what: str, tokenizer: object, instead: str) -> ChatTemplateError:
    """The refusal of a record that gives what as messages to a reader whose tokenizer ships no
    template (and that was given none), naming the ways on."""
    return ChatTemplateError(
        f"{where} gives {what} as messages, which a chat template renders, and the tokenizer {tokenizer!r} "
        "ships none. Give the tokenizer's folder (its chat_template.jinja or tokenizer_config.json), "
        f"chat_template=, or write {instead} as text.")


def chat_template_in(folder: str | os.PathLike[str]) -> ChatTemplate | None:
    """The chat template a tokenizer folder ships (as read_chat_template finds it), None when it
    ships none; a template that does not parse is still refused."""
    source, tokens = template_and_tokens(Path(folder).expanduser())
    return None if source is None else ChatTemplate(source, tokens)


def read_chat_template(path: str | os.PathLike[str]) -> ChatTemplate:
    """The chat template shipped with a tokenizer.

    path is a tokenizer directory, a file in one (``tokenizer.json``), or a
    ``.jinja`` file. A directory's template is ``chat_template.jinja``, else
    ``chat_template`` in ``tokenizer_config.json`` (the ``default`` one when it
    lists several), else ``chat_template.json``; the special tokens come from
    ``tokenizer_config.json``.
    """
    given = Path(path).expanduser()
    if given.is_file() and given.suffix == ".jinja":
        return ChatTemplate(given.read_text(encoding="utf-8"), tokens_beside(given.parent))
    folder = given if given.is_dir() else given.parent
    if not folder.is_dir():
        raise MissingFileError(f"The tokenizer path {os.fspath(path)!r} does not exist.")
    source, tokens = template_and_tokens(folder)
    if source is None:
        raise ChatTemplateError(
            f"No chat template in {os.fspath(folder)!r}: it has no chat_template.jinja, and neither "
            f"tokenizer_config.json nor chat_template.json holds a chat_template. Pass chat_template= "
            f"(the template's text or a .jinja file)."
        )
    return ChatTemplate(source, tokens)


def template_source(texts: Mapping[str, str]) -> str | None:
    """The chat template's text among a tokenizer folder's files (file name to text, any of
    TEMPLATE_FILES): chat_template.jinja, else the ``chat_template`` of tokenizer_config.json
    (its ``default`` one when it names several), else chat_template.json's; None when none holds one."""
    if "chat_template.jinja" in texts:
        return texts["chat_template.jinja"]
    for name in TEMPLATE_FILES[1:]:
        if name not in texts:
            continue
        value = json.loads(texts[name]).get("chat_template")
        if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, Mapping)}
            value = named.get("default")
        if isinstance(value, str) and value.strip():
            return value
    return None


def template_and_tokens(folder: Path) -> tuple[str | None, dict[str, str]]:
    """A tokenizer folder's chat template text (None when it ships none) and the special tokens
    its tokenizer_config.json names, from one reading of its TEMPLATE_FILES."""
    texts = {name: (folder / name).read_text(encoding="utf-8")
             for name in TEMPLATE_FILES if (folder / name).is_file()}
    config = json.loads(texts["tokenizer_config.json"]) if "tokenizer_config.json" in texts else {}
    return template_source(texts), special_tokens(config)
