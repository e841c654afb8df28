"""Lifecycle hooks: code a plugin runs when a run starts, logs, evaluates, saves or ends.

The hooks are pluggy hook specifications under the project name ``"dew"``.
A plugin is any object (a module, an instance) whose functions carry the
``hookimpl`` marker and are named after a hook; each implementation may take
any subset of its hook's arguments. Installed plugins announce themselves in
the ``dew.plugins`` entry-point group and are loaded the first time
``hook()`` is called, never at import time::

    # in the plugin distribution's pyproject.toml
    [project.entry-points."dew.plugins"]
    my_plugin = "my_package.hooks"

    # my_package/hooks.py
    from dew.plugins import hookimpl

    @hookimpl
    def dew_step_end(step, metrics):
        print(step, metrics["train/loss"])

The trainer fires them with keyword arguments, ``hook().dew_step_end(step=s,
metrics=m)``. Two environment variables, read when the plugin manager is
first built, control loading: ``DEW_DISABLE_PLUGIN_AUTOLOAD=1`` loads no
entry-point plugin at all, and ``DEW_BLOCK_PLUGINS=a,b`` skips (and refuses)
the plugins registered under those names.

>>> from dew.plugins import hookimpl, hook, registered
>>> class Printer:
...     @hookimpl
...     def dew_step_end(self, step):
...         print("step", step)
>>> with registered(Printer()):
...     _ = hook().dew_step_end(step=3, metrics={"loss": 0.5})
step 3
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import threading
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from dew.errors import DewError

if TYPE_CHECKING:
    from dew.training.evaluation import Evaluation
    from dew.training.state import TrainState
    from dew.training.trainer import Trainer

__all__ = [
    "AUTOLOAD_VARIABLE",
    "BLOCK_VARIABLE",
    "PROJECT",
    "HookImplementationError",
    "StepContribution",
    "Hooks",
    "PluginHookError",
    "PluginLoadError",
    "blamed",
    "hook",
    "hookimpl",
    "hookspec",
    "implementations",
    "manager",
    "passed_arguments",
    "plugin_object",
    "registered",
]

PROJECT = "dew"
AUTOLOAD_VARIABLE = "DEW_DISABLE_PLUGIN_AUTOLOAD"
BLOCK_VARIABLE = "DEW_BLOCK_PLUGINS"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookImplementationError(DewError, TypeError):
    """A plugin implements a hook that does not exist, or takes an argument the hook lacks."""


class PluginHookError(DewError, RuntimeError):
    """A plugin's hook implementation raised while the run fired it (the plugin's own error)."""


class PluginLoadError(DewError, RuntimeError):
    """An installed plugin failed while being imported or instantiated; the message names its
    entry point, its distribution and the switch that skips it."""


@dataclass(frozen=True)
class StepContribution:
    """What a ``dew_step_end`` implementation may return: scalars to log, a request to stop.

    scalars are logged with the step's own (the tracker and the console see
    them together). stop asks the run to end: a step's metrics are read while
    the next one runs, so the run ends after that next step, which the trainer
    saves, evaluates as its last and returns normally; reason is printed. A
    hook may also return a plain mapping (scalars only) or None.

    >>> StepContribution.of({"my/score": 1.0}).scalars
    {'my/score': 1.0}
    >>> StepContribution.of(None).stop
    False
    """

    scalars: Mapping[str, float] = field(default_factory=dict)
    stop: bool = False
    reason: str = ""

    @classmethod
    def of(cls, result: Any) -> StepContribution:
        """Read one hook's return value."""
        if result is None:
            return cls()
        if isinstance(result, StepContribution):
            return result
        if isinstance(result, Mapping):
            return cls(scalars=dict(result))
        raise HookImplementationError(
            f"A dew_step_end hook returned {type(result).__name__}; it may return None, a "
            "mapping of scalars to log, or a dew.plugins.StepContribution."
        )


class Hooks:
    """The hook specifications: every hook dew fires, with the arguments it passes.

    Only ``dew_step_end`` may return something (a ``StepContribution`` or a
    mapping of scalars); other results are ignored. A hook is called on
    the process that runs the trainer's host loop, between steps.
    """

    @hookspec
    def dew_run_start(self, trainer: Trainer, start: int, steps: int) -> None:
        """The trainer is about to run; start is the first step (after a resume) and
        steps the step count fit() trains to."""

    @hookspec
    def dew_step_end(self, step: int, metrics: Mapping[str, float]) -> StepContribution | Mapping[str, float] | None:
        """A log step finished; metrics holds the scalars the host read for it.

        Return None, a mapping of further scalars to log with them, or a
        StepContribution (scalars, and stop=True to end the run at this step)."""

    @hookspec
    def dew_evaluation(self, step: int, evaluation: Evaluation) -> None:
        """The validation split was scored at step; evaluation is the trainer's
        Evaluation result (its reduced metrics and artifacts)."""

    @hookspec
    def dew_checkpoint(self, step: int, path: str) -> None:
        """A checkpoint of step was handed to the writer; path is its directory."""

    @hookspec
    def dew_preempted(self, step: int) -> None:
        """A preemption notice stopped the run at step, after its state was saved."""

    @hookspec
    def dew_run_end(self, step: int, state: TrainState) -> None:
        """fit() finished at step; state is the final TrainState."""


_SPEC_ARGUMENTS: dict[str, tuple[str, ...]] = {
    name: tuple(p for p in inspect.signature(function).parameters if p != "self")
    for name, function in vars(Hooks).items()
    if name.startswith("dew_")
}

_MANAGER: pluggy.PluginManager | None = None
_LOCK = threading.Lock()


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _blocked_names() -> list[str]:
    return [n.strip() for n in os.environ.get(BLOCK_VARIABLE, "").split(",") if n.strip()]


def implementations(plugin: object) -> list[tuple[str, tuple[str, ...]]]:
    """Each hook implementation plugin holds, in name order: the hook it implements and the
    arguments it takes (those a call passes by name)."""
    parser = pluggy.PluginManager(PROJECT)  # only its reading of the hookimpl markers is used
    found = []
    for attribute in dir(plugin):
        try:
            options = parser.parse_hookimpl_opts(plugin, attribute)
        except Exception:  # noqa: BLE001 - attributes that fail to resolve are not hooks
            continue
        if options is None:
            continue
        parameters = tuple(
            p.name for p in inspect.signature(getattr(plugin, attribute)).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self")
        found.append((options.get("specname") or attribute, parameters))
    return found


def passed_arguments(hook_name: str) -> tuple[str, ...] | None:
    """The arguments dew passes to hook_name (None: dew has no such hook)."""
    return _SPEC_ARGUMENTS.get(hook_name)


def _check(plugin: object, name: str) -> None:
    """Refuse an implementation of an unknown hook or with an argument its hook lacks."""
    for hook_name, parameters in implementations(plugin):
        allowed = passed_arguments(hook_name)
        if allowed is None:
            close = difflib.get_close_matches(hook_name, list(_SPEC_ARGUMENTS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise HookImplementationError(
                f"Plugin {name!r} implements hook {hook_name!r}, which dew does not have.{hint} "
                f"The hooks are: {', '.join(_SPEC_ARGUMENTS)}."
            )
        extra = [p for p in parameters if p not in allowed]
        if extra:
            raise HookImplementationError(
                f"Plugin {name!r} implements hook {hook_name!r} with argument(s) "
                f"{', '.join(repr(p) for p in extra)} that the hook does not pass. "
                f"{hook_name} passes: {', '.join(allowed)}; an implementation may take "
                f"any subset of them."
            )


def plugin_object(loaded: object) -> object:
    """What a dew.plugins entry point registers: the object it names, or an instance of it when it
    names a class (made with no arguments, as pytest's plugins are)."""
    return loaded() if inspect.isclass(loaded) else loaded


def _register(plugin_manager: pluggy.PluginManager, plugin: object, name: str | None) -> str:
    name = name or plugin_manager.get_canonical_name(plugin)
    _check(plugin, name)
    try:
        registered_name = plugin_manager.register(plugin, name=name)
    except pluggy.PluginValidationError as error:
        raise HookImplementationError(f"Plugin {name!r} was refused: {error}") from error
    if registered_name is None:
        raise HookImplementationError(
            f"Plugin {name!r} is blocked (listed in {BLOCK_VARIABLE} or blocked earlier); "
            f"remove it from {BLOCK_VARIABLE} to use it."
        )
    return registered_name


def _autoload(plugin_manager: pluggy.PluginManager) -> None:
    # Imported here: the registry (and importlib_metadata) is only needed on first use.
    from dew.registry import ComponentLoadError
    from dew.registry import plugins as entry_points

    blocked = set(_blocked_names())
    for name in entry_points.names():
        if name in blocked:
            continue
        provider = entry_points.provider(name)  # raises if two distributions claim name
        try:
            plugin = plugin_object(entry_points.load(name))
        except Exception as failure:  # noqa: BLE001 - any failure of foreign code is named, then re-raised
            # The plugin's own exception, not the registry's wrapping of it, is what this names.
            error = failure.__cause__ if isinstance(failure, ComponentLoadError) and \
                isinstance(failure.__cause__, Exception) else failure
            raise PluginLoadError(
                f"The plugin {name!r} (entry point {name} = {provider.value} in group "
                f"'dew.plugins', from the distribution {provider.distribution}) failed to load: "
                f"{type(error).__name__}: {str(error).rstrip('.')}. Every run loads installed plugins, so fix or "
                f"uninstall {provider.distribution}, or skip this plugin with "
                f"{BLOCK_VARIABLE}={name} ({AUTOLOAD_VARIABLE}=1 skips them all)."
            ) from error
        try:
            _register(plugin_manager, plugin, name)
        except HookImplementationError as error:  # the same fix as a load failure's, named with it
            raise HookImplementationError(
                f"{error} The plugin is the entry point {name} = {provider.value} in group 'dew.plugins' of "
                f"the distribution {provider.distribution}; every run loads installed plugins, so fix or "
                f"uninstall {provider.distribution}, or skip this plugin with {BLOCK_VARIABLE}={name} "
                f"({AUTOLOAD_VARIABLE}=1 skips them all)."
            ) from error


def _build() -> pluggy.PluginManager:
    plugin_manager = pluggy.PluginManager(PROJECT)
    plugin_manager.add_hookspecs(Hooks)
    for name in _blocked_names():
        plugin_manager.set_blocked(name)
    if not _truthy(os.environ.get(AUTOLOAD_VARIABLE)):
        _autoload(plugin_manager)
    return plugin_manager


def manager() -> pluggy.PluginManager:
    """The plugin manager, built on first call with the installed plugins loaded."""
    global _MANAGER
    plugin_manager = _MANAGER
    if plugin_manager is None:
        with _LOCK:
            if _MANAGER is None:
                _MANAGER = _build()
            plugin_manager = _MANAGER
    return plugin_manager


def hook() -> pluggy.HookRelay:
    """The hook relay the trainer fires: ``hook().dew_step_end(step=..., metrics=...)``.

    Cheap after the first call (a global read); the first call loads the
    installed plugins.
    """
    plugin_manager = _MANAGER
    if plugin_manager is None:
        plugin_manager = manager()
    return plugin_manager.hook


@contextlib.contextmanager
def registered(plugin: object, name: str | None = None) -> Iterator[object]:
    """Register plugin for the duration of a with block (checked like an installed one). Its name,
    unless given, is its class's (a module's own name), numbered when that one is taken."""
    plugin_manager = manager()
    chosen = name or _readable_name(plugin_manager, plugin)
    _register(plugin_manager, plugin, chosen)
    _IN_PROGRAM.add(chosen)
    try:
        yield plugin
    finally:
        _IN_PROGRAM.discard(chosen)
        plugin_manager.unregister(plugin)


_IN_PROGRAM: set[str] = set()  # the names of plugins registered by the running program, not installed


def _readable_name(plugin_manager: pluggy.PluginManager, plugin: object) -> str:
    base = plugin.__name__ if isinstance(plugin, types.ModuleType) else type(plugin).__name__
    taken = {name for name, _ in plugin_manager.list_name_plugin()}
    name, number = base, 1
    while name in taken:
        number += 1
        name = f"{base}-{number}"
    return name


def _culprit(error: BaseException) -> str | None:
    """The name of the registered plugin whose hook implementation raised error (its traceback
    passes through that function), or None when none did."""
    plugin_manager = _MANAGER
    if plugin_manager is None:
        return None
    codes = {impl.function.__code__: impl.plugin_name
             for name in vars(Hooks) if name.startswith("dew_")
             for impl in getattr(plugin_manager.hook, name).get_hookimpls()}
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code in codes:
            return codes[frame.tb_frame.f_code]
        frame = frame.tb_next
    return None


@contextlib.contextmanager
def blamed(hook_name: str) -> Iterator[None]:
    """Fire a hook inside this block: a plugin's own error is raised again as PluginHookError naming
    the plugin and how to skip it, not as a traceback that reads as dew's bug."""
    try:
        yield
    except DewError:
        raise
    except Exception as error:
        name = _culprit(error)
        if name is None:
            raise
        remedy = ("Fix it (this program registered it, dew.plugins.registered)" if name in _IN_PROGRAM else
                  f"Fix or uninstall the distribution that ships it, or skip it with {BLOCK_VARIABLE}={name}")
        raise PluginHookError(
            f"The plugin {name!r} raised {type(error).__name__}: {error} in its {hook_name} hook. {remedy}; "
            "a run with checkpoints resumes from its last one.") from error
