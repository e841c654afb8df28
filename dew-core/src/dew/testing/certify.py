"""Certify an installed distribution's dew components with dew's conformance kits.

A distribution registers its components through entry points (``dew.models``,
``dew.objectives``, ``dew.trackers``, ``dew.datasets``, ``dew.rewards``,
``dew.environments``, ``dew.plugins``) and, for each, a subclass of the matching kit of
``dew.testing`` under ``dew.conformance``, by the same name::

    [project.entry-points."dew.conformance"]
    my_objective = "my_package.conformance:MyObjectiveKit"

The kit subclass supplies the component and example inputs (the kit's
factory methods); the checks are the installed dew's. ``certify`` runs each
kit in a fresh interpreter (``python -m dew.testing.certify``), every
``test_*`` method of it, and collects one result per check. A reward without
a kit of its own is checked with ``RewardKit``'s defaults; a hook module
(``dew.plugins``) is registered with dew's plugin manager, which checks
every implementation against dew's hook specifications. A component with
no kit is still loaded (a load failure fails), then reported unchecked,
which fails the certification. So do a name another installed distribution
registers in the same group (every recipe naming it would fail with
NameConflictError) and a kit whose name is no component's of the distribution.
"""

from __future__ import annotations

import difflib
import inspect
import json
import subprocess
import sys
import tempfile
import time
import traceback
import typing
import unittest
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from dew.errors import DewError

__all__ = [
    "CONFORMANCE", "GROUPS", "Check", "Component", "NotADistributionError", "certify", "checks_of", "clashes",
    "stray_kits", "subjects",
]

CONFORMANCE = "dew.conformance"
# Component groups, with the kit (module, class) that checks each and the factory method that builds one.
GROUPS: dict[str, tuple[str, str, str | None]] = {
    "dew.objectives": ("dew.testing.objective", "ObjectiveKit", "objective"),
    "dew.models": ("dew.testing.model", "ModelKit", "model"),
    "dew.trackers": ("dew.testing.tracker", "TrackerKit", None),
    "dew.datasets": ("dew.testing.dataset", "DatasetReaderKit", None),
    "dew.rewards": ("dew.testing.reward", "RewardKit", "reward"),
    "dew.environments": ("dew.testing.environment", "EnvironmentKit", "environment"),
    "dew.evaluations": ("dew.testing.evaluation", "EvaluationTaskKit", "task"),
    "dew.plugins": ("dew.plugins", "hooks", None),
}
_KIND = {"dew.objectives": "objective", "dew.models": "model", "dew.trackers": "tracker",
         "dew.datasets": "reader", "dew.rewards": "reward", "dew.environments": "environment",
         "dew.evaluations": "evaluation task", "dew.plugins": "hooks"}


class NotADistributionError(DewError, LookupError):
    """No installed distribution has that name, or it registers no dew component."""


@dataclass(frozen=True)
class Component:
    """One registered component and the kit that checks it (None: no kit registered)."""

    group: str
    name: str
    value: str
    kit: str | None

    @property
    def label(self) -> str:
        return f"{_KIND[self.group]} `{self.name}`"


@dataclass(frozen=True)
class Check:
    """One check's outcome: passed, failed, skipped or unchecked, with what went wrong."""

    subject: str
    check: str
    result: str
    message: str = ""
    seconds: float = 0.0


def subjects(distribution: str) -> tuple[str, list[Component]]:
    """The distribution's version and its components, each with its registered kit."""
    found = _distribution(distribution)
    points = list(found.entry_points)
    kits = {p.name: p.value for p in points if p.group == CONFORMANCE}
    listed = [Component(p.group, p.name, p.value,
                        kits.get(_qualified(p.group, p.name), kits.get(p.name)) if p.group != "dew.plugins" else "hooks")
              for p in points if p.group in GROUPS]
    if not listed:
        raise NotADistributionError(
            f"{found.metadata['Name']} registers no dew component: none of its entry points is in the groups "
            f"{', '.join(GROUPS)}.")
    return found.version, listed


def _distribution(distribution: str) -> metadata.Distribution:
    """The installed distribution of that name, or an error naming those that register dew components."""
    if not distribution.strip():  # importlib.metadata raises a bare ValueError for an empty name
        raise NotADistributionError(
            "No distribution was named; give the installed distribution's name, as its pyproject.toml "
            f"declares it; distributions registering dew components here: {', '.join(_registering()) or 'none'}.")
    try:
        return metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise NotADistributionError(
            f"No installed distribution is named {distribution!r}. Install it (pip install ...) in this "
            f"environment, or give the name its pyproject.toml declares; distributions registering dew "
            f"components here: {', '.join(_registering()) or 'none'}.") from None


def clashes(distribution: str, subject: Component) -> list[Check]:
    """A failed check naming each other installed distribution that registers subject's name in its
    group: while both are installed, every recipe naming it fails with NameConflictError."""
    mine = canonicalize_name(distribution)
    others = {point.dist.metadata["Name"]: point.value
              for point in metadata.entry_points(group=subject.group, name=subject.name)
              if point.dist is not None and canonicalize_name(point.dist.metadata["Name"]) != mine}
    return [Check(subject.label, "no other distribution registers its name", "failed",
                  f"{other} registers {subject.name!r} in {subject.group} too ({value}), so while both are "
                  f"installed every recipe naming {subject.name!r} fails with NameConflictError: rename the entry "
                  f"point {subject.name} = {subject.value} in {distribution}'s pyproject.toml (a name of its own, "
                  f"such as one starting with the package's name) and reinstall it.")
            for other, value in sorted(others.items())]


def _qualified(group: str, name: str) -> str:
    """A kit's name for one group's component (``models/twin``): a name a distribution registers in two
    groups takes a kit for each, where the plain name can hold one."""
    return f"{group.removeprefix('dew.')}/{name}"


def stray_kits(distribution: str, listed: list[Component]) -> list[Check]:
    """A failed check for each dew.conformance kit whose name is no component's of distribution: it
    checks nothing (a misspelled name, or one left behind by a rename)."""
    names = sorted({subject.name for subject in listed})
    accepted = set(names) | {_qualified(subject.group, subject.name) for subject in listed}
    found = [Check(f"kit `{point.name}`", "names a component of the distribution", "failed",
                   f"the {CONFORMANCE} entry point {point.name} = {point.value} of {distribution} names no component "
                   f"of it, so it checks nothing{_did_you_mean(point.name, names)}: register the kit under the "
                   f"name of the component it checks (its components: {', '.join(names)}).")
             for point in _distribution(distribution).entry_points
             if point.group == CONFORMANCE and point.name not in accepted]
    return sorted(found, key=lambda check: check.subject)


def _did_you_mean(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _registering() -> list[str]:
    names = set()
    for group in GROUPS:
        for point in metadata.entry_points(group=group):
            if point.dist is not None:
                names.add(point.dist.metadata["Name"])
    return sorted(names)


def _readable(method: str) -> str:
    return method.removeprefix("test_").replace("_", " ")


def _load(value: str) -> Any:
    """What an entry point's value names (``module:attr``, extras such as ``[tensorboard]`` aside),
    resolved as importlib.metadata resolves an installed one."""
    return metadata.EntryPoint(name="", value=value, group="").load()


def _tests(kit: type) -> list[str]:
    """The kit's test methods in definition order, base classes first."""
    names: list[str] = []
    for cls in reversed(kit.__mro__):
        names += [n for n in vars(cls) if n.startswith("test_") and callable(vars(cls)[n]) and n not in names]
    return names


def _run_method(kit: Any, name: str, subject: str) -> Check:
    method = getattr(kit, name)
    began = time.perf_counter()
    try:
        if "tmp_path" in inspect.signature(method).parameters:
            with tempfile.TemporaryDirectory(prefix="dew-certify-") as directory:
                method(Path(directory))
        else:
            method()
    except unittest.SkipTest as skip:
        return Check(subject, _readable(name), "skipped", str(skip), time.perf_counter() - began)
    except Exception as error:  # noqa: BLE001 - a kit's failure is this check's result
        message = str(error).strip() or type(error).__name__
        if not isinstance(error, AssertionError):
            message = f"{type(error).__name__}: {message}\n{traceback.format_exc(limit=-3)}"
        return Check(subject, _readable(name), "failed", message[-4000:], time.perf_counter() - began)
    return Check(subject, _readable(name), "passed", "", time.perf_counter() - began)


def checks_of(subject: Component) -> list[Check]:
    """Run one subject's checks in this interpreter (the child process ``certify`` starts)."""
    label = subject.label
    hooks = subject.group == "dew.plugins"
    try:  # a hooks plugin that is a class is made as every run makes it, so a failing __init__ shows
        from dew.plugins import plugin_object, registered

        component = plugin_object(_load(subject.value)) if hooks else _load(subject.value)
    except Exception as error:  # noqa: BLE001 - the component's own module, not its kit, failed
        return [Check(label, "it loads", "failed",
                      f"its entry point {subject.name} = {subject.value} failed to load: {type(error).__name__}: "
                      f"{error}. Fix the entry point (or install what its module imports, declared in the "
                      "distribution's dependencies) and reinstall the distribution.")]
    if hooks:
        def hooks_match_the_hook_specifications() -> None:
            with registered(component, name=subject.name):
                pass

        return [_call(label, hooks_match_the_hook_specifications)]
    module, base, factory = GROUPS[subject.group]
    if not callable(component):  # a module or a constant: nothing a recipe or a kit can build
        return [Check(label, "it names a class or function", "failed",
                      f"its entry point {subject.name} = {subject.value} names a value of type {type(component).__name__}, not "
                      "the class (or function) that builds the component; point it at that class as "
                      "'package.module:ClassName' and reinstall the distribution.")]
    if subject.kit is None and subject.group != "dew.rewards":
        return [Check(label, "it loads", "passed"), _unchecked(subject)]
    kit_class: type
    if subject.kit is None and subject.group == "dew.rewards":
        from dew import registry
        from dew.registry import InvalidFieldsError

        try:  # the default kit builds it with no fields: one that needs some is the kit's to give
            registry.rewards.build(subject.name)
        except InvalidFieldsError as error:
            return [Check(label, "it loads", "passed"), Check(
                label, "has a conformance kit", "unchecked",
                f"it cannot be built without fields ({error}), so the default reward checks cannot score it; "
                f"{_unchecked(subject).message}, whose reward() builds it with them")]
        kit_class = type("DefaultRewardKit", (_load(f"{module}:{base}"),),
                         {"reward": lambda self: registry.rewards.build(subject.name)})
        try:  # the defaults are text completions with no context: a reward reading more needs its kit
            kit_class()._scores()
        except AssertionError:
            pass  # it scored them, wrongly: the checks below fail it, saying how
        except Exception as error:  # noqa: BLE001 - without a kit, what it reads cannot be told from a fault
            return [Check(label, "it loads", "passed"), Check(
                label, "has a conformance kit", "unchecked",
                f"the default reward checks score text completions with an empty context, which it could not "
                f"({type(error).__name__}: {error}); {_unchecked(subject).message}, whose completions() and "
                "context() give what it reads")]
    else:
        kit_class = _load(subject.kit or "")
    expected = _load(f"{module}:{base}")
    if not (isinstance(kit_class, type) and issubclass(kit_class, expected)):
        return [Check(label, "its kit is dew's", "failed",
                      f"{subject.kit} is not a subclass of dew.testing.{base}, the kit for {subject.group}. A name "
                      f"registered in two groups takes a kit for each: register this one's as "
                      f"{_qualified(subject.group, subject.name)!r}.")]
    results = []
    made = _made_class(component)
    if factory is not None and made is not None:
        def kit_builds_the_registered_component() -> None:
            built = getattr(kit_class(), factory)()
            assert isinstance(built, made), (
                f"The kit's {factory}() builds a {type(built).__name__}, not the {made.__name__} the "
                f"registered {subject.value} makes: it would certify another component.")

        results.append(_call(label, kit_builds_the_registered_component))
    elif factory is not None:
        results.append(Check(
            label, "kit builds the registered component", "unchecked",
            f"its entry point {subject.value} is a function that declares no class it returns, so what the "
            f"kit's {factory}() builds cannot be matched to it; annotate its return type (-> TheClass)"))
    elif subject.group == "dew.trackers" and made is not None:
        def kit_builds_the_registered_tracker() -> None:
            with tempfile.TemporaryDirectory(prefix="dew-kit-") as directory:
                built = kit_class().tracker(Path(directory))
                try:
                    assert isinstance(built, made), (
                        f"The kit's tracker() builds a {type(built).__name__}, not the registered "
                        f"{made.__name__}: it would certify another tracker.")
                finally:
                    close = getattr(built, "close", None)
                    if callable(close):
                        close()

        results.append(_call(label, kit_builds_the_registered_tracker))
    elif subject.group == "dew.datasets" and isinstance(component, type):
        def kit_builds_the_registered_reader() -> None:
            made: list[object] = []
            reader: Any = component  # its __init__ is wrapped for the call, then put back
            original = reader.__init__

            def recording(self: object, *args: Any, **kwargs: Any) -> None:
                made.append(self)
                original(self, *args, **kwargs)

            reader.__init__ = recording  # this interpreter checks this one component alone
            try:
                kit_class().dataset()
            finally:
                reader.__init__ = original
            assert made, (f"The kit's dataset() builds no {component.__name__}, the registered reader: it "
                          "would certify another reader's data.")

        results.append(_call(label, kit_builds_the_registered_reader))
    kit = kit_class()
    results += [_run_method(kit, name, label) for name in _tests(kit_class)]
    return results


def _made_class(component: Any) -> type | None:
    """The class of what a registered component builds: the class itself, or the class a function
    declares it returns (a family's builder says CausalTransformer); None when it declares none."""
    if isinstance(component, type):
        return component
    try:
        made = inspect.signature(component).return_annotation
        if isinstance(made, str):  # a postponed annotation, read where the function is defined
            made = typing.get_type_hints(component).get("return")
    except Exception:  # noqa: BLE001 - an annotation that cannot be read declares nothing usable
        return None
    return made if isinstance(made, type) and made is not inspect.Signature.empty else None


def _unchecked(subject: Component) -> Check:
    return Check(subject.label, "has a conformance kit", "unchecked",
                 f"register a subclass of dew.testing.{GROUPS[subject.group][1]} under the entry-point group "
                 f"{CONFORMANCE} as {subject.name!r}")


def _call(label: str, function: Any) -> Check:
    holder = type("Single", (), {f"test_{function.__name__}": staticmethod(function)})
    return _run_method(holder, f"test_{function.__name__}", label)


def certify(distribution: str, *, timeout: float = 1800) -> tuple[str, list[Check]]:
    """Every component of distribution checked, each kit in a fresh interpreter; (version, checks)."""
    version, listed = subjects(distribution)
    name = _distribution(distribution).metadata["Name"]  # as its pyproject.toml spells it
    results = stray_kits(name, listed)
    for subject in listed:  # one without a kit is still loaded there: a load failure fails
        results += clashes(name, subject) + _in_child(subject, timeout)
    return version, results


def _in_child(subject: Component, timeout: float) -> list[Check]:
    import os

    from dew.plugins import AUTOLOAD_VARIABLE

    # Each component alone: no other installed plugin's hooks run beside its checks.
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), **{AUTOLOAD_VARIABLE: "1"})
    env.pop("XLA_FLAGS", None)  # one device: a kit's many-device checks start their own children
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "dew.testing.certify", json.dumps(asdict(subject))],
                              capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [Check(subject.label, "finishes", "failed", f"its checks ran longer than {timeout:g} s",
                      time.perf_counter() - began)]
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"checks"')]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip()[-3000:]
        return [Check(subject.label, "its kit runs", "failed",
                      f"the checking process exited with status {done.returncode}:\n{tail}")]
    return [Check(**check) for check in json.loads(lines[-1])["checks"]]


def main(argv: list[str]) -> int:
    subject = Component(**json.loads(argv[1]))
    try:
        found = checks_of(subject)
    except Exception as error:  # noqa: BLE001 - a kit that cannot be loaded is this subject's result
        found = [Check(subject.label, "its kit loads", "failed", f"{type(error).__name__}: {error}")]
    print(json.dumps({"checks": [asdict(check) for check in found]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
