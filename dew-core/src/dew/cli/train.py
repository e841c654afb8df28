"""``dew train RECIPE [key=value ...]``: check a recipe, then train it; ``dew train --resume RUN``
continues a run in its folder."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pydantic

if TYPE_CHECKING:
    pass

__all__ = ["add_arguments", "field_lines", "fields_help", "run"]


def _type_name(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is tuple and typing.get_args(annotation)[-1:] == (Ellipsis,):
        return f"list[{_type_name(typing.get_args(annotation)[0])}]"
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"  # typing's objects vary
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))  # a class, or a typing construct


def _submodel(annotation: object) -> type[pydantic.BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return _as_model(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel):
                return arg
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                return _as_model(arg)
    return None


def _as_model(cls: type) -> type[pydantic.BaseModel]:
    """A pydantic model with a dataclass's fields (and their metadata's descriptions), for listing them."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.init:
            description = f.metadata.get("description")
            if f.default is not dataclasses.MISSING:
                default = pydantic.Field(f.default, description=description)
            elif f.default_factory is not dataclasses.MISSING:
                default = pydantic.Field(default_factory=f.default_factory, description=description)
            else:
                default = pydantic.Field(..., description=description)
            fields[f.name] = (hints.get(f.name, Any), default)
    return pydantic.create_model(cls.__name__, **fields)


def _default(field: Any) -> str:  # a pydantic FieldInfo (its default_factory's arity varies)
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, pydantic.BaseModel) or dataclasses.is_dataclass(value):
        return ""  # its own fields are listed below it
    text = repr(value)
    return f"= {text}" if len(text) <= 40 else "= (see the docs)"


def field_lines(model: type[pydantic.BaseModel], prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(dotted key, type and default, description) for every field under model."""
    from dew.recipes.components import ComponentConfig

    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        inner = _submodel(annotation)
        list_of = None
        if typing.get_origin(annotation) in (list, tuple):
            list_of = typing.get_args(annotation)[0]
        if typing.get_origin(list_of) is typing.Annotated:
            list_of = typing.get_args(list_of)[0]
        if isinstance(list_of, type) and issubclass(list_of, pydantic.BaseModel):
            yield key, f"list {_default(field)}", field.description or ""
            yield from field_lines(list_of, f"{key}.N.")
            if issubclass(list_of, ComponentConfig):
                yield f"{key}.N.<field>", "", "the component's own fields"
            continue
        if inner is not None:
            optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(
                arg is type(None) for arg in typing.get_args(annotation))
            if optional or field.description:
                kind = f"{inner.__name__}{' | null' if optional else ''}"
                yield key, f"{kind} {_default(field)}".strip(), field.description or ""
            yield from field_lines(inner, f"{key}.")
            if issubclass(inner, ComponentConfig):
                yield f"{key}.<field>", "", "the component's own fields (see its documentation)"
            continue
        yield key, f"{_type_name(annotation)} {_default(field)}".strip(), field.description or ""


def fields_help() -> str:
    """Every recipe field, one per line, for ``dew train --help``."""
    from dew.recipes.config import RunConfig

    rows = list(field_lines(RunConfig))
    width = max(len(key) for key, _, _ in rows) + 2
    kinds = min(max(len(kind) for _, kind, _ in rows), 40)
    lines = [f"  {key:<{width}}{kind:<{kinds}}  {text}".rstrip() for key, kind, text in rows]
    return "recipe fields (set any with key=value):\n" + "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("recipe", nargs="?", help="a recipe file, or the name of a shipped one (`dew recipes`)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, values read as YAML (trainer.steps=10)")
    parser.add_argument("--resume", metavar="RUN", default=None,
                        help="continue the run in folder RUN (it holds run.json; dew train prints it "
                             "when a run stops): its checkpoints, journal and recipe, with any "
                             "key=value overrides (trainer.steps=2000 trains further)")
    parser.add_argument("--check", action="store_true",
                        help="validate the recipe and print it as JSON (secrets redacted), without training")
    parser.epilog = (
        "examples:\n  dew train tiny-lm\n  dew train my-run.yaml trainer.steps=200 "
        "optimizer.learning_rate=1e-3\n  dew train --resume runs/tiny-lm/2026-12-01_09-30-00\n\n"
        + fields_help()
    )


def run(args: argparse.Namespace) -> int:
    """Check the recipe (or read back the run to resume), then train it in its folder.

    Errors reach the dispatcher (dew.cli.main), which prints dew's own in one
    message; a stop on request prints the command that resumes the run.
    """
    from dew.recipes.config import RunConfig
    from dew.recipes.errors import RecipeError
    from dew.recipes.folder import RunFolder, check_in, resumed, stopped_line, train_in
    from dew.recipes.run import SampleInterruptedError
    from dew.training.runtime.preemption import INTERRUPTED_STATUS, Preempted, UnsavedStopError

    folder: RunFolder | None = None  # a fresh run's is named once the recipe is checked
    if args.resume is not None:
        overrides = [*([args.recipe] if args.recipe is not None else []), *args.overrides]
        if any("=" not in item for item in overrides):
            raise RecipeError(f"--resume {args.resume} continues that run's own recipe; give "
                              "key=value overrides after it, not a recipe.")
        config, folder = resumed(args.resume, overrides)
    elif args.recipe is None:
        raise RecipeError("dew train needs a recipe (a file, or a shipped one: `dew recipes`), or "
                          "--resume RUN to continue a run.")
    else:
        config = RunConfig.load(args.recipe, overrides=args.overrides)
    if args.check:
        check_in(config, folder)
        print(json.dumps(config.recorded(), indent=2))
        return 0
    from dew.cli.compilation_cache import default_compilation_cache

    try:
        with default_compilation_cache(config.trainer.compilation_cache_dir):
            folder = folder or RunFolder.new(config)  # a rank of a pool joins its pool here
            train_in(config, folder)
    except SampleInterruptedError as interrupted:
        import jax

        if jax.process_index() == 0:
            print(f"dew train: {interrupted}", file=sys.stderr, flush=True)
        return INTERRUPTED_STATUS
    except (Preempted, UnsavedStopError) as stop:
        import jax

        assert folder is not None  # only training stops on request
        if jax.process_index() == 0:  # every rank of a pool stops at this step: said once
            print(f"dew{'' if config.trainer.multi_host else ' train'}: {stopped_line(stop, folder, config)}",
                  file=sys.stderr, flush=True)
        return stop.status
    return 0
