"""Names resolved through entry points: one Registry per entry-point group.

dew's own built-ins register exactly as a third party would, in their
distribution's ``pyproject.toml``. Scanning the metadata imports nothing;
``load(name)`` imports the one module that defines ``name``; ``build(name,
**kwargs)`` checks the keyword arguments against the component's declared
fields with pydantic before constructing anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import inspect
import re
import sys
import threading
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import importlib_metadata
import pydantic

from dew._surface import MissingDistributionError, install_hint
from dew.errors import DewError, DewKeyError
from dew.settings import flag_message

__all__ = [
    "GROUPS",
    "ChecksFields",
    "ComponentLoadError",
    "InvalidFieldsError",
    "NameConflictError",
    "Provider",
    "Registry",
    "RegistryError",
    "UnknownNameError",
    "datasets",
    "environments",
    "evaluations",
    "models",
    "objectives",
    "plugins",
    "registry",
    "rewards",
    "trackers",
]


class RegistryError(DewError, LookupError):
    """Base class of the errors a registry raises."""


class UnknownNameError(RegistryError, DewKeyError):
    """No distribution registers this name in the group."""


class NameConflictError(RegistryError):
    """Two distributions register the same name in one group."""


class InvalidFieldsError(RegistryError, TypeError):
    """build() was given an unknown field, a missing one, or a value of a wrong type."""


class ComponentLoadError(RegistryError):
    """A registered component's module failed as it was imported, or does not hold the object named."""


@runtime_checkable
class ChecksFields(Protocol):
    """A component that checks its fields' values beyond their types, before anything is built.

    Types are pydantic's to check; what only the component knows (a mixture's weights naming
    its own sources, a schedule that starts at step 0) it says here, so a recipe is refused
    by ``dew train --check`` and at load rather than when the run starts. Each problem is the
    field's sub-path and a message that says what is wrong and how to fix it.
    """

    @classmethod
    def field_problems(cls, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]: ...


@dataclass(frozen=True)
class Provider:
    """One registration: the name, where it points, and who ships it."""

    name: str
    value: str
    distribution: str
    entry_point: importlib_metadata.EntryPoint | None = None
    component: Any = None  # set for temporary registrations: any object a registry holds

    def load(self) -> Any:
        if self.component is not None:
            return self.component
        # An entry point may name extras after its object ("mod:Obj [extra]"): importlib reads past them.
        point = importlib_metadata.EntryPoint(name=self.name, value=self.value, group="")
        module_name, attribute = point.module, point.attr or ""
        try:
            # What a plugin prints as it is imported goes to stderr: stdout carries a command's
            # results (dew train --check, dew eval --json), which a script parses.
            with contextlib.redirect_stdout(sys.stderr):
                module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            raise MissingDistributionError(
                f"{self.name!r} from {self.distribution} could not be imported: "
                f"module {error.name!r} is missing. {self._install_hint(error.name or '')}"
            ) from error
        except Exception as error:  # the distribution's own code failed as it was imported
            raise ComponentLoadError(
                f"{self.name!r} from {self.distribution} (entry point {self.value!r}) failed as its module "
                f"was imported: {type(error).__name__}: {error}. The distribution is broken or was built for "
                f"another version of what it imports: reinstall or update {self.distribution}, or uninstall "
                "it.") from error
        obj = module
        for part in filter(None, attribute.split(".")):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise ComponentLoadError(
                    f"{self.name!r} from {self.distribution} names {self.value!r}, but {module_name} has no "
                    f"{attribute!r}: the distribution's entry point is wrong or out of date; reinstall or "
                    f"update {self.distribution}.") from None
        return obj

    @property
    def requirement(self) -> str:
        """What to install for this name: the distribution, with its entry point's extras."""
        extras = [] if self.entry_point is None else list(self.entry_point.extras)
        return f"{self.distribution}[{','.join(extras)}]" if extras else self.distribution

    def _install_hint(self, missing: str) -> str:
        """What to install: an extra that provides the missing module, or the distribution again."""
        module = self.value.partition(":")[0].strip()
        if module == missing or module.startswith(f"{missing}."):
            return (f"Its entry point names that module, which {self.distribution} does not hold: the entry "
                    f"point is wrong (fix it in {self.distribution}'s pyproject.toml and reinstall), or the "
                    f"install is incomplete (pip install --force-reinstall {self.distribution}).")
        if _normalize(missing.partition(".")[0]) == _normalize(module.partition(".")[0]):
            return (f"{self.distribution} looks incomplete; reinstall it: "
                    f"pip install --force-reinstall {self.distribution}.")
        extras = () if self.entry_point is None else tuple(self.entry_point.extras)
        return install_hint(self.distribution, missing, extras) + "."


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


_SCAN_LOCK = threading.Lock()

# The dew distribution whose pyproject registers a group's built-in names.
_BUILT_INS_FROM = {
    "dew.objectives": "dew-objectives",
    "dew.rewards": "dew-objectives",
    "dew.trackers": "dew-trackers",
    "dew.datasets": "dew-data",
    "dew.evaluations": "dew-objectives",
    "dew.environments": "dew-objectives",
}


def _installed(distribution: str) -> bool:
    try:
        importlib_metadata.distribution(distribution)
    except importlib_metadata.PackageNotFoundError:
        return False
    return True


class Registry:
    """The components registered under one entry-point group, resolved lazily.

    >>> from dew.registry import Registry
    >>> reg = Registry("dew.examples", "example")
    >>> with reg.temporary("double", lambda x: 2 * x):
    ...     reg.load("double")(21)
    42
    """

    def __init__(self, group: str, kind: str) -> None:
        self.group = group
        self.kind = kind
        self._scanned: dict[str, list[Provider]] | None = None
        self._temporary: dict[str, Provider] = {}
        self._loaded: dict[str, Any] = {}

    # -- scanning -----------------------------------------------------------
    def _providers(self) -> dict[str, list[Provider]]:
        if self._scanned is None:
            with _SCAN_LOCK:
                if self._scanned is None:
                    found: dict[str, list[Provider]] = {}
                    for ep in importlib_metadata.entry_points(group=self.group):
                        dist = ep.dist.name if ep.dist is not None else "<unknown>"
                        providers = found.setdefault(ep.name, [])
                        # The same distribution seen twice (an egg-link beside a
                        # wheel, say) is one registration, not a conflict.
                        if all(p.distribution != dist for p in providers):
                            providers.append(Provider(ep.name, ep.value, dist, ep))
                    for providers in found.values():  # deterministic messages
                        providers.sort(key=lambda p: p.distribution)
                    self._scanned = found
        merged = dict(self._scanned)
        for name, provider in self._temporary.items():
            merged[name] = [provider]
        return merged

    def refresh(self) -> None:
        """Forget the cached scan, after installing or removing a distribution."""
        self._scanned = None
        self._loaded.clear()

    def names(self) -> dict[str, str]:
        """Every registered name with the distribution that provides it."""
        return {
            name: " and ".join(p.distribution for p in providers)
            for name, providers in sorted(self._providers().items())
        }

    def __contains__(self, name: object) -> bool:
        return name in self._providers()

    def provider(self, name: str) -> Provider:
        """The one registration of name, or an error that says what exists."""
        providers = self._providers()
        if name not in providers:
            available = ", ".join(
                f"{n} ({' and '.join(p.requirement for p in ps)})"
                for n, ps in sorted(providers.items())
            ) or "none"
            close = difflib.get_close_matches(name, list(providers), n=3)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            builtin = _BUILT_INS_FROM.get(self.group)
            if builtin is not None and not _installed(builtin):
                hint += f" dew's own {self.kind}s ship with {builtin}, which is not installed: pip install {builtin}."
            raise UnknownNameError(
                f"No {self.kind} named {name!r} in entry-point group {self.group!r}.{hint} "
                f"Available: {available}. A component from another package appears "
                f"here once that distribution is installed."
            )
        found = providers[name]
        if len(found) > 1:
            raise NameConflictError(
                f"The {self.kind} name {name!r} in {self.group!r} is registered by "
                f"{len(found)} distributions: "
                + ", ".join(f"{p.distribution} ({p.value})" for p in found)
                + ". dew never picks one silently; uninstall one of them or rename its entry point."
            )
        return found[0]

    # -- loading and building -----------------------------------------------
    def load(self, name: str) -> Any:
        """Import and return the component registered as name (cached)."""
        if name in self._temporary:
            return self._temporary[name].component
        if name not in self._loaded:
            self._loaded[name] = self.provider(name).load()
        return self._loaded[name]

    def fields(self, name: str) -> dict[str, tuple[Any, Any]]:
        """The declared fields of a component: name -> (annotation, default)."""
        return declared_fields(self.load(name))

    def validate(self, name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Check kwargs against the component's declared fields, with pydantic."""
        return validate_fields(self.load(name), dict(kwargs), f"{self.kind} {name!r}")

    def build(self, name: str, /, **kwargs: Any) -> Any:
        """Validate kwargs, then construct the component registered as name."""
        component = self.load(name)
        checked = validate_fields(component, kwargs, f"{self.kind} {name!r}")
        return component(**checked)

    @contextlib.contextmanager
    def temporary(self, name: str, component: Any, distribution: str = "<test>") -> Iterator[Any]:
        """Register component as name for the duration of a with block."""
        previous = self._temporary.get(name)
        self._temporary[name] = Provider(name, repr(component), distribution, component=component)
        try:
            yield component
        finally:
            if previous is None:
                self._temporary.pop(name, None)
            else:
                self._temporary[name] = previous

    def __repr__(self) -> str:
        return f"Registry({self.group!r})"


# -- declared fields ---------------------------------------------------------

_FLAX_INTERNAL = {"parent", "name"}


def declared_fields(component: Any) -> dict[str, tuple[Any, Any]]:
    """Fields of a dataclass (Flax modules included) or a constructor's parameters."""
    if dataclasses.is_dataclass(component):
        try:
            hints = typing.get_type_hints(component)
        except Exception:  # noqa: BLE001 - unresolvable annotations fall back to Any
            hints = {}
        out = {}
        for f in dataclasses.fields(component):
            if f.name in _FLAX_INTERNAL or not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = ...
            out[f.name] = (hints.get(f.name, Any), default)
        return out
    target = component.__init__ if inspect.isclass(component) else component
    signature = inspect.signature(target)
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001
        hints = {}
    out = {}
    for p in signature.parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = ... if p.default is inspect.Parameter.empty else p.default
        out[p.name] = (hints.get(p.name, Any), default)
    return out


def accepts_var_keyword(component: Any) -> bool:
    """Whether a component's constructor takes **kwargs (so any keyword reaches it)."""
    if dataclasses.is_dataclass(component):
        return False
    target = component.__init__ if inspect.isclass(component) else component
    return any(
        p.kind is p.VAR_KEYWORD for p in inspect.signature(target).parameters.values()
    )


def validate_fields(component: Any, kwargs: dict[str, Any], what: str) -> dict[str, Any]:
    """kwargs checked against component's declared fields, mappings made into their types.

    Raises InvalidFieldsError naming every unknown or invalid field.
    """
    fields = declared_fields(component)
    unknown = [k for k in kwargs if k not in fields]
    if unknown and not accepts_var_keyword(component):
        lines = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(fields), n=1)
            lines.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise InvalidFieldsError(
            f"{what} has no field {', '.join(lines)}. Its fields are: {', '.join(fields)}."
        )
    known = {k: v for k, v in kwargs.items() if k in fields}
    flags = {k: message for k, v in known.items() if (message := flag_message(fields[k][0], v)) is not None}
    if flags:  # pydantic reads true as 1: a flag given where a count or size belongs is a mistake
        raise InvalidFieldsError(
            f"{what} got invalid fields: " + "; ".join(f"{k}: {m} (given {known[k]!r})" for k, m in flags.items())
            + f". Its fields are: {', '.join(fields)}.")
    model = pydantic.create_model(  # type: ignore[call-overload]
        f"{getattr(component, '__name__', 'Component')}Fields",  # a class, or any callable
        __config__=pydantic.ConfigDict(arbitrary_types_allowed=True, strict=False),
        **{k: (_lenient(fields[k][0]), fields[k][1]) for k in fields},
    )
    try:
        validated = model.model_validate(known)
    except pydantic.ValidationError as error:
        problems = []
        for e in error.errors():
            loc = ".".join(str(part) for part in e["loc"])
            given = e.get("input")
            given_text = "" if e["type"] == "missing" else f" (given {given!r})"
            problems.append(f"{loc}: {e['msg']}{given_text}")
        raise InvalidFieldsError(
            f"{what} got invalid fields: " + "; ".join(problems)
            + f". Its fields are: {', '.join(fields)}."
        ) from None
    # A mapping or list given for a structured field (a recipe's ``sampling: {temperature: 0.8}``)
    # becomes the declared type, as does a number given as text or a whole float given for an int
    # ("4", 4.0); every other value passes through as given.
    return {k: getattr(validated, k) if k in known and _converted(v, getattr(validated, k)) else v
            for k, v in kwargs.items()}


def _converted(given: Any, validated: Any) -> bool:
    """Whether a field takes pydantic's value rather than the one given: a structured field's
    mapping or list, or a scalar given in another type (text for a number, 4.0 for an int)."""
    if isinstance(given, dict | list):
        return True
    if isinstance(given, str):
        return isinstance(validated, int | float) and not isinstance(validated, bool)
    return isinstance(given, float) and type(validated) is int


def type_adapter(annotation: Any) -> pydantic.TypeAdapter | None:
    """pydantic's validator for annotation, or None when pydantic cannot build one."""
    for config in (pydantic.ConfigDict(arbitrary_types_allowed=True), None):
        try:
            return pydantic.TypeAdapter(annotation, config=config)
        except pydantic.PydanticUserError:  # a dataclass or model brings its own config
            continue
        except Exception:  # noqa: BLE001 - an annotation pydantic cannot build a schema for
            return None
    return None


def _lenient(annotation: Any) -> Any:
    """An annotation pydantic can check; anything it cannot becomes Any."""
    if annotation is Any or type_adapter(annotation) is None:
        return Any
    return annotation


# -- the groups ----------------------------------------------------------------

GROUPS = {
    "models": "dew.models",
    "objectives": "dew.objectives",
    "trackers": "dew.trackers",
    "datasets": "dew.datasets",
    "plugins": "dew.plugins",
    "rewards": "dew.rewards",
    "evaluations": "dew.evaluations",
    "environments": "dew.environments",
}

models = Registry("dew.models", "model")
objectives = Registry("dew.objectives", "objective")
trackers = Registry("dew.trackers", "tracker")
datasets = Registry("dew.datasets", "dataset")
plugins = Registry("dew.plugins", "plugin")
rewards = Registry("dew.rewards", "reward")
evaluations = Registry("dew.evaluations", "evaluation task")
environments = Registry("dew.environments", "environment")

_BY_GROUP = {r.group: r for r in (models, objectives, trackers, datasets, plugins, rewards, evaluations,
                                  environments)}


def registry(group: str) -> Registry:
    """The registry of an entry-point group (``dew.models``) or its short name (``models``)."""
    group = GROUPS.get(group, group)
    if group not in _BY_GROUP:
        raise UnknownNameError(
            f"No registry for group {group!r}; the groups are {', '.join(GROUPS.values())}."
        )
    return _BY_GROUP[group]
