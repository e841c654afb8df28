"""``dew describe [NAME]``: a registered component's fields, with their types and defaults.

Without NAME, every registered name by group. A name registered in two groups
(a tracker and a dataset both called ``local``, say) is picked with its group:
``dew describe trackers/local``.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import TYPE_CHECKING, Any

from dew.errors import DewError

if TYPE_CHECKING:
    from dew.registry import Provider, Registry

__all__ = ["NotAComponentError", "UnknownComponentError", "add_arguments", "describe", "markdown", "run"]

# What a recipe run hands an objective that declares it in Objective.run_inputs.
SUPPLIED = {"model": "supplied by the recipe (its model section)",
            "tokenizer": "taken from the data reader when the recipe sets none"}


class UnknownComponentError(DewError, LookupError):
    """No registry holds the name, or more than one does and the group was not given."""


class NotAComponentError(DewError, TypeError):
    """An entry point names something a recipe cannot build: a module or a constant, not a class
    or function (a hook plugin's module, in dew.plugins, is described as one)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME",
                        help="a registered name (causal_transformer, lm, local, ...), optionally "
                             "GROUP/NAME; omit to list every name")
    parser.add_argument("--markdown", action="store_true",
                        help="every registered name as a Markdown table, by distribution and "
                             "group (docs/plugins.md shows it)")


def _where(name: str) -> tuple[str, str]:
    from dew import registry

    group, _, bare = name.rpartition("/")
    if group:
        if group not in registry.GROUPS:
            raise UnknownComponentError(
                f"No group {group!r}; the groups are {', '.join(registry.GROUPS)}.")
        if bare not in registry.registry(group):
            raise UnknownComponentError(
                f"No {group} component is named {bare!r}; `dew describe` lists them.")
        return group, bare
    found = [g for g in registry.GROUPS if bare in registry.registry(g)]
    if not found:
        raise UnknownComponentError(
            f"Nothing is registered as {bare!r}; `dew describe` with no name lists every name.")
    if len(found) > 1:
        raise UnknownComponentError(
            f"{bare!r} names a component in {' and '.join(found)}; say which, e.g. "
            f"`dew describe {found[0]}/{bare}`.")
    return found[0], bare


def _default_text(default: object) -> str:
    if default is ...:
        return "required"
    if inspect.isfunction(default) or inspect.isclass(default):
        return f"= {default.__qualname__}"
    return f"= {default!r}"


def describe(name: str) -> str:
    """The text ``dew describe name`` prints: where the component comes from, then its fields.

    >>> print(describe("local").splitlines()[0])
    local (trackers, from dew-core): dew.tracking.local:LocalTracker
    """
    from dew import registry

    group, bare = _where(name)
    table = registry.registry(group)
    provider = table.provider(bare)
    component = table.load(bare)
    lines = [f"{bare} ({group}, from {provider.distribution}): {provider.value}"]
    if group != "plugins" and not callable(component):  # its docstring would be its type's
        raise NotAComponentError(_not_callable(component, table, provider))
    doc = inspect.getdoc(component) or ""
    if doc:
        lines += ["", doc.split("\n\n")[0]]
    if group == "plugins":  # a module (or object) of hook implementations, which has no fields
        return "\n".join(lines + ["", *_hook_lines(component)])
    fields = registry.declared_fields(component)
    from dew.recipes.components import run_inputs

    supplied = {k: v for k, v in SUPPLIED.items() if k in run_inputs(component)}
    if not fields:
        lines += ["", "no fields"]
        return "\n".join(lines)
    lines += ["", "fields (in a recipe, under its section next to `name:`):"]
    lines += _rows(fields, supplied)
    # A registered reader is any class (a third party's too); one without load has no keywords.
    load = getattr(component, "load", None) if group == "datasets" else None
    if callable(load):
        keywords = {k: v for k, v in registry.declared_fields(load).items() if k != "batch"}
        lines += ["", "load keywords (in a recipe, under data.load; batch is data.batch, and "
                  "seed is the recipe's seed unless set here):"]
        lines += _rows(keywords, {}) if keywords else ["  none"]
    return "\n".join(lines)


def _not_callable(component: object, table: Registry, provider: Provider) -> str:
    """The refusal of an entry point that names neither a class nor a function."""
    what = (f"the module {component.__name__}" if inspect.ismodule(component)
            else f"the {type(component).__name__} {component!r:.40}")
    hooks = " (a module of hook implementations belongs in dew.plugins)" if inspect.ismodule(component) else ""
    return (f"{provider.name!r} from {provider.distribution} is the entry point {provider.name} = "
            f"{provider.value!r} in {table.group}, which names {what}, not a class or function{hooks}: a "
            f"{table.kind} entry point names the class (or function) that builds one, as "
            f"'package.module:ClassName'; fix it in {provider.distribution}'s pyproject.toml and reinstall it.")


def _hook_lines(plugin: object) -> list[str]:
    """The hooks plugin implements, each with the arguments it takes and what is wrong with them."""
    from dew.plugins import implementations

    found = [f"  {hook}({', '.join(taken)}){_hook_problem(hook, taken)}" for hook, taken in implementations(plugin)]
    if not found:
        return ["hooks: none (no function in it is marked with dew.plugins.hookimpl)"]
    return ["hooks it implements (a hook plugin has no fields; every run loads it):", *found]


def _hook_problem(hook: str, taken: tuple[str, ...]) -> str:
    """Why a run would refuse an implementation of hook taking the arguments taken; empty if none."""
    from dew.plugins import passed_arguments

    passed = passed_arguments(hook)
    if passed is None:
        return "  <- dew has no such hook; a run refuses this plugin"
    extra = [p for p in taken if p not in passed]
    if extra:
        return (f"  <- {hook} passes {', '.join(passed)}, not {', '.join(extra)}; a run refuses "
                "this plugin")
    return ""


def _rows(fields: dict[str, tuple[Any, Any]], supplied: dict[str, str]) -> list[str]:
    from dew.cli.train import _type_name

    rows = [(field, _type_name(annotation),
             supplied[field] if field in supplied else _default_text(default))
            for field, (annotation, default) in fields.items()]
    width = max(len(r[0]) for r in rows) + 2
    kinds = min(max(len(r[1]) for r in rows), 40)
    return [f"  {field:<{width}}{kind.ljust(kinds)}  {default}" for field, kind, default in rows]


def listing() -> str:
    """Every registered name, by group, with the distribution that ships it."""
    from dew import registry

    lines = []
    for group in registry.GROUPS:
        names = registry.registry(group).names()
        lines.append(f"{group}:")
        lines += [f"  {name:<24}{dist}" for name, dist in sorted(names.items())] or ["  (none)"]
    lines.append("\n`dew describe NAME` lists a component's fields.")
    return "\n".join(lines)


def markdown() -> str:
    """Every registered name as a Markdown table: one row per distribution and group, in the
    order of the groups. docs/plugins.md shows it (a test keeps the two the same)."""
    from dew import registry

    rows: dict[tuple[str, str], list[str]] = {}
    for group, entry_points in registry.GROUPS.items():
        for name, distribution in sorted(registry.registry(group).names().items()):
            rows.setdefault((distribution, entry_points), []).append(f"`{name}`")
    lines = ["| distribution | group | names |", "| --- | --- | --- |"]
    lines += [f"| `{dist}` | `{group}` | {', '.join(names)} |"
              for (dist, group), names in sorted(rows.items(), key=lambda item: item[0][0])]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        if args.name:  # the table is every name; a name beside it would be left unread
            print(f"dew describe: --markdown prints every registered name, so {args.name!r} is not read; "
                  f"drop it, or drop --markdown to describe {args.name!r}.", file=sys.stderr)
            return 2
        print(markdown())
        return 0
    try:
        print(describe(args.name) if args.name else listing())
    except (UnknownComponentError, NotAComponentError) as error:
        print(f"dew describe: {error}", file=sys.stderr)
        return 2
    return 0
