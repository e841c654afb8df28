"""What every recipe section's settings share: a true or false given where a number belongs is refused.

pydantic reads ``true`` as 1 for an ``int`` field, so ``trainer.steps=true``
trained one step and ``data.batch=true`` one row without a word. The rule is
one function, used by the settings models here and by the registry's field
check of components; it looks inside the dataclasses a field holds
(``trainer.mesh.fsdp``, a sampling's ``top_k``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import pydantic

__all__ = ["Settings", "flag_message", "flags_for_numbers"]


def _options(annotation: Any) -> tuple[Any, ...]:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return typing.get_args(annotation) if union else (annotation,)


def flags_for_numbers(annotation: Any, value: object) -> list[str]:
    """Where value holds a bool for a field that takes numbers but no bool: "" for value itself,
    else the dotted path inside the dataclass the annotation names."""
    options = _options(annotation)
    if isinstance(value, bool):
        return [""] if any(o in (int, float) for o in options) and bool not in options else []
    if not isinstance(value, Mapping):
        return []
    for option in options:
        if isinstance(option, type) and dataclasses.is_dataclass(option):
            try:
                hints = typing.get_type_hints(option)
            except Exception:  # noqa: BLE001 - annotations it cannot resolve are not checked
                return []
            return [".".join(filter(None, (str(key), inner))) for key, item in value.items() if key in hints
                    for inner in flags_for_numbers(hints[key], item)]
    return []


def flag_message(annotation: Any, value: object) -> str | None:
    """What flags_for_numbers finds, said in a line (None: nothing)."""
    found = flags_for_numbers(annotation, value)
    if not found:
        return None
    if found == [""]:
        return "a number is wanted, not a flag"
    return "; ".join(f"{path}: a number is wanted, not a flag" for path in found)


class Settings(pydantic.BaseModel):
    """A pydantic model of recipe settings whose number fields refuse true and false."""

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _no_flag_for_a_number(cls, value: object, info: pydantic.ValidationInfo) -> object:
        field = cls.model_fields.get(info.field_name or "")
        message = None if field is None else flag_message(field.annotation, value)
        if message is not None:
            raise ValueError(message)
        return value
