"""Build what a RunConfig describes, train it, and show a sample from the result.

Each section of a recipe builds what it describes: a component (model,
objective, data reader, tracker) its registered object
(``ComponentConfig.build``), the data section its Dataset
(``DataConfig.load_dataset``), the checkpoint settings the Checkpoints
(``CheckpointSettings.build_checkpoints``), the trackers section and
``trainer.wandb`` the trackers (``RunConfig.build_trackers``), the trainer
settings the Trainer (``Trainer.from_config``). This module orders them.

The order matters: ``prepare_process`` runs before anything opens JAX's
backend, so the recipe's XLA flags and process pool take effect; the run key
is drawn from the recipe's seed; the objective is built around the model and
takes the data reader's tokenizer when the recipe gives none. The trainer
takes the checkpoint directory's lease before it trains, writes the recipe
there (run.json) and hands it to the trackers with the run's RunStarted
record. Strings may hold placeholders (``{timestamp}``, ``{stdlib}``,
``{recipes}``): see ``dew.placeholders``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypedDict

from pydantic import BaseModel

from dew import registry
from dew.data.base import TextReader
from dew.errors import DewError
from dew.placeholders import absolute, expand
from dew.recipes.components import refuse_values, run_inputs, with_defaults
from dew.recipes.errors import RecipeError, UnsuitableModelError

if TYPE_CHECKING:
    import os
    from collections.abc import Mapping

    from flax import linen as nn

    from dew.checkpoints.manager import Checkpoints
    from dew.data.base import Dataset, Tokenizer
    from dew.evaluations.base import Periodic
    from dew.objectives.base import Objective, Variables
    from dew.pretrained import Pretrained
    from dew.recipes.config import RunConfig
    from dew.tracking.protocol import Outcome, Tracker
    from dew.training.config import TrainerConfig
    from dew.training.initializers import Initializer, WeightSource
    from dew.training.optim import ConfiguredOptimizer, OptimizerConfig
    from dew.training.protocols import Rollout
    from dew.training.state import TrainState

__all__ = [
    "Parts",
    "PoolDevicesMismatchError",
    "PoolRecipeMismatchError",
    "SampleInterruptedError",
    "ScheduleReshapedWarning",
    "build_objective",
    "build_evaluations",
    "check_initial",
    "build_parts",
    "check_model_kind",
    "expand",
    "fresh_base_note",
    "initial_variables",
    "join_pool",
    "objective_parts",
    "recorded",
    "run_inputs",
    "run_optimizer",
    "show_sample",
    "train",
    "usage",
    "warmup_note",
    "warn_if_schedule_reshaped",
]


class SampleInterruptedError(KeyboardInterrupt):
    """Ctrl-C while a run that trained every step drew its closing sample: the run is whole (and
    saved where it has checkpoints); its message says so. A KeyboardInterrupt, so a program's
    ``except KeyboardInterrupt`` takes it; ``dew train`` prints it and exits 130."""


class ScheduleReshapedWarning(UserWarning):
    """A resumed run's learning-rate schedule differs from the one its checkpoints trained with."""


def _tokenizer(reader: Any, section: str) -> Tokenizer | None:
    """The reader's tokenizer, when the reader encodes text (dew.data.base.TextReader); a value
    the reader cannot make one of (data.tokenizer=5) is refused naming the recipe's section."""
    if not isinstance(reader, TextReader):
        return None
    try:
        return reader.text_tokenizer()
    except (ValueError, TypeError) as error:
        refuse_values(error, f"dataset {section!r}", "data.tokenizer")
        raise


def check_model_kind(config: RunConfig, model: nn.Module) -> None:
    """Refuse a model of another kind than the objective trains (``Objective.trains``), before the
    first trace would fail inside the model."""
    from dew.nn.kinds import kind_phrase

    kind = registry.objectives.load(config.objective.name).trains
    if kind is None or isinstance(model, kind):
        return
    assert config.model is not None  # a model was built from it
    raise UnsuitableModelError(
        f"objective {config.objective.name!r} trains {kind_phrase(kind)}, and model.name="
        f"{config.model.name!r} builds a {type(model).__name__}, which is not one: name a model of "
        "that kind in the model section, or an objective that trains this one (docs/objectives.md "
        "lists what each trains).")


def build_objective(config: RunConfig, model: nn.Module | None, reader: Any,
                    timestamp: str = "") -> Objective:
    """The recipe's objective around model, given the reader's tokenizer if it takes one.

    What the run hands the objective besides the recipe's fields is what the
    objective declares in ``Objective.run_inputs``: the model, the tokenizer
    (unless the recipe gives its own).
    """
    inputs = run_inputs(registry.objectives.load(config.objective.name))
    tokenizer = _tokenizer(reader, config.data.name)
    if tokenizer is not None and model is not None:
        from dew.pretrained import check_vocabulary

        start = config.init.pretrained or config.init.run if config.init is not None else None
        check_vocabulary(tokenizer, model, starts_from=start)  # before anything compiles
    given = config.objective.fields
    supplied = {name: value for name, value in (("model", model), ("tokenizer", tokenizer))
                if name in inputs and name not in given and (name == "model" or value is not None)}
    return config.objective.build("objectives", timestamp, **supplied)


def _optimizer_config(config: RunConfig, steps: int) -> OptimizerConfig:
    """The optimizer config, its decay counted to the run's last update when unset."""
    optimizer = config.optimizer
    if optimizer.schedule != "constant" and optimizer.decay_steps is None:
        updates = max(steps // config.trainer.accumulation, optimizer.warmup_steps + 1)
        optimizer = optimizer.model_copy(update={"decay_steps": updates})
    return optimizer


def _saved_recipe(kind: type[RunConfig], directory: str | os.PathLike[str]) -> RunConfig | None:
    """The recipe the run in directory was trained with (its run.json), or None when it has none
    that reads: an unreadable old recipe holds a resume to nothing and is no reason to stop it."""
    from dew.training.config import RUN_FILE

    saved = Path(str(directory)) / RUN_FILE
    if not saved.is_file():
        return None
    try:
        return kind.read(saved)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def warn_if_schedule_reshaped(config: RunConfig, steps: int, steps_per_epoch: int | None,
                              directory: str | os.PathLike[str], resumed_at: int, *,
                              before: RunConfig | None = None) -> None:
    """Warn when resuming with another trainer.steps changes the learning-rate schedule.

    A decaying schedule whose length is not set (optimizer.decay_steps) is
    stretched over the run's steps, so resuming with a new ``steps`` changes
    the rate from the resumed step on: a jump, not a continuation. The saved
    run.json (before, when the caller has read it) says what the checkpoints were trained with.
    """
    before = _saved_recipe(type(config), directory) if before is None else before
    if before is None:
        return
    old_steps = before.trainer.total_steps(steps_per_epoch)
    old = _optimizer_config(before, old_steps)
    new = _optimizer_config(config, steps)
    if old_steps == steps or old.decay_steps == new.decay_steps:
        return
    if _same_rates(old, new, resumed_at // config.trainer.accumulation, steps // config.trainer.accumulation):
        return  # the updates still to come are all where the two schedules agree (inside the warmup)
    ended = (f" (the old schedule had ended at update {old.decay_steps}: kept, every further step trains "
             f"at its end rate, {old.end_factor:g} x optimizer.learning_rate)"
             if old.decay_steps is not None and resumed_at // before.trainer.accumulation >= old.decay_steps
             else "")  # decay_steps counts updates, resumed_at steps
    warnings.warn(ScheduleReshapedWarning(
        f"This run resumes at step {resumed_at} of checkpoints trained for {old_steps} steps; "
        f"with {steps} steps its {new.schedule} learning-rate schedule now decays over "
        f"{new.decay_steps} updates instead of {old.decay_steps}, so the rate changes from the "
        f"resumed step on. To continue the old schedule, set optimizer.decay_steps="
        f"{old.decay_steps}{ended}."
    ), stacklevel=2)


def _same_rates(old: OptimizerConfig, new: OptimizerConfig, first: int, last: int) -> bool:
    """Whether the two schedules give every update from first to last (inclusive) the same rate."""
    import numpy as np

    from dew.training.optim import build_schedule

    updates = np.arange(first, max(first, last) + 1)
    return bool(np.allclose(build_schedule(old)(updates), build_schedule(new)(updates), rtol=1e-6, atol=0.0))


# What a resume may change in the sections that say what function the weights compute: how it is
# computed (precision, kernels, memory, layout, the decode cache), not what.
_EXECUTION = frozenset({"model.dtype", "model.param_dtype", "model.attention", "model.remat", "model.scan_layers",
                        "model.max_seq_len", "model.expert_capacity", "lora.dropout"})


class AdaptedRunStartError(DewError, ValueError):
    """init.run names a LoRA run, whose checkpoints no model's tree takes whole."""


class RewardModelStartError(DewError, ValueError):
    """init.pretrained names a reward model (a sequence-classification checkpoint) for a run of another
    objective: its decoder holds a score head, no language-model head."""


class ResumedFunctionChangedError(DewError, ValueError):
    """A resume's recipe changes what the run's weights compute (a model, adapter or quantization field)."""


def _plain(value: Any) -> Any:
    """value as the JSON run.json holds it compares (tuples as lists, other objects as text)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # Lora, Quantization
        return _plain(dataclasses.asdict(value))
    if isinstance(value, BaseModel):  # a pydantic section (RopeScaling, Latent, ...)
        return _plain(value.model_dump(mode="json"))
    return str(value)


def _function_fields(config: RunConfig) -> dict[str, Any]:
    """The model's every field (its defaults filled in), the adapters', the quantization's and the
    starting weights' (init: a LoRA run's frozen base, and what its exports name as their base), dotted."""
    out: dict[str, Any] = {}
    if config.model is not None:
        out["model.name"] = config.model.name
        try:
            declared = registry.models.fields(config.model.name)
        except Exception:  # noqa: BLE001 - a model not installed here: the fields the recipe names
            declared = {}
        # As run.json records them: a run.json holds the defaults it was trained with, so a default
        # this dew changed is a difference (the fields with no JSON default come from declared).
        given = with_defaults("models", config.model.name, _plain(dict(config.model.fields)))
        for name in set(declared) | set(given):
            out[f"model.{name}"] = given[name] if name in given else _plain(declared[name][1])
    for section in ("lora", "quantization"):
        value = _plain(getattr(config, section))
        for name, item in (value.items() if isinstance(value, dict) else [("", value)]):
            out[f"{section}.{name}" if name else section] = item
    if config.init is not None:  # the fields it sets: an unset one reads as absent, as no init does
        for name, item in config.init.model_dump(mode="json", exclude_defaults=True).items():
            out[f"init.{name}"] = item
    return out


def refuse_changed_function(config: RunConfig, directory: str | os.PathLike[str], resumed_at: int, *,
                            before: RunConfig | None = None) -> None:
    """Refuse a resume whose recipe changes what the checkpoints' weights compute.

    The shapes may still fit (a rope base, an activation, a LoRA alpha), so the restore would
    succeed, train the weights as another function and write that recipe as the run's run.json,
    which exports and dew generate then read. The saved run.json (before, when the caller has
    read it) says what they were trained as.
    """
    from dew.training.config import RUN_FILE

    before = _saved_recipe(type(config), directory) if before is None else before
    if before is None:
        return
    saved = Path(str(directory)) / RUN_FILE
    old, new = _function_fields(before), _function_fields(config)
    changed = sorted(k for k in (set(old) | set(new)) - _EXECUTION if old.get(k) != new.get(k))
    if changed:
        said = "; ".join(f"{k}: trained as {old.get(k)!r}, now {new.get(k)!r}" for k in changed[:6])
        raise ResumedFunctionChangedError(
            f"Resuming at step {resumed_at}, this recipe changes what the run's weights compute ({said}). "
            f"Its checkpoints were trained as {saved} says: resume with that recipe (dew train --resume "
            f"{directory}, without the override), "
            f"or start a new run from these weights (init.run={directory} with another trainer.checkpoint_dir).")


def run_optimizer(config: RunConfig, steps: int) -> ConfiguredOptimizer:
    """The recipe's optimizer for a run of steps (the schedule's decay counted to its end)."""
    from dew.training.optim import build_optimizer

    return build_optimizer(_optimizer_config(config, steps))


def _ramped(config: RunConfig, dataset: Dataset) -> Dataset:
    ramp = config.trainer.batch_ramp
    if ramp is None:
        return dataset
    from dew.data import ramped
    from dew.data.errors import RampError

    try:
        return ramped(dataset, start=ramp.start, steps=ramp.steps)
    except RampError as error:  # the reader's words name no field of the recipe
        raise RampError(f"trainer.batch_ramp (start={ramp.start}, steps={ramp.steps}, data.batch={dataset.batch}): "
                        f"{error} Give trainer.batch_ramp.start at most data.batch.") from None


@dataclass(frozen=True)
class Parts:
    """What a recipe builds before training: the model, the data reader and its
    tokenizer, the objective, and the dataset (None when not asked for)."""

    model: nn.Module | None
    reader: Any  # a registered reader: any class with a load method
    tokenizer: Tokenizer | None
    objective: Objective
    dataset: Dataset | None = None


def build_parts(config: RunConfig, timestamp: str = "", *, with_data: bool = True) -> Parts:
    """Build the recipe's model, reader, objective and (with_data) its loaded dataset.

    The inference commands rebuild a trained run this way from its run.json,
    without reading its data.
    """
    model = None if config.model is None else config.model.build("models", timestamp)
    if model is not None:
        check_model_kind(config, model)
    if config.quantization is not None and model is not None:
        from dew.adapters.quantization import apply_quantization

        model = apply_quantization(model, config.quantization)
    if config.lora is not None and model is not None:
        from dew.adapters.lora import apply_lora

        model = apply_lora(model, config.lora)
    reader = config.data.build("datasets", timestamp)
    # The objective first: a tokenizer the model cannot embed is refused before any data is read.
    objective = build_objective(config, model, reader, timestamp)
    dataset = None
    if with_data:  # the run's seed orders its data too
        dataset = _ramped(config, config.data.load_dataset(reader, timestamp, seed=config.seed))
    if config.lora is not None:
        from dew.adapters.lora import adapters_only

        objective = adapters_only(objective)  # the base weights are frozen: one copy, no optimizer state
    return Parts(model, reader, _tokenizer(reader, config.data.name), objective, dataset)


def build_evaluations(config: RunConfig, parts: Parts, timestamp: str = "") -> list[Periodic]:
    """The recipe's trainer.evaluate tasks, each bound to the run's model and tokenizer."""
    from functools import partial

    from dew.evaluations.base import scheduled
    from dew.objectives.inference import served_variables

    built = []
    for number, entry in enumerate(config.trainer.evaluate):
        try:
            built.append(scheduled(entry, parts.model, parts.tokenizer,
                                   expand=lambda fields: expand(fields, timestamp),
                                   served=partial(served_variables, parts.objective), objective=parts.objective))
        except DewError as error:  # a task's own refusal (a missing task file): traced to its entry
            error.add_note(f"The recipe's trainer.evaluate.{number} ({entry.name}) asks for it.")
            raise
    return built


def initial_variables(config: RunConfig, objective: Objective) -> Initializer:
    """What the recipe's init section starts the run from (None: a fresh initialization).

    ``init.pretrained`` reads a directory Pretrained.save, ``dew export`` or
    transformers wrote, into the recipe model's max_seq_len and param_dtype;
    ``init.run`` is another run's parameters alone (``ParamsFrom``). With a
    ``lora`` section either is the base under fresh adapters (quantized for
    QLoRA). An objective's ``starting_weights`` (a preference or RL
    objective, whose reference copies the policy) narrows what is read to
    the model's part. The trainer checks either against the tree a fresh
    init makes, naming each path whose shape differs.
    """
    init = config.init
    if init is None:
        return None
    read, weights = _read_initial(config, objective)
    source = read
    if init.ignore:
        import jax

        from dew.training.initializers import IgnoringLeaves
        from dew.training.state import stream

        # The ignored leaves start as the trainer's own random init would start them: same key.
        # Inside the objective's narrowing, so they are the model's: a frozen reference still
        # copies the policy as read, fresh leaves included.
        source = IgnoringLeaves(read, tuple(init.ignore),
                                fresh=lambda: objective.init(stream(jax.random.key(config.seed), "init")))
    # An objective whose variables hold more than the model's (a frozen reference, a value head)
    # reads only the model's part; its init makes the rest.
    narrowed = objective.starting_weights(source)
    # An objective holding more than its model (a distillation's teacher) places them itself.
    return weights if narrowed is read and weights is not None else narrowed


def check_initial(config: RunConfig, objective: Objective) -> None:
    """Refuse the init.pretrained a run of config would refuse, reading none of its weights: its
    config.json and tensor headers (family, sizes, the function it computes against the recipe's
    model). ``dew train --check`` calls it; an init.run is another run, which --check does not read."""
    if config.init is not None and config.init.pretrained is not None:
        _pretrained_start(config, objective, weights=False)


def _read_initial(config: RunConfig, objective: Objective) -> tuple[WeightSource, Variables | None]:
    """The source of the model's starting weights (before the objective narrows them), and the
    weights themselves when they are read already (init.pretrained)."""
    init = config.init
    assert init is not None  # initial_variables reads only a recipe with an init section
    if init.pretrained is not None:
        weights = dict(_pretrained_start(config, objective, weights=True).variables)

        def given(abstract: Variables) -> Variables:
            return weights

        return given, weights
    from dew.training.initializers import ParamsFrom

    assert init.run is not None  # InitConfig holds exactly one of pretrained and run
    started = _saved_recipe(type(config), absolute(init.run))
    if started is not None and started.lora is not None:
        raise AdaptedRunStartError(
            f"init.run={init.run} is a LoRA run: its checkpoints hold the frozen base and the adapters "
            "apart, which no model's tree takes whole. Export it merged (dew export "
            f"{init.run} DIR) and start from init.pretrained=DIR.")
    run: WeightSource = ParamsFrom(absolute(init.run), step=init.step, ignore=tuple(init.ignore),
                                   within=init.within, field="averaged" if init.ema else "params")
    if config.lora is not None:  # the other run's weights are the base; the adapters start fresh
        run = _lora_base(run)
    return run, None


def _pretrained_start(config: RunConfig, objective: Objective, *, weights: bool) -> Pretrained:
    """init.pretrained read for the recipe's model (weights: its tensors too, else their headers
    alone), refused where it is a reward model the objective cannot start from or computes another
    function than the recipe's model."""
    from dew.pretrained import Pretrained

    init = config.init
    assert init is not None and init.pretrained is not None
    model = objective.model if config.model is not None else None  # a model section: it has one
    source = absolute(init.pretrained)
    # A model is any registered flax Module: a family that has no such field takes the
    # directory's own (max_seq_len, param_dtype), and one without rotary positions (rope_base)
    # has no function to compare beyond its tensors' shapes.
    read = Pretrained.load if weights else Pretrained.describe
    loaded = read(source, max_seq_len=getattr(model, "max_seq_len", None),
                  param_dtype=getattr(model, "param_dtype", None),
                  scan_layers=bool(getattr(model, "scan_layers", False)))
    _check_scorer_start(loaded.task, objective, source)
    if model is not None and getattr(model, "rope_base", None) is not None:
        from dew.pretrained import check_same_function

        check_same_function(model, loaded.model, f"init.pretrained {source}")
    return loaded


def _check_scorer_start(task: Mapping[str, Any] | None, objective: Objective, source: str | Path) -> None:
    """Refuse to start a run whose objective keeps no score head (Objective.heads) from a reward model."""
    from dew.families import scoring

    if task is None or task.get("name") != scoring.TASK:
        return
    if scoring.HEAD in objective.heads:
        from dew.adapters.lora import base_model

        if getattr(base_model(objective.model), "tie_embeddings", True) is False:  # dew's decoders name it
            raise RewardModelStartError(
                f"init.pretrained {source} is a reward model (a sequence-classification checkpoint), which "
                "stores no language-model head: its decoder is read with the embedding in that place (a "
                "reward model never reads the head's logits). Set model.tie_embeddings=true.")
        return
    raise RewardModelStartError(
        f"init.pretrained {source} is a reward model (a sequence-classification checkpoint): its decoder "
        "ends in a score, with no language-model head for this run to train. Score an RL run's completions "
        f"with it (objective.reward: {{name: model, run: {source}}}), start a reward_model run from it, or "
        "start this run from the checkpoint its decoder was trained from.")


def _lora_base(source: WeightSource) -> WeightSource:
    """source read as a LoRA run's frozen base, its misfit advised without init.ignore (refused
    beside lora: no base leaf may stay fresh under adapters that freeze them all)."""
    from dew.adapters.lora import BaseWeights
    from dew.training.initializers import InitializerMismatchError

    base = BaseWeights(source)

    def read(abstract: Variables) -> Variables:
        try:
            return base(abstract)
        except InitializerMismatchError as error:
            if error.mismatch is None:
                raise
            raise InitializerMismatchError(
                f"{error.mismatch} A LoRA run trains adapters over its base as read, every base weight "
                "frozen, so none can be left at a fresh initialization: start from weights of the same "
                "architecture and configuration, or change the model to match them.",
                mismatch=error.mismatch) from None

    return read


def _profile_expanded(trainer: TrainerConfig, timestamp: str) -> TrainerConfig:
    """trainer with its profile window's directory expanded (``{timestamp}``) and made absolute, as
    every other folder of the run is."""
    if trainer.profile is None:
        return trainer
    directory = absolute(expand(trainer.profile.directory, timestamp))
    return trainer.model_copy(update={"profile": dataclasses.replace(trainer.profile, directory=directory)})


def warmup_note(config: RunConfig, steps: int) -> str | None:
    """A note when the learning-rate warmup lasts the whole run (a shipped recipe shortened by
    trainer.steps, say): the rate never reaches its peak and a decay never starts.

    >>> from dew.recipes.config import RunConfig
    >>> warmup_note(RunConfig.load("tiny-lm"), 20).startswith("note: optimizer.warmup_steps=20 spans all")
    True
    >>> warmup_note(RunConfig.load("tiny-lm"), 200) is None
    True
    """
    updates = steps // config.trainer.accumulation
    warmup, optimizer = config.optimizer.warmup_steps, config.optimizer
    if not warmup or warmup < updates:
        return None
    decay = "" if optimizer.schedule == "constant" else f", and its {optimizer.schedule} decay never starts"
    return (f"note: optimizer.warmup_steps={warmup} spans all of the run's {updates} updates: the learning rate "
            f"climbs toward optimizer.learning_rate={optimizer.learning_rate:g} without reaching it{decay}; "
            "lower optimizer.warmup_steps or raise trainer.steps.")


def ramp_note(dataset: Dataset, steps: int) -> str | None:
    """A note when a batch ramp (trainer.batch_ramp) outlasts the run: its last steps never train at
    the full data.batch, which the run would otherwise leave unsaid.

    >>> from dew.data.base import Dataset
    >>> ramp = Dataset(train=lambda partition: iter(()), batch=16, ramp=((0, 4), (50, 8), (100, 16)))
    >>> print(ramp_note(ramp, 60))
    note: the batch ramp reaches data.batch=16 only at step 101, past the run's 60 steps: no step trains more than 8 rows; lower trainer.batch_ramp.steps or raise trainer.steps.
    >>> ramp_note(ramp, 101) is None
    True
    """
    if not dataset.ramp or dataset.ramp[-1][0] < steps:
        return None
    reached = max(batch for start, batch in dataset.ramp if start < steps)
    return (f"note: the batch ramp reaches data.batch={dataset.batch} only at step {dataset.ramp[-1][0] + 1}, past "
            f"the run's {steps} steps: no step trains more than {reached} rows; lower trainer.batch_ramp.steps or "
            "raise trainer.steps.")


def fresh_base_note(config: RunConfig) -> str | None:
    """A note when LoRA adapts a base no init section gives: it is drawn fresh and stays so.

    >>> from dew.recipes.config import RunConfig
    >>> fresh_base_note(RunConfig.load("tiny-lm-lora")).startswith("note: lora freezes every weight")
    True
    >>> fresh_base_note(RunConfig.load("tiny-lm")) is None
    True
    """
    if config.lora is None or config.init is not None:
        return None
    return ("note: lora freezes every weight but the adapters, and no init section gives them: the base is drawn "
            "fresh and stays as drawn, so the adapters learn over random weights (a model whose blocks start "
            "gated shut, as a DiT's modulation does, passes them no gradient at all). Start from trained "
            "weights with init.run or init.pretrained.")


def _saved_meta(checkpoints: Checkpoints, step: int) -> Mapping[str, object] | None:
    """The meta saved with step, None when its manifest cannot be read (the restore says why)."""
    from dew.checkpoints.errors import CheckpointCorruptedError, CheckpointNotFoundError

    try:
        return checkpoints.meta(step)
    except (CheckpointCorruptedError, CheckpointNotFoundError):
        return None


def _where(checkpoints: Checkpoints | None) -> str:
    """The run directory, before the trainer lists its checkpoints and trackers."""
    if checkpoints is None:
        return "Run: no checkpoints are kept; set trainer.checkpoint_dir to keep the weights."
    return (f"Run: {checkpoints.directory} (its recipe in "
            f"{Path(checkpoints.directory) / 'run.json'})")


class PoolRecipeMismatchError(RecipeError):
    """The processes of a pool were given different recipes, overrides or dew versions."""


class PoolDevicesMismatchError(RecipeError):
    """The processes of a pool hold different numbers of devices."""


def join_pool(config: RunConfig) -> None:
    """Ready this process for config's run (dew.training.prepare_process) and, in a pool, check its
    processes agree: as many devices each, one recipe, one dew. Repeating it changes nothing."""
    from dew.training.runtime.process import prepare_process

    prepare_process(config.trainer)
    refuse_uneven_devices()
    refuse_differing_processes(config)


def refuse_uneven_devices() -> None:
    """In a pool, refuse processes that hold different numbers of devices, before the first
    collective: the mesh lays the same number out on each, and the first exchange failed with a
    reshape error's traceback."""
    import collections

    import jax

    if jax.process_count() == 1:
        return
    held = collections.Counter(device.process_index for device in jax.devices())
    if len(set(held.values())) > 1:
        counts = ", ".join(f"process {index}: {count}" for index, count in sorted(held.items()))
        raise PoolDevicesMismatchError(
            f"The pool's processes hold different numbers of devices ({counts}); every process must hold "
            "the same number. Give each the same devices (CUDA_VISIBLE_DEVICES, or XLA_FLAGS="
            "--xla_force_host_platform_device_count=N on CPUs), as dew launch does.")


def refuse_differing_processes(config: RunConfig) -> None:
    """In a pool, refuse a recipe (with its overrides) or dew's installed versions that differ from
    process 0's: every process runs one program, and one that differs (other steps, another
    batch) reaches a collective the others never call, so the pool would hang without a word."""
    import jax

    if jax.process_count() == 1:
        return
    import hashlib

    import numpy as np
    from jax.experimental import multihost_utils

    from dew.versions import installed

    text = json.dumps({"recipe": config.recorded(), "versions": installed()}, sort_keys=True, default=str)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.int64)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    differing = [index for index, value in enumerate(digests) if value != digests[0]]
    if differing:
        first, other = _texts_of(text, (0, differing[0]))
        raise PoolRecipeMismatchError(
            f"Process(es) {', '.join(map(str, differing))} of the pool of {len(digests)} were given another "
            "recipe, other overrides or other dew versions than process 0: the pool runs one program"
            f"{_differing_fields(first, other, differing[0])}. Start every process with the same command (dew "
            "launch does) and the same installed dew.")


def _texts_of(text: str, sources: tuple[int, ...]) -> list[str]:
    """The texts the processes sources hold, each sent to every process of the pool (each passes its
    own), padded to the longest text of the pool (its length gathered once)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    raw = np.frombuffer(text.encode(), np.uint8)
    longest = int(np.max(multihost_utils.process_allgather(np.asarray([raw.size], np.int64))))
    padded = np.zeros(longest + 1, np.uint8)  # a zero after the text: it holds none
    padded[: raw.size] = raw
    sent = [np.asarray(multihost_utils.broadcast_one_to_all(padded, is_source=jax.process_index() == source))
            for source in sources]
    return [array.tobytes().split(b"\0", 1)[0].decode() for array in sent]


def _differing_fields(first: str, other: str, index: int) -> str:
    """' (recipe.trainer.steps is 8 on process 0 and 5 on process 1)': the first few fields of the recipe
    (and installed versions) in which process index's differs from process 0's, or "" where none does."""
    from dew.tracking.rows import recipe_fields

    mine, theirs = (recipe_fields(json.loads(text)) for text in (first, other))
    keys = [key for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]
    named = "; ".join(f"{key} is {mine.get(key, 'absent')} on process 0 and {theirs.get(key, 'absent')} on process "
                      f"{index}" for key in keys[:4])
    return f" ({named}{f' and {len(keys) - 4} more' if len(keys) > 4 else ''})" if keys else ""


def recorded(config: RunConfig, objective: Objective) -> dict[str, Any]:
    """What the run writes down (``RunConfig.recorded``), with the fields its objective read from
    files when built (``Objective.recorded_fields``) filled in where the recipe left them empty."""
    record = config.recorded()
    section = record["objective"]
    for key, value in objective.recorded_fields().items():
        if section.get(key) is None:
            section[key] = value
    return record


def train(config: RunConfig, *, timestamp: str | None = None) -> TrainState:
    """Build the run config describes, train it to its last step and return the TrainState.

    timestamp expands ``{timestamp}`` (a resumed run passes the one it started with);
    None takes process 0's clock now.
    """
    from dew.training.runtime.process import run_timestamp

    join_pool(config)
    stamp = timestamp or run_timestamp()

    import jax

    from dew.recipes.resuming import changes_line, resuming_line, started_from, upgrade_line
    from dew.telemetry.artifacts import Artifact
    from dew.training.rundir import note_sample, sampled_at
    from dew.training.trainer import Trainer

    parts = build_parts(config, stamp)
    objective, dataset = parts.objective, parts.dataset
    assert dataset is not None  # build_parts loads it unless asked not to
    fit = config.trainer.fit_arguments(dataset.steps_per_epoch)
    if fit["eval_every"] and dataset.val is None and not fit["preview"]:
        raise RecipeError(
            f"The recipe sets trainer.eval_every={fit['eval_every']}, which scores the validation "
            f"split, but its data {config.data.name!r} holds none out: hold some out (data.load."
            "val_fraction, for a reader that takes it: dew describe " + config.data.name + "), set "
            "trainer.preview=true to write previews alone, or unset trainer.eval_every.")
    checkpoints = config.trainer.build_checkpoints(stamp)
    resumed_at = None if checkpoints is None else checkpoints.latest
    if checkpoints is not None and resumed_at is not None:
        before = _saved_recipe(type(config), checkpoints.directory)  # read once for the three below
        refuse_changed_function(config, checkpoints.directory, resumed_at, before=before)
        # A finished run's newest step is checked first: a damaged one falls back to an older step
        # and trains on, which the restore says, so "nothing to train" would be wrong. A run going on
        # has its step's files counted (the restore reads them all): a missing or cut one is not
        # announced as where the run resumes. Every process asks (a pool's local steps are agreed on
        # collectively); process 0 says it.
        ahead = resumed_at < fit["steps"]
        intact = checkpoints.whole(resumed_at) if ahead else checkpoints.intact(resumed_at)
        # Asked on every process, said by process 0: a pool's local store answers each query
        # collectively, so one process asking alone would pair its collective with another's.
        saved_meta = _saved_meta(checkpoints, resumed_at)
        if jax.process_index() == 0 and intact:
            trained = None if before is None else before.trainer.total_steps(dataset.steps_per_epoch)
            print(resuming_line(checkpoints.directory, resumed_at, fit["steps"], trained), flush=True)
            changes = None if before is None else changes_line(
                before.recorded(), recorded(config, objective), cwd=started_from(checkpoints.directory))
            if changes is not None:  # a finished run's too: another recipe in its folder trains nothing
                print(changes if ahead else
                      f"{changes[:-1]}; it trains nothing here, as this folder's run is finished (its sample "
                      "below is of the checkpoints' weights): to train this recipe, set trainer.checkpoint_dir "
                      "to a new folder.", flush=True)
            upgraded = None if saved_meta is None else upgrade_line(resumed_at, saved_meta)
            if upgraded is not None and ahead:
                print(upgraded, flush=True)
        # a finished run trains nothing, so no schedule is reshaped; a pool says it once
        if (ahead or not intact) and jax.process_index() == 0:
            warn_if_schedule_reshaped(config, fit["steps"], dataset.steps_per_epoch,
                                      checkpoints.directory, resumed_at, before=before)
    # A resumed run's checkpoint holds every weight, so the weights it started from (init, a
    # distillation's teacher) are not read again: their folders may have moved since.
    initializer = None
    if resumed_at is None:  # the recipe's init section, else the weights the objective starts from
        initializer = initial_variables(config, objective)
        initializer = objective.initializer() if initializer is None else initializer
    key = jax.random.key(config.seed)
    tracker = config.build_trackers(stamp)
    if jax.process_index() == 0:
        print(_where(checkpoints), flush=True)
        for note in (warmup_note(config, fit["steps"]), ramp_note(dataset, fit["steps"]),
                     fresh_base_note(config) if resumed_at is None else None):
            if note is not None:
                print(note, flush=True)
    try:
        trainer = Trainer.from_config(
            _profile_expanded(config.trainer, stamp), objective, run_optimizer(config, fit["steps"]), key=key,
            checkpoints=checkpoints, tracker=tracker, rollout=objective.rollout(),
            initializer=initializer,
            evaluations=build_evaluations(config, parts, stamp), recipe=recorded(config, objective))
        # Validation scores what the objective defines (a reward, a perplexity), as `dew eval` does.
        state = trainer.fit(dataset, **fit, metrics=tuple(objective.metrics()))
    except BaseException as error:
        # The run's own failure is the one to see; closing still flushes what it can.
        stopped = isinstance(error, SystemExit | KeyboardInterrupt)  # a signal's stop (Preempted) or Ctrl-C
        with contextlib.suppress(Exception):
            _close(checkpoints, tracker, failed=not isinstance(error, SystemExit),
                   outcome="killed" if stopped else "failed")
        raise
    # Every process takes part (the weights may be sharded across them); one prints. The
    # sample is journaled with its step, unless the last validation journaled a preview there or
    # the run, resumed with nothing to train, gave it before (a stop at the last step had not).
    try:
        sample = show_sample(objective, state, quiet=jax.process_index() != 0)
        given = int(state.step) == resumed_at and sampled_at(checkpoints) == int(state.step)
        if (tracker is not None and isinstance(sample, Artifact) and not config.trainer.preview
                and not given and jax.process_index() == 0):
            tracker.artifact(sample, int(state.step))
            note_sample(checkpoints, int(state.step))
    except KeyboardInterrupt:
        # The run is whole: only its sample was cut short; "interrupted" alone reads as a lost run.
        saved = ("." if checkpoints is None else
                 f", saved in {checkpoints.directory}.\n{usage(objective, state, checkpoints.directory)}")
        raise SampleInterruptedError(f"interrupted (Ctrl-C) while drawing the run's sample, after it trained to "
                                     f"step {int(state.step)}{saved}") from None
    finally:
        _close(checkpoints, tracker)
    if checkpoints is not None and jax.process_index() == 0:
        print(usage(objective, state, checkpoints.directory))
    return state


def usage(objective: Objective, state: TrainState, directory: object) -> str:
    """The console's last line: the commands that use the trained run, as its pipeline takes them."""
    from dew.objectives.inference import NoPipelineError, PipelineError, pipeline_of

    try:
        pipeline = pipeline_of(objective, state)
        command = pipeline.usage(directory)
    except NoPipelineError:  # nothing to sample or export: the metrics remain
        return f"Use the run: dew eval {directory} (its objective declares no pipeline)."
    except PipelineError as error:  # a plugin's pipeline() that returns no Pipeline
        return f"Use the run: dew eval {directory} ({error})"
    others = "dew eval and dew export read it too" if pipeline.exports() else "dew eval reads it too"
    return f"Use the run: {command}; {others}."


def objective_parts(objective: Objective) -> ObjectiveParts:
    """What an objective hands the Trainer besides itself: its rollout and starting weights.

    An objective that samples its own batches (GRPO, PPO) or checks them on
    the host (DPO) has a ``rollout()``; one that starts from weights of its
    own (a distillation's teacher) an ``initializer()``; the recipe's init
    section overrides the latter. A recipe cannot name either directly: they
    are code, and the objective's fields configure them. Keys whose value is
    None are left out, so the result passes to the Trainer as keywords.
    """
    parts: ObjectiveParts = {}
    rollout, initializer = objective.rollout(), objective.initializer()
    if rollout is not None:
        parts["rollout"] = rollout
    if initializer is not None:
        parts["initializer"] = initializer
    return parts


class ObjectiveParts(TypedDict, total=False):
    """The Trainer keywords an objective supplies (objective_parts): each only when it has one."""

    rollout: Rollout
    initializer: Initializer


def _close(checkpoints: Checkpoints | None, tracker: Tracker | None, *, failed: bool = False,
           outcome: Outcome = "finished") -> None:
    """Wait for the last checkpoint, tell the trackers the outcome and close them, raising the
    first failure. A process of a pool whose run failed waits for no save: the others may never
    join its collectives."""
    from dew.checkpoints.pool import pooled
    from dew.tracking.protocol import Concludes

    try:
        if checkpoints is not None:
            if failed and pooled():
                checkpoints.abandon()
            else:
                checkpoints.close()
    finally:
        if tracker is not None:
            try:
                if isinstance(tracker, Concludes):
                    tracker.conclude(outcome)
            finally:
                tracker.close()


def show_sample(objective: Objective, state: TrainState, out: TextIO | None = None,
                quiet: bool = False) -> object:
    """Print the objective's preview of the trained weights (EMA when kept), if it has one.

    A preview is an Artifact (its text, or its kind and shape, is printed) or
    a bare string; the objective's preview is returned either way. It draws
    from the state's key as a validation's preview at this step does, so the
    sample printed is the one journaled there.
    """
    import numpy as np

    from dew.telemetry.artifacts import Artifact
    from dew.telemetry.render import pictured
    from dew.training.evaluation import preview_key

    variables = state.averaged if state.averaged is not None else state.params
    preview = objective.preview(variables, preview_key(state.rng, int(state.step)))
    if preview is None or quiet:
        return preview
    stream = out or sys.stdout
    if isinstance(preview, str):
        print(f"Sample (preview):\n{pictured(preview)}", file=stream)
    elif isinstance(preview, Artifact) and isinstance(preview.data, str):
        print(f"Sample ({preview.name}):\n{pictured(preview.data)}", file=stream)
    elif isinstance(preview, Artifact):
        print(f"Preview {preview.name!r}: {preview.kind} of shape {np.shape(preview.data)}",
              file=stream)
    return preview
