"""Build what a RunConfig describes, train it, and show a sample from the result.

The order matters: ``prepare_process`` runs before anything opens JAX's
backend, so the recipe's XLA flags and process pool take effect; the run key
is drawn from the recipe's seed; the objective is built around the model and
takes the data reader's tokenizer when the recipe gives none.

Strings among a component's fields may hold two placeholders, replaced when
the run is built (run.json keeps them as written): ``{stdlib}``, the folder
of Python's standard library (a corpus every machine has), and
``{timestamp}``, process 0's clock when the run started (``run_timestamp``),
the same on every process, written without colons (``2026-12-01_09-30-00``)
so a folder named after it is valid on every file system and in a URL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dew.recipes.config import RunConfig

__all__ = [
    "ConfiguredTracker",
    "Parts",
    "ScheduleReshapedWarning",
    "build_objective",
    "build_parts",
    "build_trackers",
    "expand",
    "initial_variables",
    "objective_parts",
    "run_inputs",
    "run_optimizer",
    "show_sample",
    "train",
    "usage",
    "warn_if_schedule_reshaped",
]


class ScheduleReshapedWarning(UserWarning):
    """A resumed run's learning-rate schedule differs from the one its checkpoints trained with."""


def expand(value: Any, timestamp: str) -> Any:
    """value with {stdlib}, {recipes} and {timestamp} replaced in every string it holds.

    The timestamp's colons become dashes, so it can name a folder anywhere:

    >>> expand({"directory": "runs/{timestamp}"}, "2026-12-01_09:30:00")
    {'directory': 'runs/2026-12-01_09-30-00'}
    """
    if isinstance(value, str):
        if "{recipes}" in value:  # data shipped beside the recipes (a fine-tuning set, say)
            value = value.replace("{recipes}", str(Path(__file__).resolve().parent))
        if "{stdlib}" in value:
            import sysconfig

            value = value.replace("{stdlib}", sysconfig.get_paths()["stdlib"])
        return value.replace("{timestamp}", timestamp.replace(":", "-"))
    if isinstance(value, dict):
        return {k: expand(v, timestamp) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(expand(v, timestamp) for v in value)
    return value


def _fields(group: str, component: Any, timestamp: str) -> dict[str, Any]:
    """A component's fields as the recipe gives them, placeholders replaced (the registry's
    build validates them and makes mappings into their declared types)."""
    return expand(component.fields, timestamp)


def run_inputs(component: Any) -> frozenset[str]:
    """What a run hands an objective class besides its fields (``Objective.run_inputs``)."""
    from dew.objectives.base import Objective

    if isinstance(component, type) and issubclass(component, Objective):
        return component.run_inputs
    return frozenset()


def _tokenizer(reader: Any) -> Any:
    """The reader's tokenizer, when the reader encodes text (dew.data.base.TextReader)."""
    from dew.data.base import TextReader

    return reader.text_tokenizer() if isinstance(reader, TextReader) else None


def build_objective(config: RunConfig, model: Any, reader: Any, timestamp: str = "") -> Any:
    """The recipe's objective around model, given the reader's tokenizer if it takes one.

    What the run hands the objective besides the recipe's fields is what the
    objective declares in ``Objective.run_inputs``: the model, the tokenizer.
    """
    from dew import registry

    fields = _fields("objectives", config.objective, timestamp)
    inputs = run_inputs(registry.objectives.load(config.objective.name))
    tokenizer = _tokenizer(reader)
    if tokenizer is not None and model is not None:
        from dew.pretrained import check_vocabulary

        check_vocabulary(tokenizer, model)  # before anything compiles
    if tokenizer is not None and "tokenizer" not in fields and "tokenizer" in inputs:
        fields["tokenizer"] = tokenizer
    if "model" in inputs:
        fields["model"] = model
    return registry.objectives.build(config.objective.name, **fields)


def build_trackers(config: RunConfig, timestamp: str = "") -> Any:
    """The recipe's trackers (and W&B when trainer.wandb is set) as one tracker, or None.

    Each receives the recipe, as ``RunConfig.recorded`` writes it down (secrets
    redacted), with the run's RunStarted record, and records it where runs are
    compared (MLflow parameters, TensorBoard hparams, W&B config).
    """
    from dew import registry

    built = [registry.trackers.build(t.name, **_fields("trackers", t, timestamp))
             for t in config.trackers]
    wandb = config.trainer.wandb
    if wandb is not None:
        built.append(registry.trackers.build(
            "wandb", project=wandb.project, name=wandb.name, entity=wandb.entity,
            offline=wandb.offline,
        ))
    if not built:
        return None
    if len(built) == 1:
        return ConfiguredTracker(built[0], config.recorded())
    from dew.tracking.composite import Trackers

    return ConfiguredTracker(Trackers(*built), config.recorded())


class ConfiguredTracker:
    """A tracker whose RunStarted records carry the recipe, which the loop does not know."""

    def __init__(self, tracker: Any, config: dict[str, Any]) -> None:
        self.tracker = tracker
        self.config = config

    def log(self, scalars: Any, step: int) -> None:
        self.tracker.log(scalars, step)

    def artifact(self, value: Any, step: int) -> None:
        from dew.telemetry.records import RunStarted

        if isinstance(value, RunStarted) and not value.config:
            value = dataclasses.replace(value, config=self.config)
        self.tracker.artifact(value, step)

    def close(self) -> None:
        self.tracker.close()


def _absolute(path: str | None) -> str | None:
    """A local path made absolute; a URL (gs://bucket/run, s3://...) passes through unchanged."""
    if path is None or "://" in path:
        return path
    return str(Path(path).expanduser().resolve())


def _checkpoints(config: RunConfig, timestamp: str = "") -> Any:
    kwargs = config.trainer.checkpoint_arguments()
    if kwargs is None:
        return None
    from dew.checkpoints.manager import Checkpoints

    for name in ("directory", "local_directory"):
        if name in kwargs:
            kwargs[name] = _absolute(expand(kwargs[name], timestamp))
    directory = kwargs.pop("directory")
    return Checkpoints(directory, **kwargs)


def _optimizer_config(config: RunConfig, steps: int) -> Any:
    """The optimizer config, its decay counted to the run's last update when unset."""
    optimizer = config.optimizer
    if optimizer.schedule != "constant" and optimizer.decay_steps is None:
        updates = max(steps // config.trainer.accumulation, optimizer.warmup_steps + 1)
        optimizer = optimizer.model_copy(update={"decay_steps": updates})
    return optimizer


def warn_if_schedule_reshaped(config: RunConfig, steps: int, steps_per_epoch: int | None,
                              directory: Any, resumed_at: int) -> None:
    """Warn when resuming with another trainer.steps changes the learning-rate schedule.

    A decaying schedule whose length is not set (optimizer.decay_steps) is
    stretched over the run's steps, so resuming with a new ``steps`` changes
    the rate from the resumed step on: a jump, not a continuation. The saved
    run.json says what the checkpoints were trained with.
    """
    import warnings

    from dew.recipes.config import RUN_FILE, RunConfig

    saved = Path(str(directory)) / RUN_FILE
    if not saved.is_file():
        return
    try:
        before = RunConfig.read(saved)
    except Exception:  # noqa: BLE001 - an unreadable old recipe is no reason to stop training
        return
    old_steps = before.trainer.total_steps(steps_per_epoch)
    old = _optimizer_config(before, old_steps)
    new = _optimizer_config(config, steps)
    if old_steps == steps or old.decay_steps == new.decay_steps:
        return
    warnings.warn(ScheduleReshapedWarning(
        f"This run resumes at step {resumed_at} of checkpoints trained for {old_steps} steps; "
        f"with {steps} steps its {new.schedule} learning-rate schedule now decays over "
        f"{new.decay_steps} updates instead of {old.decay_steps}, so the rate changes from the "
        f"resumed step on. To continue the old schedule, set optimizer.decay_steps="
        f"{old.decay_steps}."
    ), stacklevel=2)


def run_optimizer(config: RunConfig, steps: int) -> Any:
    """The recipe's optimizer for a run of steps (the schedule's decay counted to its end)."""
    from dew.training.optim import build_optimizer

    return build_optimizer(_optimizer_config(config, steps))


def _ramped(config: RunConfig, dataset: Any) -> Any:
    ramp = config.trainer.batch_ramp
    if ramp is None:
        return dataset
    from dew.data import ramped

    return ramped(dataset, start=ramp.start, steps=ramp.steps)


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a recipe builds before training: the model, the data reader and its
    tokenizer, the objective, and the dataset (None when not asked for)."""

    model: Any
    reader: Any
    tokenizer: Any
    objective: Any
    dataset: Any = None


def build_parts(config: RunConfig, timestamp: str = "", *, with_data: bool = True) -> Parts:
    """Build the recipe's model, reader, objective and (with_data) its loaded dataset.

    The inference commands rebuild a trained run this way from its run.json,
    without reading its data.
    """
    from dew import models, registry

    model = (None if config.model is None
             else models.build(config.model.name, **_fields("models", config.model, timestamp)))
    if config.quantization is not None and model is not None:
        from dew.adapters.quantization import apply_quantization

        model = apply_quantization(model, config.quantization)
    if config.lora is not None and model is not None:
        from dew.adapters.lora import apply_lora

        model = apply_lora(model, config.lora)
    reader = registry.datasets.build(config.data.name, **_fields("datasets", config.data, timestamp))
    # The objective first: a tokenizer the model cannot embed is refused before any data is read.
    objective = build_objective(config, model, reader, timestamp)
    dataset = None
    if with_data:
        load = expand(dict(config.data.load), timestamp)
        if "seed" not in load and "seed" in registry.declared_fields(reader.load):
            load["seed"] = config.seed  # the run's seed orders its data too
        dataset = _ramped(config, reader.load(batch=config.data.batch, **load))
    if config.lora is not None:
        from dew.adapters.lora import adapters_only

        objective = adapters_only(objective)  # the base weights are frozen: one copy, no optimizer state
    return Parts(model, reader, _tokenizer(reader), objective, dataset)


def initial_variables(config: RunConfig, objective: Any) -> Any:
    """What the recipe's init section starts the run from (None: a fresh initialization).

    ``init.pretrained`` reads a directory Pretrained.save, ``dew export`` or
    transformers wrote, into the recipe model's max_seq_len and param_dtype;
    ``init.run`` is another run's parameters alone (``ParamsFrom``). With a
    ``lora`` section either is the base under fresh adapters (quantized for
    QLoRA). An objective with ``starting_weights`` (a preference or RL
    objective, whose reference copies the policy) narrows what is read to
    the model's part. The trainer checks either against the tree a fresh
    init makes, naming each path whose shape differs.
    """
    init = config.init
    if init is None:
        return None
    if init.pretrained is not None:
        from dew.pretrained import Pretrained

        model = getattr(objective, "model", None)
        source = _absolute(init.pretrained)
        loaded = Pretrained.load(source, max_seq_len=getattr(model, "max_seq_len", None),
                                 param_dtype=getattr(model, "param_dtype", None),
                                 scan_layers=bool(getattr(model, "scan_layers", False)))
        if model is not None and hasattr(model, "rope_base"):
            from dew.pretrained.llama import check_same_function

            check_same_function(model, loaded.model, f"init.pretrained {source}")
        return dict(loaded.variables)
    from dew.training.initializers import ParamsFrom

    source = ParamsFrom(_absolute(init.run), step=init.step)
    if config.lora is not None:  # the other run's weights are the base; the adapters start fresh
        from dew.adapters.lora import BaseWeights

        source = BaseWeights(source)
    narrow = getattr(objective, "starting_weights", None)
    # An objective whose variables hold more than the model's (a frozen reference,
    # a value head) reads only the model's part; its init makes the rest.
    return narrow(source) if callable(narrow) else source


def _where(checkpoints: Any) -> str:
    """The run directory, before the trainer lists its checkpoints and trackers."""
    if checkpoints is None:
        return "Run: no checkpoints are kept; set trainer.checkpoint_dir to keep the weights."
    return (f"Run: {checkpoints.directory} (its recipe in "
            f"{Path(checkpoints.directory) / 'run.json'})")


def train(config: RunConfig) -> Any:
    """Build the run config describes, train it to its last step and return the TrainState."""
    from dew.training.runtime.process import prepare_process, run_timestamp

    prepare_process(config.trainer)
    stamp = run_timestamp()

    import jax

    from dew.training.trainer import Trainer

    parts = build_parts(config, stamp)
    objective, dataset = parts.objective, parts.dataset
    fit = config.trainer.fit_arguments(dataset.steps_per_epoch)
    optimizer = run_optimizer(config, fit["steps"])
    checkpoints = _checkpoints(config, stamp)
    if checkpoints is not None:
        checkpoints.acquire()  # a second run on a live directory is refused before it writes anything
    resumed_at = checkpoints.latest if checkpoints is not None else None
    if resumed_at is not None:
        warn_if_schedule_reshaped(config, fit["steps"], dataset.steps_per_epoch,
                                  checkpoints.directory, resumed_at)
    if checkpoints is not None and jax.process_index() == 0:
        config.save(checkpoints.directory)
    initializer = initial_variables(config, objective)
    key = jax.random.key(config.seed)
    tracker = build_trackers(config, stamp)
    if jax.process_index() == 0:
        print(_where(checkpoints), flush=True)
    extra = {} if initializer is None else {"initializer": initializer}
    try:
        trainer = Trainer.from_config(config.trainer, objective, optimizer, key=key,
                                      checkpoints=checkpoints, tracker=tracker,
                                      **{**objective_parts(objective), **extra})
        # Validation scores what the objective defines (a reward, a perplexity), as `dew eval` does.
        state = trainer.fit(dataset, **fit, metrics=tuple(objective.metrics()))
    except BaseException:
        # The run's own failure is the one to see; closing still flushes what it can.
        with contextlib.suppress(Exception):
            _close(checkpoints, tracker)
        raise
    _close(checkpoints, tracker)
    # Every process takes part (the weights may be sharded across them); one prints.
    show_sample(objective, state, key, quiet=jax.process_index() != 0)
    if checkpoints is not None and jax.process_index() == 0:
        print(usage(objective, state, checkpoints.directory))
    return state


def usage(objective: Any, state: Any, directory: Any) -> str:
    """The console's last line: the commands that use the trained run, as its pipeline takes them."""
    from dew.objectives.inference import PipelineError

    try:
        command = objective.pipeline(state).usage(directory)
    except PipelineError:  # nothing to sample or export: the metrics remain
        return f"Use the run: dew eval {directory} (its objective declares no pipeline)."
    return f"Use the run: {command}; dew eval and dew export read it too."


def objective_parts(objective: Any) -> dict[str, Any]:
    """What an objective hands the Trainer besides itself: a rollout and starting weights.

    An objective that samples its own batches (GRPO, PPO) or checks them on
    the host (DPO) has ``rollout()``; one that starts from weights of its
    own (a distillation's teacher) has ``initializer()``; the recipe's init
    section overrides it. A recipe cannot name either directly: they
    are code, and the objective's fields configure them.
    """
    parts: dict[str, Any] = {}
    for name in ("rollout", "initializer"):
        make = getattr(objective, name, None)
        made = make() if callable(make) else None
        if made is not None:
            parts[name] = made
    return parts


def _close(checkpoints: Any, tracker: Any) -> None:
    """Wait for the last checkpoint and close the trackers, raising the first failure."""
    try:
        if checkpoints is not None:
            checkpoints.close()
    finally:
        if tracker is not None:
            tracker.close()


def show_sample(objective: Any, state: Any, key: Any, out: Any = None, quiet: bool = False) -> Any:
    """Print the objective's preview of the trained weights (EMA when kept), if it has one."""
    import jax

    variables = state.averaged if getattr(state, "averaged", None) is not None else state.params
    preview = objective.preview(variables, jax.random.fold_in(key, int(state.step)))
    if preview is None or quiet:
        return preview
    stream = out or sys.stdout
    data = getattr(preview, "data", preview)
    if isinstance(data, str):
        print(f"Sample ({getattr(preview, 'name', 'preview')}):\n{data}", file=stream)
    elif dataclasses.is_dataclass(preview):
        print(f"Preview {preview.name!r}: {preview.kind} of shape "
              f"{getattr(data, 'shape', '?')}", file=stream)
    return preview
