"""RunConfig: a whole run in one validated file.

A recipe names a registered model, objective, dataset and trackers with their
fields, and configures the optimizer and the trainer. ``RunConfig.load``
reads it (with ``key=value`` overrides) and checks every key, type and
registered name before anything is built; ``train`` then builds and runs it.

>>> config = RunConfig.load("tiny-lm", overrides=["trainer.steps=5"])
>>> config.trainer.steps, config.model.name
(5, 'causal_transformer')
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import pydantic

from dew.adapters.lora import Lora
from dew.adapters.quantization import Quantization
from dew.recipes.components import (
    ComponentConfig,
    DataConfig,
    check_component,
    run_inputs,
    with_defaults,
)
from dew.recipes.errors import (
    RECORDED_ADVICE,
    Problem,
    RecipeError,
    from_validation_error,
    raise_problems,
)
from dew.recipes.reading import RecipeFileError, read_recipe_file, read_yaml
from dew.settings import Settings
from dew.training.config import RUN_FILE, TrainerConfig
from dew.training.optim import OptimizerConfig

if TYPE_CHECKING:
    from dew.tracking.protocol import Tracker
    from dew.training.state import TrainState

__all__ = [
    "RecipeError",
    "RunConfig",
    "apply_overrides",
    "override_value",
    "recipe_path",
    "shipped",
]


# A tracker is checked on its own, so each one's problems carry its index.
TrackerConfig = Annotated[
    ComponentConfig, pydantic.AfterValidator(lambda value: check_component("trackers", value))
]


class InitConfig(Settings):
    """Where a run's weights start: a pretrained directory, or another run's parameters."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    pretrained: str | None = pydantic.Field(
        None, description="a directory Pretrained.save, `dew export` or transformers wrote"
    )
    run: str | None = pydantic.Field(
        None, description="another run's checkpoint directory: its parameters alone"
    )
    step: int | None = pydantic.Field(None, ge=0, description="the step of init.run (default newest)")
    ignore: tuple[str, ...] = pydantic.Field(
        (), description="glob patterns of leaf paths (params/head/*) left at the fresh "
        "initialization: not required of the source, and not read from it"
    )
    within: str | None = pydantic.Field(
        None, description="the key under which init.run keeps this model beside others (a "
        "distillation run's student, or its teacher); default: its whole parameters"
    )
    ema: bool = pydantic.Field(
        False, description="start from init.run's EMA copy (the weights its export, dew generate "
        "and dew eval use) rather than its live parameters"
    )

    @pydantic.model_validator(mode="after")
    def _one_source(self) -> InitConfig:
        if (self.pretrained is None) == (self.run is None):
            raise ValueError("set exactly one of init.pretrained and init.run")
        if self.step is not None and self.run is None:
            raise ValueError("init.step selects a step of init.run; set init.run too")
        if self.within is not None and self.run is None:
            raise ValueError("init.within picks a model inside init.run's parameters; set init.run too")
        if self.ema and self.run is None:
            raise ValueError("init.ema reads init.run's EMA copy (a pretrained directory holds one set of "
                             "weights); set init.run too")
        return self


def _placeholder_problems(config: RunConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """A braced word that is no placeholder in a field that names a folder or files: it would stay in
    the path as written (``runs/{timestmap}`` a folder of that name)."""
    from dew.placeholders import unknown_placeholder

    paths: list[tuple[tuple[str | int, ...], object]] = [
        (("trainer", "checkpoint_dir"), config.trainer.checkpoint_dir),
        (("trainer", "local_checkpoint_dir"), config.trainer.local_checkpoint_dir),
        (("trainer", "profile", "directory"), None if config.trainer.profile is None else config.trainer.profile.directory),
        (("data", "files"), config.data.fields.get("files")),
        *((("trackers", index, "directory"), tracker.fields.get("directory"))
          for index, tracker in enumerate(config.trackers))]
    found: list[tuple[tuple[str | int, ...], str]] = []
    for where, value in paths:
        for text in ([value] if isinstance(value, str) else value if isinstance(value, list) else []):
            wrong = unknown_placeholder(text) if isinstance(text, str) else None
            if wrong is not None:
                found.append((where, f"{wrong} (given {text!r})."))
    return found


class RunConfig(Settings):
    """A run: a model, an objective, data, an optimizer, a trainer, trackers and a seed.

    Once trained, a run whose objective can preview (a language model with a
    prompt, say) prints a sample from the trained weights.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    description: str | None = pydantic.Field(None, description="one line shown by `dew recipes`")
    seed: int = pydantic.Field(0, ge=-(2**63), lt=2**63, description="the run key is drawn from it (a 64-bit integer)")
    model: ComponentConfig | None = pydantic.Field(
        None, description="a registered model (dew.models) and its fields; omit it for an "
        "objective that builds its own network (one without a model field)"
    )
    objective: ComponentConfig = pydantic.Field(
        description="a registered objective (dew.objectives) and its fields; the model is supplied"
    )
    data: DataConfig = pydantic.Field(description="a registered dataset reader (dew.datasets), its fields and batch")
    optimizer: OptimizerConfig = pydantic.Field(default_factory=OptimizerConfig)
    trainer: TrainerConfig
    trackers: list[TrackerConfig] = pydantic.Field(
        default_factory=list, description="registered trackers (dew.trackers) and their fields"
    )
    quantization: Quantization | None = pydantic.Field(
        None, description="train the model's trunk matmuls quantized (qwix)"
    )
    init: InitConfig | None = pydantic.Field(
        None, description="start from pretrained weights instead of a fresh initialization"
    )
    lora: Lora | None = pydantic.Field(
        None, description="train low-rank adapters on the model's attention/MLP weights, the rest frozen (qwix)"
    )

    @pydantic.field_validator("model")
    @classmethod
    def _registered_model(cls, value: ComponentConfig | None) -> ComponentConfig | None:
        return None if value is None else check_component("models", value)

    @pydantic.model_validator(mode="after")
    def _model_matches_objective(self) -> RunConfig:
        """A model section exactly when the objective takes a model (its run_inputs), so
        --check catches it."""
        from dew import registry

        try:
            takes_model = "model" in run_inputs(registry.objectives.load(self.objective.name))
        except Exception:  # noqa: BLE001 - an unloadable objective is reported by its own check
            return self
        name = self.objective.name
        if takes_model and self.model is None:
            raise ValueError(f"objective {name!r} trains a model: add a model section "
                             "(name: and the model's fields)")
        if not takes_model and self.model is not None:
            raise ValueError(f"objective {name!r} builds its own network and takes no model: "
                             "remove the model section")
        return self

    @pydantic.model_validator(mode="after")
    def _options_that_do_something(self) -> RunConfig:
        """Settings that would train as if absent, refused where they are written."""
        from pydantic_core import PydanticCustomError

        found: list[tuple[tuple[str | int, ...], str]] = []
        if self.quantization is not None and self.lora is not None:
            found.append((("quantization",), "set beside lora, where it would be ignored: the adapters wrap "
                          "the model alone. A LoRA run keeps its frozen base quantized with lora.base (int8, "
                          "nf4); drop the quantization section."))
        if self.lora is not None and self.init is not None and self.init.ignore:
            found.append((("init", "ignore"), "leaves those weights at a fresh initialization, and the lora section "
                          "freezes every weight but the adapters, so they would stay random for the whole run. "
                          "Start from weights that hold them (train or export a model with them first), or "
                          "train without lora."))
        found += _placeholder_problems(self)
        steps, accumulation = self.trainer.steps, self.trainer.accumulation
        if steps is not None and accumulation > steps:
            found.append((("trainer", "accumulation"), f"{accumulation} microbatches make one optimizer update, but "
                          f"trainer.steps={steps} stops before the first: raise steps to at least "
                          f"{accumulation} or lower accumulation."))
        if found:
            raise PydanticCustomError("dew_component", "{message}", {"message": found[0][1], "problems": found})
        return self

    @pydantic.field_validator("trainer")
    @classmethod
    def _registered_tasks(cls, value: TrainerConfig) -> TrainerConfig:
        """Each trainer.evaluate entry names a registered task with fields it has."""
        from pydantic_core import PydanticCustomError

        from dew.recipes.components import problems_of

        found = [(("evaluate", index, *(("task",) if sub == ("name",) else sub)), message)
                 for index, entry in enumerate(value.evaluate)
                 for sub, message in problems_of("evaluations", entry.task, entry.fields,
                                                 beside=("task", "every", "label"))]
        first: dict[str, int] = {}
        for index, entry in enumerate(value.evaluate):  # each logs under eval/<name>/...: one name each
            if entry.name in first:
                found.append((("evaluate", index, "label"), (
                    f"trainer.evaluate entries {first[entry.name]} and {index} both log their scores "
                    f"as eval/{entry.name}/..., so one would overwrite the other: give each a "
                    "label of its own (label: arc).")))
            first.setdefault(entry.name, index)
        if found:
            raise PydanticCustomError("dew_component", "{message}", {"message": found[0][1], "problems": found})
        return value

    @pydantic.field_validator("objective")
    @classmethod
    def _registered_objective(cls, value: ComponentConfig) -> ComponentConfig:
        return check_component("objectives", value)

    @pydantic.field_validator("data")
    @classmethod
    def _registered_dataset(cls, value: DataConfig) -> DataConfig:
        return check_component("datasets", value)  # type: ignore[return-value]

    # -- reading and writing ------------------------------------------------------
    @classmethod
    def parse(cls, data: object, source: str = "<recipe>", *, advice: str | None = None) -> RunConfig:
        """Validate a recipe's contents; raise one RecipeError naming every problem (and advice on
        what to do about them, where the default, fixing the file, is not it)."""
        if not isinstance(data, Mapping):
            raise RecipeError(
                f"The recipe {source} must be a mapping of sections (model, objective, data, "
                f"trainer, ...), but it holds {type(data).__name__}."
            )
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as error:
            problems: list[Problem] = from_validation_error(error, cls)
            raise_problems(source, problems, advice)

    @classmethod
    def load(cls, recipe: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
        """Read a recipe file, or a shipped recipe by name, with key=value overrides."""
        path = recipe_path(recipe)
        data = read_recipe_file(path)
        data = {} if data is None else data
        if isinstance(data, dict):  # otherwise parse names the file and what it holds
            data = _run_folder_followed(copy.deepcopy(data), apply_overrides(data, overrides), overrides)
        return cls.parse(data, str(path))

    def recorded(self) -> dict[str, Any]:
        """This configuration as JSON data with its secrets redacted: what a run writes down.

        URI passwords and secret-named fields become ``***`` (dew.telemetry.redaction);
        run.json, the RunStarted records and the trackers' parameters all hold this.
        The model's fields are recorded with its defaults filled in
        (``dew.recipes.components.with_defaults``), so the record holds what the
        weights were trained as whatever a later dew's defaults are.
        """
        from dew.telemetry.redaction import redact

        recorded = self.model_dump(mode="json")
        if self.model is not None:
            given = {key: value for key, value in recorded["model"].items() if key != "name"}
            recorded["model"] = {"name": self.model.name, **with_defaults("models", self.model.name, given)}
        return redact(recorded)

    def save(self, directory: str | Path) -> Path:
        """Write this configuration, secrets redacted, as run.json in directory; return its path."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        path = target / RUN_FILE
        path.write_text(json.dumps(self.recorded(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, path: str | Path) -> RunConfig:
        """Read a run.json that save wrote (or its directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / RUN_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise RecipeError(f"{path} cannot be read as a run's recipe ({error}). A run writes it when it "
                              "starts; replace a damaged one with the recipe the run was trained with "
                              "(RunConfig.load(...).save(run directory) writes it).") from None
        return cls.parse(data, str(path), advice=RECORDED_ADVICE)

    def build_trackers(self, timestamp: str = "") -> Tracker | None:
        """The trackers section (and trainer.wandb) built, as one tracker; None for none.

        The trainer hands each the recipe, as ``recorded`` writes it down
        (secrets redacted), in the run's RunStarted record, and each records it
        where runs are compared (MLflow parameters, TensorBoard hparams, W&B
        config).
        """
        built = [tracker.build("trackers", timestamp) for tracker in self.trackers]
        wandb = [] if self.trainer.wandb is None else [self.trainer.wandb.build()]
        every = [*built, *wandb]
        if not every:
            return None
        from dew.tracking.composite import Trackers

        return Trackers(*every)  # even one: a tracker's own failure is named, not a bare traceback

    def train(self, *, timestamp: str | None = None) -> TrainState:
        """Build everything and train; return the final TrainState (see dew.recipes.run).

        timestamp expands ``{timestamp}`` (``dew train --resume`` passes the one the run
        started with); None takes the clock now."""
        from dew.recipes.run import train

        return train(self, timestamp=timestamp)


# -- overrides ---------------------------------------------------------------------


def override_value(text: str) -> Any:
    r"""An override's value as a recipe reads it: YAML, or the text itself where it is not YAML
    (``[0-9]+`` is a pattern, not a broken list), where YAML would read a placeholder or a
    template's field as a mapping with no values (``{timestamp}``, ``{question}``), or where a
    sentence holding ": " would read as a mapping of one key (a mapping is written in braces).

    >>> override_value("3"), override_value("[0-9]+"), override_value("{a: 1}"), override_value("{timestamp}")
    (3, '[0-9]+', {'a': 1}, '{timestamp}')
    >>> override_value("What is 1: 2")
    'What is 1: 2'

    A "#" is text, not a YAML comment (GSM8K's ``#### (.+)`` read as null), and a double-quoted
    text with a regular expression's escapes, which YAML refuses, is its inside as written:

    >>> override_value("#### (.+)"), override_value('"= (\\d+)"'), override_value('"a\\nb"')
    ('#### (.+)', '= (\\d+)', 'a\nb')

    So is such a text inside a list or a mapping (LoRA targets as patterns):

    >>> override_value('[".*layers_\\d+/moe", "attention"]')
    ['.*layers_\\d+/moe', 'attention']
    """
    try:
        value = read_yaml(text, "override") if text.strip() else ""
    except RecipeFileError:
        quoted = text.strip()
        if len(quoted) > 1 and quoted[0] == quoted[-1] == '"':
            return quoted[1:-1]
        if not (quoted.startswith(("[", "{")) and '"' in quoted):
            return text
        try:
            value = read_yaml(_escapes_kept(text), "override")
        except RecipeFileError:
            return text
    if "#" in text and not isinstance(value, dict | list) and not text.strip().startswith(("'", '"')):
        return text
    if isinstance(value, dict) and value and ":" not in text and all(v is None for v in value.values()):
        return text
    if isinstance(value, dict) and not text.lstrip().startswith("{"):
        return text
    return value


_YAML_ESCAPES = frozenset('0abtnvfre "/\\N_LPxuU\t')


def _escapes_kept(text: str) -> str:
    """text with each backslash that YAML's double-quoted strings do not take as an escape (a regular
    expression's \\d) doubled, so the string reads as written."""
    import re

    def kept(string: re.Match[str]) -> str:
        return re.sub(r"\\(.)", lambda m: m.group(0) if m.group(1) in _YAML_ESCAPES else "\\\\" + m.group(1),
                      string.group(0))

    return re.sub(r'"(?:[^"\\]|\\.)*"', kept, text)


def _run_folder_followed(written: dict[str, Any], given: Any, overrides: Sequence[str]) -> Any:
    """given, with each tracker whose directory the recipe wrote as its checkpoint_dir (the run's
    folder: every shipped recipe's local tracker) moved along when checkpoint_dir was overridden
    and that directory was not, so ``trainer.checkpoint_dir=runs/a`` keeps the journal in runs/a
    too, whatever else of the tracker an override changes."""
    def folder(data: Any) -> Any:
        trainer = data.get("trainer") if isinstance(data, dict) else None
        return trainer.get("checkpoint_dir") if isinstance(trainer, dict) else None

    before, after = folder(written), folder(given)
    if before is None or after is None or after == before:
        return given
    touched = {tuple(key.strip().split(".")) for key, sep, _ in (o.partition("=") for o in overrides)
               if sep and not key.rstrip().endswith("+")}  # an append leaves the written entries alone
    pairs = zip(given.get("trackers") or [], written.get("trackers") or [], strict=False)
    for index, (tracker, as_written) in enumerate(pairs):
        moved = touched & {("trackers",), ("trackers", str(index)), ("trackers", str(index), "directory")}
        if (isinstance(tracker, dict) and isinstance(as_written, dict) and not moved
                and tracker.get("directory") == as_written.get("directory") == before):
            tracker["directory"] = after
    return given


def apply_overrides(data: Any, overrides: Sequence[str]) -> Any:
    """Return data with each dotted key=value set; values are read as YAML scalars.

    ``trainer.steps=10`` sets an integer, ``trackers.0.directory=/tmp/run`` an
    element of a list, ``trainer.profile=null`` clears a section. A key that
    does not exist yet is created, so the schema, not this function, decides
    whether it is allowed. ``key+=value`` appends to the list at key (a list
    value appends each of its items; a missing key starts a list):

    >>> apply_overrides({"trackers": [{"name": "local"}]}, ["trackers+={name: tensorboard}"])
    {'trackers': [{'name': 'local'}, {'name': 'tensorboard'}]}
    """
    if not isinstance(data, dict):
        raise RecipeError(f"Overrides need a recipe that is a mapping, not {type(data).__name__}.")
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key.strip():
            raise RecipeError(
                f"The override {override!r} is not key=value; write for example trainer.steps=10."
            )
        append = key.rstrip().endswith("+")
        parts = key.strip().removesuffix("+").split(".")
        node: Any = data
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                index = _index(part, node, where, override)
                node = node[index]
                continue
            child = node.get(part)
            if child is None and parts[depth + 1].isdigit():  # an index into a list the recipe lacks
                raise RecipeError(
                    f"The override {override!r} indexes {where}, which the recipe does not hold; "
                    f"add an entry with {where}+=[{{...}}], its fields in the braces.")
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict | list):
                raise RecipeError(
                    f"The override {override!r} goes inside {where}, which holds "
                    f"{child!r}, not a section."
                )
            node = child
        last = parts[-1]
        if append:
            _append(node, last, override_value(value), override)
        elif isinstance(node, list):
            node[_index(last, node, key, override)] = override_value(value)
        else:
            node[last] = override_value(value)
    return data


def _append(node: Any, last: str, value: Any, override: str) -> None:
    """key+=value: extend the list at node[last] (created when missing) with value."""
    if isinstance(node, list):
        target = node[_index(last, node, last, override)]
    else:
        target = node.get(last)
        if target is None:
            target = node[last] = []
    if not isinstance(target, list):
        raise RecipeError(
            f"The override {override!r} appends with +=, but {last} holds {target!r}, not a "
            f"list; set it with = instead."
        )
    target.extend(value if isinstance(value, list) else [value])


def _index(part: str, items: list, where: str, override: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise RecipeError(
            f"The override {override!r} indexes the list at {where} with {part!r}; it holds "
            f"{len(items)} item(s), numbered from 0."
        )
    return int(part)


# -- shipped recipes ---------------------------------------------------------------


def shipped() -> dict[str, Path]:
    """The recipes dew ships, by name (the file name without .yaml)."""
    folder = resources.files("dew.recipes")
    return {
        entry.name.removesuffix(".yaml"): Path(str(entry))
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".yaml")
    }


def recipe_path(recipe: str | Path) -> Path:
    """A recipe file's path: recipe itself when it exists, else a shipped recipe's."""
    path = Path(recipe).expanduser()
    if path.is_file():
        return path
    recipes = shipped()
    name = str(recipe).removesuffix(".yaml")
    if name in recipes:
        return recipes[name]
    if (path / RUN_FILE).is_file():
        raise RecipeError(f"{str(recipe)!r} is a run's folder, not a recipe: continue it with "
                          f"dew train --resume {recipe}, or give its recipe, {path / RUN_FILE}, where a "
                          "recipe file is read (dew plan, dew train --check)")
    if path.is_dir():
        raise RecipeError(f"{str(recipe)!r} is a directory, not a recipe: give a recipe's YAML file or a "
                          f"shipped recipe's name ({', '.join(recipes) or 'none'}; see `dew recipes`).")
    raise RecipeError(
        f"No recipe file {str(recipe)!r} and no shipped recipe of that name. Shipped: "
        f"{', '.join(recipes) or 'none'} (see `dew recipes`)."
    )
