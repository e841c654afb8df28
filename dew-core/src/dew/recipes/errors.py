"""RecipeError: every problem of a recipe in one message, each naming its path in the file."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any

import pydantic

__all__ = ["Problem", "RecipeError", "from_validation_error", "model_at"]


class RecipeError(ValueError):
    """A recipe that cannot run: an unknown field, a wrong type, an unknown registered name."""


Problem = tuple[str, str]  # (dotted path, what is wrong there)


def _given(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _models_in(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, unions, lists, tuples)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, tuple, typing.Annotated):
        found: list[type[pydantic.BaseModel]] = []
        for arg in typing.get_args(annotation):
            found.extend(_models_in(arg))
        return found
    return []


def model_at(root: type[pydantic.BaseModel], loc: Sequence[Any]) -> type[pydantic.BaseModel] | None:
    """The pydantic model that holds the fields found at loc under root, if one does."""
    current: type[pydantic.BaseModel] | None = root
    for part in loc:
        if current is None:
            return None
        if isinstance(part, int):
            continue  # a list index: the element type was taken with the field
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        models = _models_in(field.annotation)
        current = models[0] if models else None
    return current


def _allowed_fields(root: type[pydantic.BaseModel], loc: Sequence[Any]) -> str:
    holder = model_at(root, loc[:-1])
    if holder is None:
        return ""
    names = list(holder.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f" Allowed here: {', '.join(names)}{hint}"


def _path(loc: Sequence[Any]) -> str:
    # Union members appear in pydantic's locations as type names; they are not
    # keys of the file, so they are left out of the path.
    parts = [str(p) for p in loc if isinstance(p, int) or not any(c in str(p) for c in "[]()|,")]
    return ".".join(parts) or "(top level)"


def from_validation_error(
    error: pydantic.ValidationError, root: type[pydantic.BaseModel], prefix: Sequence[Any] = ()
) -> list[Problem]:
    """Turn pydantic's errors into (path, message) problems a person can act on."""
    problems: list[Problem] = []
    for item in error.errors():
        loc = (*prefix, *item["loc"])
        kind = item["type"]
        context = item.get("ctx") or {}
        if kind == "extra_forbidden":
            problems.append((
                _path(loc),
                f"unknown field (given {_given(item['input'])}).{_allowed_fields(root, loc)}",
            ))
        elif kind == "missing":
            problems.append((_path(loc), "required, but not given."))
        elif "problems" in context:  # dew's own checks, each with a finer location
            for sub, message in context["problems"]:
                problems.append((_path((*loc, *sub)), message))
        else:
            message = item["msg"].removeprefix("Value error, ")
            problems.append((_path(loc), f"{message} (given {_given(item['input'])})."))
    return problems


def raise_problems(source: str, problems: Sequence[Problem]) -> typing.NoReturn:
    """Raise one RecipeError listing every problem of the recipe read from source."""
    lines = "\n".join(f"  {path}: {message}" for path, message in problems)
    raise RecipeError(
        f"The recipe {source} has {len(problems)} problem(s):\n{lines}\n"
        f"Fix them in the file or with key=value overrides; `dew train --help` lists every field."
    )
