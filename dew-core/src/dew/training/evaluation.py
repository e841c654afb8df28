"""Evaluation: score a finite, coordinated prefix of a validation split.

Every process walks its own share of the split. In a pool they agree,
batch by batch, on whether all of them still have one, so every rank
scores the same number of global batches (the coordinated prefix) and the
scores agree everywhere. Metrics reduce the outputs on the host.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.data.base import Reader
from dew.objectives.base import Mean, MeanMetric, Metric, Objective, Step, Variables
from dew.telemetry.artifacts import Artifact
from dew.training.mesh import build_mesh, data_partition, global_shape, shard_batch

__all__ = ["Evaluation", "OutputMeans", "evaluate"]


@dataclass(frozen=True)
class Evaluation:
    """One evaluation event. Scores carry the split prefix (``val/loss``).

    coordinated_batches is how many global batches every rank scored,
    records how many rows they held, uneven_shards whether some rank had
    batches left over. previews are kept on rank 0 only.
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

    def to_json(self) -> dict[str, Any]:
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

    def update(self, accumulator: dict, outputs: Mapping[str, Any]) -> dict:
        out = dict(accumulator)
        for key, value in outputs.items():
            if isinstance(value, Mean):
                out[key] = MeanMetric(key).update(out.get(key, (0.0, 0.0)), {key: value})
        return out

    def result(self, accumulator: dict) -> dict[str, float]:  # type: ignore[override]
        return {key: MeanMetric(key).result(acc) for key, acc in accumulator.items()}


def _any_everywhere(flag: bool) -> tuple[bool, bool]:
    """(every process has a batch, some process has one), agreed across the pool."""
    if jax.process_count() == 1:
        return flag, flag
    flags = np.asarray(multihost_utils.process_allgather(np.asarray(flag, np.int32)))
    return bool(flags.min()), bool(flags.max())


def _rows(batch: Mapping[str, Any]) -> int:
    leaves = [x for x in jax.tree.leaves(batch) if np.ndim(x)]
    return int(np.shape(leaves[0])[0]) if leaves else 0


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
    and closed here. With no metrics and no preview, nothing is read.
    """
    started = time.perf_counter()
    step = int(step)
    event_key = (step, zlib.crc32(split.encode()))
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jnp.unsignedinteger):
        key = jax.random.wrap_key_data(key)
    event = jax.random.fold_in(jax.random.fold_in(key, step), event_key[1])
    previews: tuple[Artifact, ...] = ()
    if preview and jax.process_index() == 0:
        sample = objective.preview(averaged if averaged is not None else variables, event)
        previews = tuple(p for p in ([sample] if isinstance(sample, Artifact) else list(sample or ())) if p)
    if not metrics or batches is None:
        return Evaluation(step, split, {}, 0, 0, False, event_key, time.perf_counter() - started, previews)

    mesh = mesh or build_mesh()
    partition = data_partition(mesh)
    schedule = step if schedule_step is None else int(schedule_step)
    replicated = NamedSharding(mesh, PartitionSpec())

    def score(variables: Variables, batch: Mapping[str, Any], index: jax.Array) -> Any:
        info = Step(
            step=jnp.asarray(schedule, jnp.int32), microstep=jnp.asarray(schedule, jnp.int32),
            updates=jnp.asarray(schedule, jnp.int32), key=jax.random.fold_in(event, index),
            ema=averaged, training=False,
        )
        return objective.evaluate(variables, batch, info)

    compiled: dict[Any, Any] = {}
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
            shapes = global_shape(batch, partition)
            signature = jax.tree.structure(shapes), tuple((s.shape, s.dtype) for s in jax.tree.leaves(shapes))
            if signature not in compiled:
                compiled[signature] = jax.jit(score, out_shardings=replicated)
            outputs = compiled[signature](variables, shard_batch(batch, mesh, partition), coordinated)
            host = jax.device_get(outputs)
            for i, metric in enumerate(metrics):
                accumulators[i] = metric.update(accumulators[i], host)
            coordinated += 1
            rows += _rows(batch) * partition.shares
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
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
        time.perf_counter() - started, previews,
    )
