"""Evaluation: score a finite, coordinated prefix of a validation split.

Every process walks its own share of the split. In a pool they agree,
batch by batch, on whether all of them still have one, so every rank
scores the same number of global batches (the coordinated prefix) and the
scores agree everywhere. Metrics reduce the outputs on the host.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.data.base import Reader, close_if_closable
from dew.errors import DewError
from dew.objectives.base import Mean, MeanMetric, Metric, Objective, Step, Variables
from dew.telemetry.artifacts import Artifact
from dew.training.placement.mesh import build_mesh, data_partition, global_shape, shard_batch
from dew.training.state import stream
from dew.typing import PyTree

__all__ = ["Evaluation", "Evaluator", "MetricOutputError", "OutputMeans", "evaluate", "preview_key"]


@dataclass(frozen=True)
class Evaluation:
    """One evaluation event. Scores carry the split prefix (``val/loss``).

    coordinated_batches is how many global batches every rank scored,
    records how many rows they held, uneven_shards whether some rank had
    batches left over. elapsed_seconds is rank zero's wall time from the
    call through the closing of its iterator, the same number on every
    rank. previews are kept on rank 0 only.
    """

    step: int
    split: str
    scores: dict[str, float]
    coordinated_batches: int
    records: int
    uneven_shards: bool
    event_key: tuple[int, ...]
    elapsed_seconds: float
    previews: tuple[Artifact, ...] = field(default=())

    type = "evaluation"

    @property
    def scalars(self) -> dict[str, float]:
        """The scores, plus the evaluation/* counts when a batch was scored."""
        out = dict(self.scores)
        if self.coordinated_batches:
            out["evaluation/batches"] = float(self.coordinated_batches)
            out["evaluation/records"] = float(self.records)
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step, "split": self.split, "scores": self.scores,
            "coordinated_batches": self.coordinated_batches, "records": self.records,
            "uneven_shards": self.uneven_shards, "event_key": list(self.event_key),
            "elapsed_seconds": self.elapsed_seconds,
            "previews": [p.name for p in self.previews],
        }


@dataclass(frozen=True)
class OutputMeans:
    """Score every Mean an objective's evaluate returns, each under its own name."""

    name: str = "*"

    def empty(self) -> dict[str, tuple[float, float]]:
        return {}

    def update(self, accumulator: dict, outputs: Mapping[str, PyTree]) -> dict:
        out = dict(accumulator)
        for key, value in outputs.items():
            if isinstance(value, Mean):
                out[key] = MeanMetric(key).update(out.get(key, (0.0, 0.0)), {key: value})
        return out

    def result(self, accumulator: dict) -> dict[str, float]:
        return {key: MeanMetric(key).result(acc) for key, acc in accumulator.items()}


def _any_everywhere(flag: bool) -> tuple[bool, bool]:
    """(every process has a batch, some process has one), agreed across the pool."""
    if jax.process_count() == 1:
        return flag, flag
    flags = np.asarray(multihost_utils.process_allgather(np.asarray(flag, np.int32)))
    return bool(flags.min()), bool(flags.max())


def _rank_zeros(seconds: float) -> float:
    """Rank zero's seconds, on every rank: an event's wall time is rank zero's.

    Sent as the float64's bits (two uint32), so every rank holds exactly rank
    zero's number whatever precision JAX computes in.
    """
    if jax.process_count() == 1:
        return seconds
    bits = np.asarray([seconds], np.float64).view(np.uint32)
    sent = np.asarray(multihost_utils.broadcast_one_to_all(bits), np.uint32)
    return float(sent.view(np.float64)[0])


class MetricOutputError(DewError, KeyError):
    """A validation metric reads an output the objective's evaluate does not return."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0])


def _updated(metric: Metric, accumulator: Any, outputs: Mapping[str, Any], objective: object) -> Any:
    """metric.update, its KeyError for an output evaluate never returned named with both sides."""
    try:
        return metric.update(accumulator, outputs)
    except KeyError as error:
        if isinstance(error, DewError) or error.args[:1] == () or error.args[0] in outputs:
            raise
        raise MetricOutputError(
            f"The validation metric {metric.name!r} of {type(objective).__name__}.metrics() reads the output "
            f"{error.args[0]!r}, which its evaluate does not return (it returns {', '.join(sorted(outputs))}): "
            "return it from evaluate, or leave the metric out of metrics().") from error


def _rows(batch: Mapping[str, PyTree]) -> int:
    leaves = [x for x in jax.tree.leaves(batch) if np.ndim(x)]
    return int(np.shape(leaves[0])[0]) if leaves else 0


def _typed(key: jax.Array) -> jax.Array:
    """key as a typed key (a state's raw uint32 key data is wrapped)."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jnp.unsignedinteger):
        return jax.random.wrap_key_data(key)
    return key


def preview_key(key: jax.Array, step: int) -> jax.Array:
    """The key a preview at step draws from: the typed root key's preview stream, folded with the step."""
    return jax.random.fold_in(stream(key, "preview"), int(step))


class Evaluator:
    """Scores validation passes for one objective, compiling once per batch shape.

    The compiled scorer takes everything that changes between events (the
    variables, the EMA overlay, the batch, the key, the schedule step) as
    arguments, so a run that evaluates every few hundred steps compiles its
    scorer once per batch shape, not once per event. ``evaluate`` builds a
    throwaway one; the trainer keeps one per fit.
    """

    def __init__(self, objective: Objective, mesh: Mesh | None = None) -> None:
        self.objective = objective
        self.mesh = mesh or build_mesh()
        self._compiled: dict[Hashable, Callable[..., Mapping[str, PyTree]]] = {}
        self.traces = 0  # how often a scorer was traced (a test counts them)

    def _score(self, variables: Variables, averaged: Variables | None, batch: Mapping[str, jax.Array],
               key: jax.Array, index: jax.Array, schedule: jax.Array) -> Mapping[str, PyTree]:
        self.traces += 1
        info = Step(step=schedule, microstep=schedule, updates=schedule,
                    key=jax.random.fold_in(key, index), ema=averaged, training=False)
        return self.objective.evaluate(variables, batch, info)

    def _scorer(self, signature: Hashable) -> Callable[..., Mapping[str, PyTree]]:
        if signature not in self._compiled:
            replicated = NamedSharding(self.mesh, PartitionSpec())
            self._compiled[signature] = jax.jit(self._score, out_shardings=replicated)
        return self._compiled[signature]

    def __call__(
        self,
        variables: Variables,
        batches: Reader | None,
        *,
        key: jax.Array,
        metrics: Sequence[Metric] = (),
        step: int | jax.Array = 0,
        averaged: Variables | None = None,
        preview: bool = False,
        split: str = "val",
        schedule_step: int | jax.Array | None = None,
    ) -> Evaluation:
        started = time.perf_counter()
        step = int(step)
        event_key = (step, zlib.crc32(split.encode()))
        key = _typed(key)
        previews: tuple[Artifact, ...] = ()
        if preview and jax.process_index() == 0:
            shown = preview_key(key, step)
            sample = self.objective.preview(averaged if averaged is not None else variables, shown)
            previews = tuple(p for p in ([sample] if isinstance(sample, Artifact) else list(sample or ())) if p)
        if not metrics or batches is None:
            return Evaluation(step, split, {}, 0, 0, False, event_key,
                              _rank_zeros(time.perf_counter() - started), previews)

        event = jax.random.fold_in(jax.random.fold_in(stream(key, "evaluation"), step), event_key[1])
        partition = data_partition(self.mesh)
        schedule = jnp.asarray(step if schedule_step is None else int(schedule_step), jnp.int32)
        accumulators = [m.empty() for m in metrics]
        coordinated = rows = 0
        uneven = False
        iterator = batches(partition)
        try:
            while True:
                batch = next(iterator, None)
                everyone, someone = _any_everywhere(batch is not None)
                if not everyone:
                    uneven = someone
                    break
                assert batch is not None  # every process has one, this one too
                shapes = global_shape(batch, partition)
                signature = jax.tree.structure(shapes), tuple((s.shape, s.dtype) for s in jax.tree.leaves(shapes))
                outputs = self._scorer(signature)(
                    variables, averaged, shard_batch(batch, self.mesh, partition), event,
                    jnp.asarray(coordinated, jnp.int32), schedule,
                )
                host = jax.device_get(outputs)
                for i, metric in enumerate(metrics):
                    accumulators[i] = _updated(metric, accumulators[i], host, self.objective)
                coordinated += 1
                rows += _rows(batch) * partition.shares
        finally:
            close_if_closable(iterator)
        scores: dict[str, float] = {}
        if coordinated:
            for metric, accumulator in zip(metrics, accumulators, strict=True):
                result = metric.result(accumulator)
                if isinstance(result, Mapping):
                    scores.update({f"{split}/{k}": float(v) for k, v in result.items()})
                else:
                    scores[f"{split}/{metric.name}"] = float(result)
        return Evaluation(
            step, split, scores, coordinated, rows, uneven, event_key,
            _rank_zeros(time.perf_counter() - started), previews,  # the iterator is closed by now
        )


def evaluate(
    objective: Objective,
    variables: Variables,
    batches: Reader | None,
    *,
    key: jax.Array,
    metrics: Sequence[Metric] = (),
    step: int | jax.Array = 0,
    averaged: Variables | None = None,
    preview: bool = False,
    mesh: Mesh | None = None,
    split: str = "val",
    schedule_step: int | jax.Array | None = None,
) -> Evaluation:
    """Score a coordinated prefix of batches with metrics, without optimizer or tracker.

    batches is a Reader (Dataset.val): it is opened for this process's share
    and closed here. With no metrics and no preview, nothing is read. key is
    the run's root key; scoring and previews draw from its evaluation and
    preview streams.
    """
    return Evaluator(objective, mesh)(
        variables, batches, key=key, metrics=metrics, step=step, averaged=averaged,
        preview=preview, split=split, schedule_step=schedule_step,
    )
