"""What a recipe leaves to its defaults: each field's default, for showing a run's own settings.

A recorded recipe (``RunConfig.recorded``, as run.json and a journal's
RunStarted record hold it) lists every field, the defaults included, so
the few a person chose are lost among eighty. ``defaults_of`` gives, for
every field that has a default, that default in the same flat, JSON form
(``flat_recipe``): the schema's own for the optimizer and trainer sections,
the registered component's declared fields for the model, objective, data
and trackers. A field whose value differs from its default, or that has
none, is one the recipe sets. A component that is not installed here has
no known defaults: all its fields count as set.

>>> recorded = {"seed": 0, "optimizer": {"solver": "adamw", "learning_rate": 0.01}}
>>> defaults = defaults_of(recorded)
>>> defaults["seed"], defaults["optimizer.solver"], defaults["optimizer.learning_rate"]
(0, 'adamw', 0.0003)
>>> set_by(recorded)
['optimizer.learning_rate']
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import pydantic

from dew.recipes.components import NO_JSON as _MISSING
from dew.recipes.components import json_form as _json

__all__ = ["defaults_of", "flat_recipe", "set_by"]

# A recipe's component sections, and the registry each names its component in.
COMPONENTS = {"model": "models", "objective": "objectives", "data": "datasets", "trackers": "trackers"}


def flat_recipe(value: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, leaf) for every leaf of a recorded recipe: mappings and lists of mappings
    are opened (list items by index, as overrides name them); other lists stay whole.

    >>> list(flat_recipe({"trackers": [{"name": "local"}], "trainer": {"xla_flags": ["--a"]}}))
    [('trackers.0.name', 'local'), ('trainer.xla_flags', ['--a'])]
    """
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            yield from flat_recipe(inner, f"{prefix}{key}.")
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        for index, inner in enumerate(value):
            yield from flat_recipe(inner, f"{prefix}{index}.")
    else:
        yield prefix[:-1], value




def _model(annotation: object) -> type[pydantic.BaseModel] | None:
    """The pydantic model an annotation holds (through Optional), or None."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel):
                return arg
    return None


def _put(out: dict[str, object], key: str, default: object) -> None:
    value = _json(default)
    if value is _MISSING:
        return
    for inner, leaf in flat_recipe(value, f"{key}."):  # a nested default (a mesh) opens like the recipe
        out[inner] = leaf


def _schema(model: type[pydantic.BaseModel], data: object, prefix: str, out: dict[str, object]) -> None:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = _model(field.annotation)
        value = data.get(name) if isinstance(data, Mapping) else None
        if inner is not None and isinstance(value, Mapping):  # a section: its fields have defaults
            _schema(inner, value, f"{key}.", out)
            continue
        if not field.is_required():
            _put(out, key, field.get_default(call_default_factory=True))


def _component(group: str, data: object, prefix: str, out: dict[str, object]) -> None:
    from dew import registry

    if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
        return
    try:
        component = registry.registry(group).load(data["name"])
        declared = registry.declared_fields(component)
        load = registry.declared_fields(component.load) if group == "datasets" else {}
    except Exception:  # noqa: BLE001 - not installed here: every field counts as set
        return
    for name, (_, default) in declared.items():
        if default is not ...:
            _put(out, f"{prefix}{name}", default)
    if group == "datasets":
        out[f"{prefix}load"] = {}
        for name, (_, default) in load.items():
            if default is not ... and name != "batch":
                _put(out, f"{prefix}load.{name}", default)


def defaults_of(recorded: Mapping[str, object]) -> dict[str, object]:
    """Every field of the recorded recipe that has a default, flat (see ``flat_recipe``), with
    that default as JSON."""
    from dew.recipes.config import RunConfig

    out: dict[str, object] = {}
    plain = {k: v for k, v in recorded.items() if k not in COMPONENTS}
    fields = {k: f for k, f in RunConfig.model_fields.items() if k not in COMPONENTS}
    definitions: dict[str, Any] = {k: (f.annotation, f) for k, f in fields.items()}  # each (type, FieldInfo)
    schema = pydantic.create_model("Sections", **definitions)
    _schema(schema, plain, "", out)
    for section, group in COMPONENTS.items():
        value = recorded.get(section)
        if section == "trackers" and isinstance(value, list):
            for index, tracker in enumerate(value):
                _component(group, tracker, f"trackers.{index}.", out)
        else:
            _component(group, value, f"{section}.", out)
    if isinstance(recorded.get("data"), Mapping):
        out.setdefault("data.load", {})
    return out


def set_by(recorded: Mapping[str, object]) -> list[str]:
    """The flat keys of the fields the recorded recipe sets: no default, or another value."""
    defaults = defaults_of(recorded)
    return [key for key, value in flat_recipe(recorded)
            if key not in defaults or defaults[key] != value]
