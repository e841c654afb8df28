"""The Objective protocol: what a run learns, and the small types it speaks in.

An objective initializes the model's variables (``init``), returns a loss as
a ``Mean`` with an ``Aux`` (``loss``), and may score validation batches
(``evaluate``) and render samples (``preview``). The trainer differentiates
the Mean's total, so gradient accumulation over microbatches is exact.

Two class attributes tell the trainer how to treat the variables:

- ``ema`` (an ``EMASpec``) names the leaves that keep an exponential moving
  average, and how fast it follows them (a constant or a schedule).
- ``frozen`` (a ``LeafFilter``) names the leaves that never train: a
  reference policy, a teacher, a frozen encoder. The trainer never
  differentiates them, gives them no optimizer state, no accumulation window
  and no EMA copy, so they exist once in device memory; they are sharded and
  checkpointed like every other variable. Freeze a whole collection with
  ``under("teacher")`` or a subtree of the parameters with
  ``under("params/reference")``. Only the ``params`` collection is ever
  trained, so a filter over other collections changes nothing but the EMA.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dew.data.base import Tokenizer
from dew.errors import ObjectiveMethodError, ObjectiveSignatureError
from dew.typing import PyTree

# The class's annotations resolve at run time (a registry reads a subclass's type hints, its
# base's included); the trainer's types, named in the seams' signatures only, need not.
if TYPE_CHECKING:
    from dew.telemetry.artifacts import Artifact
    from dew.training.initializers import Initializer, WeightSource
    from dew.training.protocols import Rollout
    from dew.training.state import TrainState

if TYPE_CHECKING:
    from dew.objectives.inference import Pipeline

__all__ = [
    "Aux",
    "Batch",
    "ChecksBatchRows",
    "DecaySchedule",
    "EMASpec",
    "LeafFilter",
    "Mean",
    "MeanMetric",
    "Metric",
    "Objective",
    "Step",
    "Variables",
    "check_signature",
    "cosine_decay",
    "everything",
    "under",
]

Variables = Mapping[str, PyTree]  # collections ('params', ...) of nested arrays
Batch = Mapping[str, jax.Array]  # what a loss reads, inside the compiled step
Loss = TypeVar("Loss")
Effects = TypeVar("Effects")

# The docs section that shows a plugin objective how to serve the inference commands.
PIPELINE_GUIDE = "docs/plugins.md#what-dew-generate-and-dew-eval-ask-of-an-objective"


@flax.struct.dataclass
class Mean:
    """A statistic as total and count, so microbatches and shards sum exactly.

    >>> import jax.numpy as jnp
    >>> float(Mean(jnp.asarray(6.0), jnp.asarray(3)).value)
    2.0
    """

    if TYPE_CHECKING:  # flax.struct.dataclass adds replace; its type is not declared there
        def replace(self, **changes: object) -> Mean: ...

    total: jax.Array
    count: jax.Array

    @property
    def value(self) -> jax.Array:
        return self.total / jnp.maximum(self.count, 1)

    def __add__(self, other: Mean) -> Mean:
        return Mean(self.total + other.total, self.count + other.count)

    @staticmethod
    def of(values: jax.Array, weights: jax.Array | None = None) -> Mean:
        """The mean of values (optionally weighted), kept as total and count."""
        values = jnp.asarray(values, jnp.float32)
        if weights is None:
            return Mean(jnp.sum(values), jnp.asarray(values.size, jnp.float32))
        weights = jnp.asarray(weights, jnp.float32)
        return Mean(jnp.sum(values * weights), jnp.sum(weights))


@flax.struct.dataclass
class Aux:
    """Everything a loss returns besides its statistic.

    metrics are logged (a ``Mean`` is averaged exactly over microbatches, a
    plain array is averaged over them); updates holds the new values of
    nonparameter collections (batch statistics, caches) that the trainer
    writes back with ``write_back``.
    """

    if TYPE_CHECKING:  # flax.struct.dataclass adds replace; its type is not declared there
        def replace(self, **changes: object) -> Aux: ...

    metrics: Mapping[str, Mean | jax.Array] = field(default_factory=dict)
    updates: Variables | None = None


@flax.struct.dataclass
class Step:
    """What the trainer tells an objective about the current step.

    step counts attempts, microstep accepted microbatches, updates optimizer
    updates. key is this microbatch's random key (folded from the run key
    and step), ema the averaged variables when an EMA is kept.
    """

    if TYPE_CHECKING:  # flax.struct.dataclass adds replace; its type is not declared there
        def replace(self, **changes: object) -> Step: ...

    step: jax.Array
    microstep: jax.Array
    updates: jax.Array
    key: jax.Array
    ema: Variables | None = None
    training: bool = flax.struct.field(pytree_node=False, default=True)


LeafFilter = Callable[[tuple[str, ...], PyTree], bool]


_CALLED_AS = {"init": "key, variables=None", "loss": "variables, batch, step"}


def check_signature(objective: object, method: str, error: TypeError, *arguments: object) -> None:
    """Raise ObjectiveSignatureError when error came from calling the objective's method (init or
    loss) with arguments it does not take (a plugin's loss that leaves out step, an init that takes
    no variables in a run that starts from weights), not from inside it; else return."""
    try:
        signature = inspect.signature(getattr(objective, method))
    except (TypeError, ValueError):  # a callable inspect cannot read: its own error stands
        return
    try:
        signature.bind(*arguments)
    except TypeError:
        raise ObjectiveSignatureError(
            f"{type(objective).__name__}.{method}{signature} cannot be called as the trainer calls it, with "
            f"{len(arguments)} argument(s) ({error}): declare it as `def {method}(self, {_CALLED_AS[method]})` "
            "(dew.objectives.base.Objective).") from error


def everything(path: tuple[str, ...], leaf: PyTree) -> bool:
    """Accept every leaf."""
    return True


def under(prefix: str | Sequence[str]) -> LeafFilter:
    """Build a filter accepting the leaves whose path starts with prefix.

    prefix is a slash-separated path (``"params/decoder"``) or a sequence of keys.

    >>> accept = under("params/head")
    >>> accept(("params", "head", "kernel"), None), accept(("params", "body", "kernel"), None)
    (True, False)
    """
    parts = tuple(p for p in prefix.split("/") if p) if isinstance(prefix, str) else tuple(prefix)

    def accept(path: tuple[str, ...], leaf: PyTree) -> bool:
        return tuple(path[: len(parts)]) == parts

    accept.__name__ = f"under({'/'.join(parts)!r})"
    return accept


DecaySchedule = Callable[[jax.Array], jax.Array]


@dataclass(frozen=True)
class EMASpec:
    """Which leaves the EMA copy tracks, and how fast it follows them.

    decay is the weight of the old average at each optimizer update: a
    number in [0, 1], or a schedule, a traceable function of the count of
    updates made before this one (JEPA's target encoder follows 0.996 up to
    1.0, see ``cosine_decay``). select picks the leaves; in ``state.averaged``
    the others read as the live values. Only selected leaves are stored.

    >>> spec = EMASpec(decay=lambda updates: 0.5 + 0 * updates)
    >>> float(spec.rate(jnp.asarray(3)))
    0.5
    """

    decay: float | DecaySchedule = 0.999
    select: LeafFilter = everything

    def __post_init__(self) -> None:
        if not callable(self.decay) and not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"EMASpec.decay must lie in [0, 1] or be a schedule, got {self.decay}.")

    def rate(self, updates: jax.Array) -> jax.Array:
        """The decay at an update count (the constant, or the schedule's value)."""
        if callable(self.decay):
            return jnp.asarray(self.decay(updates), jnp.float32)
        return jnp.asarray(self.decay, jnp.float32)


def cosine_decay(start: float, end: float, steps: int) -> DecaySchedule:
    """A decay that rises from start to end along a half cosine over steps updates, then stays.

    >>> schedule = cosine_decay(0.996, 1.0, 100)
    >>> [round(float(schedule(jnp.asarray(u))), 4) for u in (0, 50, 100, 200)]
    [0.996, 0.998, 1.0, 1.0]
    """
    if steps < 1:
        raise ValueError(f"cosine_decay needs at least 1 step, got {steps}.")
    if not (0.0 <= start <= 1.0 and 0.0 <= end <= 1.0):  # an average's weights, as EMASpec's constant
        raise ValueError(f"cosine_decay's start and end are decays, each in [0, 1]; got {start} and {end}.")

    def schedule(updates: jax.Array) -> jax.Array:
        progress = jnp.clip(jnp.asarray(updates, jnp.float32) / steps, 0.0, 1.0)
        return end - (end - start) * (jnp.cos(jnp.pi * progress) + 1.0) / 2.0

    return schedule


@runtime_checkable
class ChecksBatchRows(Protocol):
    """An objective that cannot train on a batch of some numbers of rows (PPO's minibatches must split
    it, KTO pairs each row with another): ``check_rows`` raises a named error for such a global batch,
    so ``dew train --check`` refuses the recipe's data.batch rather than the run's first step."""

    def check_rows(self, rows: int) -> None: ...


@runtime_checkable
class ChecksOwnWeights(Protocol):
    """An objective that reads weights of its own besides the model's (a distillation's teacher):
    ``check_own_weights`` refuses, reading descriptions and headers alone, what its initializer would
    refuse, so ``dew train --check`` says so rather than the run's start."""

    def check_own_weights(self) -> None: ...


@runtime_checkable
class Metric(Protocol):
    """Reduce a validation pass to one scalar, on the host.

    ``update`` folds one batch of evaluation outputs (numpy arrays) into an
    accumulator that ``empty`` starts; ``result`` turns it into the score.
    """

    @property
    def name(self) -> str: ...

    def empty(self) -> Any: ...

    def update(self, accumulator: Any, outputs: Mapping[str, np.ndarray]) -> Any: ...

    def result(self, accumulator: Any) -> float | Mapping[str, float]:
        """The score; a metric that scores several things returns them by name."""
        ...


@dataclass(frozen=True)
class MeanMetric:
    """The mean of one evaluation output over the whole pass (a Mean or per-row values)."""

    name: str
    output: str | None = None

    def empty(self) -> tuple[float, float]:
        return (0.0, 0.0)

    def update(self, accumulator: tuple[float, float], outputs: Mapping[str, PyTree]) -> tuple[float, float]:
        value = outputs[self.output or self.name]
        if isinstance(value, Mean):
            total, count = float(np.sum(value.total)), float(np.sum(value.count))
        else:
            array = np.asarray(value, np.float64)
            total, count = float(array.sum()), float(array.size)
        return (accumulator[0] + total, accumulator[1] + count)

    def result(self, accumulator: tuple[float, float]) -> float:
        total, count = accumulator
        return total / count if count else math.nan


class Objective(Generic[Loss, Effects]):
    """Define what is learned: the variables, the loss, what evaluation produces.

    Subclasses implement ``init`` and ``loss``. ``evaluate`` defaults to the
    loss and the metrics it reports; ``preview`` to nothing. ``ema`` names the
    leaves that keep an exponential moving average (None keeps none);
    ``frozen`` the leaves that never train (None freezes none).

    ``pipeline`` wraps trained weights in the inference task every command
    goes through (``dew.objectives.inference``); ``metrics`` names the
    validation metrics its evaluate outputs support.

    ``run_inputs`` says what a recipe run hands the constructor besides the
    recipe's own fields: ``"model"`` (the network the recipe's ``model``
    section builds) and ``"tokenizer"`` (the data reader's, unless the recipe
    gives one). An objective that builds its own network declares neither.

    Every other capability a run, a command or an adapter asks of an
    objective is declared below with the default an objective without it
    has, so nothing probes for it: ``trains``, ``heads``, ``serves_scores``, ``rollout``, ``initializer``,
    ``starting_weights``, ``recorded_fields``, ``metrics``, ``pipeline`` and
    ``reference_collection``. The ``model`` and ``tokenizer`` it holds are
    declared by type, and held when ``run_inputs`` names them.
    """

    ema: EMASpec | None = None
    frozen: LeafFilter | None = None
    run_inputs: ClassVar[frozenset[str]] = frozenset()
    trains: ClassVar[type[Any] | None] = None
    """The kind of model it trains, a protocol of ``dew.nn.kinds`` (a causal decoder, a pixel
    denoiser, ...): a recipe pairing it with another kind is refused by name. None takes any model."""
    fills_its_start: ClassVar[bool] = False
    """Whether ``init(key, variables)`` draws what variables lack, because its own ``initializer()``
    gives only part of the tree (a distillation's teacher, its student drawn): a LoRA run then lets
    it draw the rest before putting the base under the adapters."""
    heads: ClassVar[tuple[str, ...]] = ()
    """The top-level parameters it adds beside its model's own (a reward model's score, PPO's
    value head): a LoRA run trains them in full beside the adapters, as PEFT's modules_to_save
    does, and draws them fresh where the base weights lack them."""
    serves_scores: ClassVar[bool] = False
    """Whether its model serves a score from its decoder's features (a reward model) and never
    trains the decoder's token predictions: a text task (perplexity, multiple choice,
    generation) would score untrained logits, so it is refused for such a run."""
    # Declared without a value: a dataclass subclass would read a value here as its field's
    # default. An objective whose run_inputs name "model" (or "tokenizer") holds one.
    model: nn.Module
    """The network it trains, which a recipe's model section builds (``"model" in run_inputs``)."""
    tokenizer: Tokenizer | None
    """How its text becomes ids and back (``"tokenizer" in run_inputs``); None when not given."""

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """Return the model's variables (Flax's nested dict), possibly partitioned.

        variables, when given, are the weights the run starts from (a
        pretrained model, another run's parameters), already on the devices;
        build the variables from them rather than from key. The trainer
        checks that what comes back has the tree and shapes of a fresh init.
        """
        raise ObjectiveMethodError(f"{type(self).__name__} must implement init(key): the variables it trains, "
                                   "such as self.model.init(key, example_input).")

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        """Return the loss as a Mean over this microbatch, and its Aux."""
        raise ObjectiveMethodError(f"{type(self).__name__} must implement loss(variables, batch, step), returning "
                                   "its (Mean, Aux) pair.")

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        """Per-batch outputs a Metric reduces; by default the loss and its metrics as Means."""
        loss, aux = self.loss(variables, batch, step)
        outputs: dict[str, PyTree] = {"loss": loss}
        for name, value in aux.metrics.items():
            outputs[name] = value if isinstance(value, Mean) else Mean(jnp.sum(value), jnp.asarray(jnp.size(value), jnp.float32))
        return outputs

    def preview(self, variables: Variables, key: jax.Array) -> Artifact | Sequence[Artifact] | None:
        """A sample to show a person (an Artifact, or several), or None."""
        return None

    def metrics(self) -> Sequence[Metric]:
        """The validation metrics evaluate's outputs support; () reports every Mean it returns."""
        return ()

    def pipeline(self, state: TrainState | Variables) -> Pipeline:
        """The inference task of state's weights (a TrainState, its EMA copy when kept, or variables).

        Every command (generate, eval, embed, export) goes through it; an
        objective adds its own keyword options (sampling settings,
        ``ema=False``). An objective without one refuses, naming the capability.
        """
        from dew.objectives.inference import NoPipelineError

        raise NoPipelineError(f"{type(self).__name__} declares no pipeline, so its weights serve no "
                              "inference command; implement Objective.pipeline(state) to return a "
                              f"dew.objectives.inference.Pipeline ({PIPELINE_GUIDE} shows how).")

    def required_keys(self) -> Sequence[str]:
        """Batch keys the loss reads; the trainer checks them before compiling."""
        return ()

    def check_batch(self, batch: Mapping[str, np.ndarray], step: int) -> None:
        """Refuse, on the host and before the step runs, a batch the loss cannot use.

        The trainer calls it with this process's share of every batch; raise
        an error naming the key, the step and what was expected (token ids
        outside the vocabulary, for example). Keep it cheap.
        """

    def tokens(self, batch: Mapping[str, jax.ShapeDtypeStruct]) -> int | None:
        """Tokens one global batch of these shapes trains on, for throughput (None: not token data)."""
        return None

    def flops(self, batch: Mapping[str, jax.ShapeDtypeStruct]) -> float | None:
        """Model FLOPs of one training step (forward and backward) on a global batch of these
        shapes, for the MFU estimate; None when the model does not say."""
        return None

    # -- what a run, a command or an adapter asks of it beyond the loss --------------------
    def rollout(self) -> Rollout | None:
        """The rollout that makes each batch on the host before the step reads it (GRPO samples
        completions, DPO checks its pairs); None trains on the dataset's batches as they come."""
        return None

    def initializer(self) -> Initializer:
        """The weights a fresh run starts from when the recipe names none (a distillation's
        teacher read from its directory, say); None starts from a random init."""
        return None

    def starting_weights(self, source: WeightSource) -> WeightSource:
        """What of source (another run's or a pretrained model's weights) a fresh run starts from.

        All of it by default. An objective whose variables hold more than the
        model's (a frozen reference, a value head) narrows it to the model's
        part, and its init makes the rest.
        """
        return source

    def recorded_fields(self) -> Mapping[str, Any]:
        """Fields of its recipe section that it read from files when built (a distillation's
        teacher from its export's config.json), in a recipe's JSON form: a run records them in
        run.json where the recipe left them empty, so every later command (resume, generate,
        eval, export) rebuilds it once those files are gone. None by default."""
        return {}

    @property
    def reference_collection(self) -> str | None:
        """The collection holding a frozen copy of the starting policy (DPO, GRPO keep one),
        which a LoRA run replaces by the base model itself; None when there is none."""
        return None
