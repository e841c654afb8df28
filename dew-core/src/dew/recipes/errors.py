"""RecipeError: every problem of a recipe in one message, each naming its path in the file."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TypeGuard

import pydantic

from dew.errors import DewError

__all__ = ["Problem", "RecipeError", "UnsuitableModelError", "from_validation_error", "model_at"]


class RecipeError(DewError, ValueError):
    """A recipe that cannot run: an unknown field, a wrong type, an unknown registered name."""


class UnsuitableModelError(RecipeError):
    """The recipe's model is not of the kind its objective trains (Objective.trains)."""


Problem = tuple[str, str]  # (dotted path, what is wrong there)


def _given(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _structured(annotation: object) -> TypeGuard[type]:
    return isinstance(annotation, type) and (
        issubclass(annotation, pydantic.BaseModel) or dataclasses.is_dataclass(annotation)
    )


def field_names(holder: type) -> list[str]:
    """The field names of a pydantic model or a dataclass."""
    if issubclass(holder, pydantic.BaseModel):
        return list(holder.model_fields)
    if not dataclasses.is_dataclass(holder):
        raise TypeError(f"{holder.__name__} is neither a pydantic model nor a dataclass.")
    return [f.name for f in dataclasses.fields(holder) if f.init]


def _models_in(annotation: object) -> list[type]:
    """The models and dataclasses an annotation can hold (through Optional, unions, lists)."""
    if _structured(annotation):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, tuple, typing.Annotated):
        found: list[type[pydantic.BaseModel]] = []
        for arg in typing.get_args(annotation):
            found.extend(_models_in(arg))
        return found
    return []


def model_at(root: type[pydantic.BaseModel], loc: Sequence[int | str]) -> type | None:
    """The pydantic model (or dataclass) that holds the fields found at loc under root."""
    current: type | None = root
    for part in loc:
        if current is None:
            return None
        if isinstance(part, int):
            continue  # a list index: the element type was taken with the field
        if issubclass(current, pydantic.BaseModel):
            field = current.model_fields.get(str(part))
            annotation = None if field is None else field.annotation
        else:
            annotation = typing.get_type_hints(current).get(str(part))
        if annotation is None:
            return None
        models = _models_in(annotation)
        current = models[0] if models else None
    return current


# Names other trainers (transformers' TrainingArguments, torchtitan, MaxText) give fields dew names otherwise.
_NAMED_ELSEWHERE = {
    "save_every": "checkpoint_every", "save_steps": "checkpoint_every", "checkpoint_period": "checkpoint_every",
    "max_steps": "steps", "num_steps": "steps", "total_steps": "steps", "steps_per_eval": "eval_every",
    "eval_steps": "eval_every", "eval_interval": "eval_every", "logging_steps": "log_every",
    "log_interval": "log_every", "output_dir": "checkpoint_dir", "save_dir": "checkpoint_dir",
    "gradient_accumulation_steps": "accumulation", "lr": "learning_rate", "batch_size": "batch",
    "per_device_train_batch_size": "batch", "warmup": "warmup_steps", "num_train_epochs": "epochs",
    "save_total_limit": "keep", "max_grad_norm": "clip_norm", "lr_scheduler_type": "schedule",
}


def field_path(root: type[pydantic.BaseModel], name: str) -> str | None:
    """The dotted path of the field under root called name, or by another trainer's name for it
    (``max_steps``: ``trainer.steps``), the shallowest first; None when none is.

    >>> from dew.recipes.config import RunConfig
    >>> field_path(RunConfig, "steps"), field_path(RunConfig, "lr"), field_path(RunConfig, "nothing")
    ('trainer.steps', 'optimizer.learning_rate', None)
    """
    wanted = {name, _NAMED_ELSEWHERE.get(name, name)}
    level: list[tuple[str, type]] = [("", root)]
    seen: set[type] = set()
    while level:
        below: list[tuple[str, type]] = []
        for prefix, holder in level:
            seen.add(holder)
            for field in field_names(holder):
                if field in wanted:
                    return prefix + field
                inner = model_at(holder, [field])
                if inner is not None and inner not in seen:
                    below.append((f"{prefix}{field}.", inner))
        level = below
    return None


def did_you_mean(name: str, names: Sequence[str]) -> str:
    """"; did you mean 'x'?" for the field among names that an unknown name most likely meant
    (what other trainers call it first, then the closest spelling), or ""."""
    elsewhere = _NAMED_ELSEWHERE.get(name)
    close = [elsewhere] if elsewhere in names else difflib.get_close_matches(name, list(names), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _allowed_fields(root: type[pydantic.BaseModel], loc: Sequence[int | str]) -> str:
    holder = model_at(root, loc[:-1])
    if holder is None:
        return ""
    names = field_names(holder)
    return f" Allowed here: {', '.join(names)}{did_you_mean(str(loc[-1]), names)}"


def _path(loc: Sequence[int | str]) -> str:
    # Union members appear in pydantic's locations as type names; they are not
    # keys of the file, so they are left out of the path.
    parts = [str(p) for p in loc if isinstance(p, int) or not any(c in str(p) for c in "[]()|,")]
    return ".".join(parts) or "(top level)"


def from_validation_error(
    error: pydantic.ValidationError, root: type[pydantic.BaseModel], prefix: Sequence[int | str] = ()
) -> list[Problem]:
    """Turn pydantic's errors into (path, message) problems a person can act on."""
    problems: list[Problem] = []
    for item in error.errors():
        loc = (*prefix, *item["loc"])
        kind = item["type"]
        context = item.get("ctx") or {}
        if kind in ("extra_forbidden", "unexpected_keyword_argument"):
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


# What to do about a recorded run's recipe that no longer reads: it is what the run trained with, so
# the fix is the environment (or a resume's overrides), not editing the file.
RECORDED_ADVICE = ("This is the recipe the run trained with: install the distributions that register the "
                   "names above as they were when it trained (`dew describe` lists what is installed), or "
                   "give dew train --resume RUN key=value overrides to continue it with other components.")


def raise_problems(source: str, problems: Sequence[Problem], advice: str | None = None) -> typing.NoReturn:
    """Raise one RecipeError listing every problem of the recipe read from source; advice replaces
    the closing line that says where to fix them (a recorded run's recipe is not edited)."""
    lines = "\n".join(f"  {path}: {message}" for path, message in problems)
    shipped = Path(source).parent == Path(__file__).parent  # a recipe dew ships sits beside this module
    where = ("with key=value overrides, or in a copy of this shipped recipe" if shipped
             else "in the file or with key=value overrides")
    closing = advice or f"Fix them {where}; `dew train --help` lists every field."
    raise RecipeError(f"The recipe {source} has {len(problems)} problem(s):\n{lines}\n{closing}")
