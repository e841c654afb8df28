"""Reading recipe YAML within bounds: the one reader for files and overrides.

A recipe may come from anyone, so reading it must cost little whatever it
holds. YAML's anchors let a kilobyte describe a tree of billions of nodes
(the "billion laughs" file), nesting can be deep enough to exhaust Python's
stack, and a mapping may repeat a key so that the later value silently wins.
This reader bounds the file's size, the nesting depth and the size of the
tree with every alias expanded, refuses repeated keys and text that is not
UTF-8, and turns every such case into one RecipeFileError that says what is
wrong. Only YAML's safe types are built (no Python tags), and ``1e-3`` reads
as a number as in YAML 1.2.

>>> read_yaml("trainer: {steps: 5}\\nseed: 1e-3")
{'trainer': {'steps': 5}, 'seed': 0.001}
>>> read_yaml("a: 1\\na: 2")
Traceback (most recent call last):
...
dew.recipes.reading.RecipeFileError: The recipe <text> repeats the key 'a' (line 2, column 1); each key may appear once in a mapping.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from dew.errors import DewError
from dew.recipes.errors import RecipeError

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "RecipeFileError", "read_recipe_file", "read_yaml"]

MAX_BYTES = 256 << 10  # a recipe is a page or two (about a kilobyte)
MAX_DEPTH = 64  # levels of nesting, counted through aliases
MAX_NODES = 20_000  # values (keys included) of the tree, every alias expanded where it is used


class RecipeFileError(RecipeError):
    """A recipe file that cannot be read as YAML within bounds: too large, not UTF-8 text,
    malformed, nested too deeply, expanding through aliases past the node bound, or
    repeating a key."""


MAX_INTEGER_DIGITS = 64  # an int64 has 19 digits; a seed or a count of tokens fits many times over


class _Refused(DewError, yaml.YAMLError):
    """A bound crossed while reading; carries the message the RecipeFileError gets."""


def _where(node: yaml.Node) -> str:
    mark = node.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _Loader(yaml.SafeLoader):
    """YAML's safe loader with bounded nesting, refused repeated keys and YAML 1.2's plain scalars."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._composed = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        self._composed += 1
        try:
            if self._composed > MAX_NODES:  # stop reading early; the expanded count comes later
                mark = self.peek_event().start_mark
                raise _Refused(_too_many(f"line {mark.line + 1}"))
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(
                    f"nests deeper than {MAX_DEPTH} levels (at line {mark.line + 1}); a recipe "
                    f"needs a handful."
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges on purpose; its keys may be overridden
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                except TypeError:
                    continue  # an unhashable key: SafeConstructor refuses it with its own message
                if repeated:
                    raise _Refused(
                        f"repeats the key {key!r} ({_where(key_node)}); each key may appear once "
                        f"in a mapping."
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's core schema for plain scalars, not PyYAML's YAML 1.1: `1e-3` is a number, and `0123`
# is 123 (not octal 83), `1:30` is text (not 90 in base 60), `no`/`on` are text (a prompt, a source
# named `no`; a true/false field still reads them), `2026-12-05` is text. Only true and false are
# booleans. Underscores in numbers (`1_000`) stay allowed, as Python reads them.
_INT, _FLOAT, _BOOL = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: kept for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()
    if (kept := [(tag, regex) for tag, regex in entries
                 if tag not in (_INT, _FLOAT, _BOOL, "tag:yaml.org,2002:timestamp")])}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o_*[0-7][0-7_]*|0x_*[0-9a-fA-F][0-9a-fA-F_]*)$"), list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |[-+]?\.[0-9_]*[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _integer(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """A YAML 1.2 integer: decimal (a leading 0 too), 0o octal or 0x hexadecimal."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    if len(text) > MAX_INTEGER_DIGITS:  # int() of a long enough text takes seconds, or refuses with a traceback
        raise _Refused(f"holds an integer of {len(text)} characters ({_where(node)}), past the "
                       f"{MAX_INTEGER_DIGITS} any recipe value needs; shorten it")
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    base = 16 if body.startswith("0x") else 8 if body.startswith("0o") else 10
    return sign * int(body[2:] if base != 10 else body, base)


_Loader.add_constructor(_INT, _integer)


def _too_many(where: str) -> str:
    return (f"holds more than {MAX_NODES} values once its aliases are expanded ({where}); "
            f"a recipe needs a few hundred.")


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph whose alias-expanded tree is too deep, too large or cyclic.

    Each node's expanded size and height are computed once (aliases share
    node objects), so the check costs time linear in the file, not in the
    expansion it guards against.
    """
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, height)
    active: set[int] = set()

    def measure(node: yaml.Node, depth: int) -> tuple[int, int]:
        known = measured.get(id(node))
        if known is None:
            if id(node) in active:
                raise _Refused(f"holds an alias that refers to a node containing it ({_where(node)}).")
            if depth > MAX_DEPTH:
                raise _Refused(
                    f"nests deeper than {MAX_DEPTH} levels once its aliases are expanded "
                    f"({_where(node)})."
                )
            active.add(id(node))
            children: list[yaml.Node] = []
            if isinstance(node, yaml.SequenceNode):
                children = list(node.value)
            elif isinstance(node, yaml.MappingNode):
                children = [part for pair in node.value for part in pair]
            size, height = 1, 1
            for child in children:
                child_size, child_height = measure(child, depth + 1)
                size += child_size
                height = max(height, child_height + 1)
                if size > MAX_NODES:
                    raise _Refused(_too_many(_where(node)))
            active.discard(id(node))
            known = measured[id(node)] = (size, height)
        if depth + known[1] - 1 > MAX_DEPTH:
            raise _Refused(
                f"nests deeper than {MAX_DEPTH} levels once its aliases are expanded ({_where(node)})."
            )
        return known

    measure(root, 1)


def _parse(text: str, source: str) -> Any:
    loader = _Loader(text)
    loader.name = source  # PyYAML's marks otherwise place an error "in <unicode string>"
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return _unshared(loader.construct_document(node))
    finally:
        loader.dispose()


def _unshared(value: Any) -> Any:
    """value with each alias's mapping or list copied where it is used, so an override of one
    place (model.num_layers=1) leaves the others (a teacher written as *model) as written."""
    if isinstance(value, dict):
        return {key: _unshared(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unshared(item) for item in value]
    return value


def _hint(error: yaml.YAMLError) -> str:
    """How to mend the YAML mistakes a hand-edited recipe makes most."""
    problem = (error.problem or "") if isinstance(error, yaml.MarkedYAMLError) else ""
    if "'\\t'" in problem:
        return "\nIndent with spaces: YAML does not allow tabs there."
    if "another document" in problem:
        return "\nA recipe is one document: remove the '---' line and what follows it, or make it a file of its own."
    return ""


def read_yaml(text: str, source: str = "<text>") -> Any:
    """Parse YAML text within the bounds; raise RecipeFileError naming source otherwise."""
    try:
        return _parse(text, source)
    except _Refused as error:
        raise RecipeFileError(f"The recipe {source} {error}") from None
    except yaml.YAMLError as error:
        raise RecipeFileError(f"The recipe {source} is not valid YAML: {error}{_hint(error)}") from None
    except RecursionError:  # a bound above should come first; this keeps the promise regardless
        raise RecipeFileError(
            f"The recipe {source} nests too deeply to read; a recipe needs a handful of levels."
        ) from None


def read_recipe_file(path: str | os.PathLike[str]) -> Any:
    """The YAML contents of a recipe file, read within the bounds (see the module docstring)."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            raw = handle.read(MAX_BYTES + 1)
    except OSError as error:
        raise RecipeFileError(
            f"The recipe {path} cannot be read ({error.strerror or error})."
        ) from None
    if size > MAX_BYTES or len(raw) > MAX_BYTES:
        raise RecipeFileError(
            f"The recipe {path} is {max(size, len(raw))} bytes; dew reads recipes of at most "
            f"{MAX_BYTES} bytes. Is it the right file?"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise RecipeFileError(
            f"The recipe {path} is not UTF-8 text (byte {raw[error.start]:#04x} at offset "
            f"{error.start}). A recipe is a YAML file; is it the right file?"
        ) from None
    return read_yaml(text, str(path))
