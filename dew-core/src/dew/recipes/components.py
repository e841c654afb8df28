"""A recipe's registered components: a name from a registry, plus that component's fields.

Names are looked up in the entry-point metadata, which imports nothing; the
fields are then checked against the component's declared fields (importing
the one module that defines it), so a typo or a wrong type fails while the
file is parsed, before anything is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pydantic
from pydantic_core import PydanticCustomError

from dew.placeholders import expand
from dew.recipes.errors import RecipeError, did_you_mean
from dew.settings import Settings

if TYPE_CHECKING:
    from dew.data.base import Dataset

__all__ = ["NO_JSON", "ComponentConfig", "ComponentValueError", "DataConfig", "check_component", "json_form",
           "model_section", "refuse_values", "run_inputs", "with_defaults"]

# Of what an objective declares in Objective.run_inputs, the run always supplies the
# model (a recipe cannot give one), and the tokenizer unless the recipe gives its own.
ALWAYS_SUPPLIED = frozenset({"model"})


class ComponentConfig(Settings):
    """A registered component by name; every other key is one of its fields."""

    model_config = pydantic.ConfigDict(extra="allow", frozen=True)

    name: str = pydantic.Field(description="a name registered in the component's group")

    @property
    def fields(self) -> dict[str, Any]:
        """The component's own fields, as the recipe gives them."""
        return dict(self.model_extra or {})

    def build(self, group: str, timestamp: str = "", **supplied: Any) -> Any:
        """The registered component this section names, built from its fields (placeholders
        replaced, see dew.placeholders) and what the run supplies besides them (an
        objective's model and tokenizer). The registry validates every field first."""
        from dew import registry

        try:
            return registry.registry(group).build(self.name, **expand(self.fields, timestamp), **supplied)
        except (ValueError, TypeError) as error:
            refuse_values(error, f"{registry.registry(group).kind} {self.name!r}", _SECTION.get(group, group))
            raise


class DataConfig(ComponentConfig):
    """A registered dataset reader, its fields, and how it loads: the global batch and
    any other keyword of the reader's ``load`` (``val_fraction``, say)."""

    batch: int = pydantic.Field(ge=1, description="global batch size, in rows")
    load: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="other keywords of the reader's load (val_fraction)"
    )

    def load_dataset(self, reader: Any, timestamp: str = "", *, seed: int | None = None) -> Dataset:
        """reader's Dataset as this section loads it: data.batch rows, data.load's keywords
        (placeholders replaced), and seed when the reader's load takes one and data.load sets
        none. reader is what ``build("datasets")`` returned."""
        from dew import registry

        load = expand(self.load, timestamp)
        seeded = seed is not None and "seed" not in load and "seed" in registry.declared_fields(reader.load)
        try:
            return reader.load(batch=self.batch, **load, **({"seed": seed} if seeded else {}))
        except (ValueError, TypeError) as error:
            refuse_values(error, f"dataset {self.name!r}", "data.load (and data.batch)")
            raise


# The recipe section a registry's component is given in.
_SECTION = {"models": "model", "objectives": "objective", "datasets": "data", "trackers": "trackers",
            "rewards": "objective.reward", "environments": "objective.environment"}


class ComponentValueError(RecipeError):
    """A component refused the values a recipe gave it (checks only the component itself knows)."""


def refuse_values(error: Exception, what: str, section: str) -> None:
    """Raise a component's own refusal of its values (a plain ValueError or TypeError from its
    constructor) as dew's error naming the recipe section; dew's own errors pass through as they are."""
    from dew.errors import DewError

    if isinstance(error, DewError):
        return
    raise ComponentValueError(f"{what} refused the recipe's {section} values: {error}") from error


def run_inputs(component: object) -> frozenset[str]:
    """What a run hands an objective class besides its fields (``Objective.run_inputs``)."""
    from dew.objectives.base import Objective

    if isinstance(component, type) and issubclass(component, Objective):
        return component.run_inputs
    return frozenset()


def _adapter(annotation: object) -> pydantic.TypeAdapter:
    from dew.registry import type_adapter

    return type_adapter(annotation) or pydantic.TypeAdapter(Any)


def _field_problems(annotation: object, value: object) -> list[tuple[tuple[str, ...], str]]:
    """What pydantic finds wrong with value, given for a field of this annotation (at most three).

    The value is checked as the one field of a model that forbids extra keys: that setting
    reaches the plain dataclasses inside it (a Sampling given as a mapping), which on their
    own would drop a misspelled key and train without it.
    """
    from dew.settings import flag_message

    flagged = flag_message(annotation, value)
    if flagged is not None:  # pydantic would read it as 1
        return [((), f"{flagged} (given {_given(value)}).")]
    strict = _strict_model(annotation)
    try:
        if strict is None:
            _adapter(annotation).validate_python(value)
        else:
            strict.model_validate({"value": value})
    except pydantic.ValidationError as error:
        problems = []
        for item in error.errors()[:3]:
            inner = tuple(str(p) for p in item["loc"])[0 if strict is None else 1:]
            if item["type"] in {"unexpected_keyword_argument", "extra_forbidden"}:
                problems.append((inner, f"unknown field (given {_given(item['input'])}).{_fields_hint(annotation, inner)}"))
            else:
                problems.append((inner, f"{item['msg']} (given {_given(item['input'])})."))
        return problems
    return []


def _strict_model(annotation: Any) -> type[pydantic.BaseModel] | None:
    """A model of one field, value, of this annotation, forbidding extra keys (None when
    pydantic cannot build one around it)."""
    # allow_inf_nan=False: a NaN or infinite coefficient trains to NaN (a DPO beta, a LoRA alpha)
    config = pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)
    try:
        return pydantic.create_model("Field", __config__=config, value=(annotation, ...))
    except Exception:  # noqa: BLE001 - an annotation pydantic cannot build a model around
        return None


def _fields_hint(annotation: object, path: tuple[str, ...]) -> str:
    """" Allowed: ...; did you mean ...?" for an unknown key at path inside a dataclass the
    annotation holds (through unions and nested dataclass fields), or "" when none is found."""
    classes = [annotation]
    for key in path[:-1]:
        classes = [hints[key] for hints in map(_dataclass_hints, _members(classes)) if key in hints]
    for hints in map(_dataclass_hints, _members(classes)):
        if hints:
            return f" Allowed: {', '.join(hints)}" + (did_you_mean(path[-1], list(hints)) or ".")
    return ""


def _members(annotations: list[object]) -> list[object]:
    """The annotations with each union opened into its members."""
    opened: list[object] = []
    for annotation in annotations:
        arguments = typing.get_args(annotation)
        is_union = typing.get_origin(annotation) in {typing.Union, types.UnionType}
        opened.extend(arguments if is_union else [annotation])
    return opened


def _dataclass_hints(annotation: object) -> dict[str, object]:
    """A dataclass's field annotations by name ({} for anything else)."""
    if not (isinstance(annotation, type) and dataclasses.is_dataclass(annotation)):
        return {}
    try:
        hints = typing.get_type_hints(annotation)
    except Exception:  # noqa: BLE001 - a forward reference that cannot be resolved
        hints = {}
    return {field.name: hints.get(field.name, Any) for field in dataclasses.fields(annotation) if field.init}


def _given(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# An objective's fields that name a component of another registry ({name: ..., fields}, or a name).
_NESTED: dict[str, dict[str, str]] = {"objectives": {"reward": "rewards", "environment": "environments",
                                                     "teacher": "models"}}

# The methods a registered class of these groups must have (a factory function is taken on trust).
_KIND_METHODS: dict[str, tuple[str, ...]] = {"trackers": ("log", "artifact", "close"), "datasets": ("load",)}


def _kind_problem(group: str, name: str, component: object) -> str | None:
    """Why a registered class is not of its group's kind (an objective that is no Objective, a
    model that is no Flax module, a reward registered as the scoring function itself), or None; any
    other factory function is taken on trust."""
    if group == "rewards" and _scores_itself(component):
        from dew import registry as registries

        provider = registries.rewards.provider(name)
        return (f"reward {name!r} from {provider.distribution} ({provider.value}) is a function of completions and "
                "context: the reward itself, where an entry point of dew.rewards names what builds one (dew calls "
                "it with the recipe's fields). Register a class whose instances are called with (completions, "
                "context), or a function of the fields that returns the reward.")
    if not isinstance(component, type) or group not in ("objectives", "models"):
        return None
    from flax.linen import Module

    from dew import registry as registries
    from dew.objectives.base import Objective

    base: type = Objective if group == "objectives" else Module
    if issubclass(component, base):
        return None
    registry = registries.registry(group)
    provider = registry.provider(name)
    return (f"{registry.kind} {name!r} from {provider.distribution} ({provider.value}) is a "
            f"{component.__name__}, not a subclass of {base.__module__.split('.')[0]}'s {base.__name__}: a run "
            f"calls what {base.__name__} declares on it. Fix or update {provider.distribution}, or choose "
            f"another {registry.kind}.")


def _scores_itself(component: object) -> bool:
    """Whether component is a plain function whose required parameters are a reward's call, (completions,
    context), rather than fields that build a reward."""
    if not inspect.isfunction(component):
        return False
    required = [p.name for p in inspect.signature(component).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return required[:2] == ["completions", "context"]


def problems_of(group: str, name: str, fields: Mapping[str, object],
                beside: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """What is wrong with a component given by name and fields, as (sub-path, message) pairs.

    beside names the keys the recipe's entry holds besides the component's fields (an
    evaluation entry's task, every and label), offered with them when a key is unknown."""
    from dew import registry as registries

    registry = registries.registry(group)
    if name not in registry:
        available = registry.names()
        close = difflib.get_close_matches(name, list(available), n=2)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        allowed = ", ".join(f"{n} ({d})" for n, d in available.items()) or "none installed"
        return [(("name",), f"no {registry.kind} named {name!r}.{hint} Allowed: {allowed}. "
                           "Another distribution's components appear once it is installed.")]
    try:
        component = registry.load(name)
        declared = registries.declared_fields(component)
    except Exception as error:  # noqa: BLE001 - a component that cannot even be imported
        return [(("name",), f"{registry.kind} {name!r} could not be loaded: {error}")]
    methods = _KIND_METHODS.get(group, ())
    missing = [m for m in methods if isinstance(component, type) and not callable(getattr(component, m, None))]
    if missing:
        provider = registry.provider(name)
        return [(("name",), f"{registry.kind} {name!r} from {provider.distribution} ({provider.value}) has no "
                           f"{', '.join(missing)} method: a {registry.kind} is a class with "
                           f"{', '.join(methods)}, so its entry point names something else. Fix or update "
                           f"{provider.distribution}, or choose another {registry.kind}.")]
    kind_problem = _kind_problem(group, name, component)
    if kind_problem is not None:
        return [(("name",), kind_problem)]
    inputs = run_inputs(component) if group == "objectives" else frozenset()
    unaccepted = sorted(key for key in inputs if key not in declared and not registries.accepts_var_keyword(component))
    if unaccepted:
        provider = registry.provider(name)
        return [(("name",), f"{registry.kind} {name!r} from {provider.distribution} declares run_inputs "
                           f"{', '.join(unaccepted)} (what a run hands its constructor), but its constructor "
                           f"takes no {' or '.join(unaccepted)} parameter. Fix {provider.distribution}: add the "
                           "parameter, or leave it out of run_inputs.")]
    supplied, may_supply = inputs & ALWAYS_SUPPLIED, inputs - ALWAYS_SUPPLIED
    problems: list[tuple[tuple[str, ...], str]] = []
    for key, value in fields.items():
        if key in supplied:
            problems.append(((key,), f"the run supplies {registry.kind} {name!r} its {key} "
                             f"(given {_given(value)}); remove it from the recipe."))
            continue
        if key not in declared:
            offered = [*beside, *declared]
            problems.append(((key,), f"{registry.kind} {name!r} has no field {key!r} (given "
                             f"{_given(value)}). Allowed: {', '.join(offered)}{did_you_mean(key, offered)}"))
            continue
        for inner, message in _field_problems(registries._lenient(declared[key][0]), value):
            problems.append(((key, *inner), message))

    for key, (_, default) in declared.items():
        if default is ... and key not in fields and key not in {*supplied, *may_supply}:
            problems.append(((key,), f"{registry.kind} {name!r} requires this field, but it is "
                             "not given."))
    for key, inner_group in _NESTED.get(group, {}).items():  # a component given inside this one
        value = fields.get(key)
        if isinstance(value, str):
            value = {"name": value}
        if isinstance(value, Mapping) and isinstance(value.get("name"), str):
            rest = {k: v for k, v in value.items() if k != "name"}
            problems += [((key, *sub), message) for sub, message in problems_of(inner_group, value["name"], rest)]
        elif value is not None and key in fields:  # a list, a number, a mapping without a name
            kind = registries.registry(inner_group).kind
            also = " (several rewards combine through the `weighted` reward)" if key == "reward" else ""
            problems.append(((key,), f"names a registered {kind}: give its name, or a mapping of its name "
                             f"and fields, like {{name: ..., FIELD: ...}}{also} (given {_given(value)})."))
    if not problems and isinstance(component, registries.ChecksFields):  # the values, once typed right
        problems += component.field_problems(fields)
    return problems


def _load_problems(config: DataConfig) -> list[tuple[tuple[str, ...], str]]:
    from dew import registry as registries

    reader = registries.datasets.load(config.name)
    method = getattr(reader, "load", None)  # a registered reader is any class, a third party's too
    if method is None:
        return [(("load",), f"dataset {config.name!r} has no load method to pass these to.")]
    declared = registries.declared_fields(method)
    problems: list[tuple[tuple[str, ...], str]] = []
    for key, value in config.load.items():
        if key == "batch":
            problems.append((("load", key), "give the batch as data.batch, not in data.load."))
        elif key not in declared:
            allowed = ", ".join(k for k in declared if k != "batch") or "none besides batch"
            problems.append((("load", key), f"{config.name}.load takes no {key!r} (given "
                             f"{_given(value)}). Allowed: {allowed}."))
        else:
            problems += [(("load", key), problem) for _, problem in _field_problems(declared[key][0], value)]
    return problems


def check_component(group: str, config: ComponentConfig) -> ComponentConfig:
    """Raise pydantic's error, each problem with its sub-path, when config is not buildable."""
    beside = ("batch", "load") if isinstance(config, DataConfig) else ()
    found = problems_of(group, config.name, config.fields, beside=beside)
    if isinstance(config, DataConfig) and config.load and not found:
        found = _load_problems(config)
    if found:
        raise PydanticCustomError(
            "dew_component", "{message}", {"message": found[0][1], "problems": found}
        )
    return config


NO_JSON = object()  # what json_form gives a value that has no JSON form


def json_form(value: object) -> object:
    """value as JSON data (pydantic's conversion), or NO_JSON when it has none (a dtype class)."""
    from pydantic_core import to_jsonable_python

    try:
        return to_jsonable_python(value)
    except Exception:  # noqa: BLE001 - a default with no JSON form cannot equal a recorded value
        return NO_JSON


def model_section(name: str, model: object) -> dict[str, object]:
    """The recipe section that builds model again as the model registered as name: each field
    its dataclass declares that differs from the field's default, in JSON form (a dtype by its
    name, which the registry reads back).

    A run records a model it read from a file this way (a distillation's teacher from its
    config.json), so its run.json rebuilds that model once the file is gone.
    """
    import numpy as np

    section: dict[str, object] = {"name": name}
    for field in dataclasses.fields(model):  # type: ignore[arg-type]  # a dataclass Module
        value = getattr(model, field.name)
        if not field.init or field.name in ("parent", "name") or value is None or value is field.default:
            continue
        if field.default is not dataclasses.MISSING and type(value) is type(field.default) and value == field.default:
            continue
        form = json_form(value)
        section[field.name] = np.dtype(value).name if form is NO_JSON else form
    return section


def with_defaults(group: str, name: object, given: Mapping[str, object]) -> dict[str, object]:
    """given, the fields a recipe sets for the component registered as name in group, with every
    other declared field that has a JSON default filled in (a default without one, a dtype say,
    and a default of None are left out; so is everything of a component not installed here).

    A run records its model this way (``RunConfig.recorded``): its run.json then says what the
    weights were trained as even after a later dew changes a default, and every command that
    rebuilds the model from it builds that model.
    """
    from dew import registry

    filled: dict[str, object] = {}
    if isinstance(name, str):
        try:
            declared = registry.declared_fields(registry.registry(group).load(name))
        except Exception:  # noqa: BLE001 - not installed here: only what the recipe gives
            declared = {}
        for field, (_, default) in declared.items():
            value = NO_JSON if default is ... or default is None else json_form(default)
            if value is not NO_JSON:  # None is left out: it can mean "absent" (a family's preset)
                filled[field] = value
    return {**filled, **given}
