"""What the trainer needs to know about a model's scanned layer stacks.

A stack is a subtree of the variables whose every leaf carries the
``layers`` logical axis first (dew.nn.pipeline): these are the banks a host
layout streams and the parameters the ``stage`` mesh axis splits. Checked
here, before anything compiles, so a stage count that cannot split the model
is named at placement rather than deep inside a trace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import jax.numpy as jnp
from flax import linen as nn

from dew.errors import DewError
from dew.nn.pipeline import PipelineSchedule, StageDivisionError
from dew.nn.sharding import LAYERS
from dew.training.placement.mesh import MeshSpec
from dew.typing import PyTree

__all__ = ["NoStackError", "bank_sites", "check_stages", "schedule_of", "with_bubble"]


StateT = TypeVar("StateT")
BatchT = TypeVar("BatchT")


class NoStackError(DewError, ValueError):
    """Pipeline stages were asked for, but the model declares no scanned layer stack."""


def _stacked(leaf: object) -> bool:
    return isinstance(leaf, nn.LogicallyPartitioned) and tuple(leaf.names)[:1] == (LAYERS,)


def _leaves(node: PyTree) -> list[PyTree]:
    if isinstance(node, Mapping):
        return [leaf for value in node.values() for leaf in _leaves(value)]
    return [node]


def bank_sites(boxed: PyTree) -> tuple[str, ...]:
    """The paths ('params/layers', ...) of the subtrees whose every leaf is stacked on ``layers``.

    >>> import jax, jax.numpy as jnp
    >>> from dew.nn.backbones import CausalTransformer
    >>> model = CausalTransformer(vocab_size=16, emb_features=8, num_layers=2, num_heads=2,
    ...                           mlp_features=16, max_seq_len=8, scan_layers=True)
    >>> bank_sites(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    ('params/layers',)
    """
    found: list[str] = []

    def walk(node: PyTree, path: tuple[str, ...]) -> None:
        if not isinstance(node, Mapping):
            return
        leaves = _leaves(node)
        if path and leaves and all(_stacked(leaf) for leaf in leaves):
            found.append("/".join(path))
            return
        for key, value in node.items():
            walk(value, (*path, str(key)))

    walk(boxed, ())
    return tuple(found)


def _at(tree: PyTree, path: str) -> PyTree:
    for part in path.split("/"):
        tree = tree[part]
    return tree


def check_stages(boxed: PyTree, spec: MeshSpec, *, checkpoint: str | None = None) -> None:
    """Refuse a stage count the model's stacks cannot be split into, naming the fix.

    checkpoint names the saved step a trainer is about to restore, if any: its
    layer count is then fixed, so the fix offered is a stage count alone.
    """
    if spec.stage == 1:
        return
    sites = bank_sites(boxed)
    if not sites:
        raise NoStackError(
            f"MeshSpec.stage={spec.stage} splits a scanned layer stack into pipeline stages, but "
            "the model declares none (no parameter has the 'layers' axis first). Build the "
            "model with scan_layers=True, or set stage=1."
        )
    chunks = spec.stage * spec.circular_repeats
    for site in sites:
        depth = _leaves(_at(boxed, site))[0].unbox().shape[0]
        if depth % chunks:
            fits = " or ".join(f"stage={n}" for n in range(1, depth + 1)
                               if depth % (n * spec.circular_repeats) == 0)
            repeats = f" x circular_repeats={spec.circular_repeats}" if spec.circular_repeats > 1 else ""
            fix = (f"{checkpoint} holds these {depth} layers, so restore it with {fits}"
                   if checkpoint is not None else
                   f"choose a stage count that divides {depth} ({fits}), or a layer count that "
                   f"{chunks} divides")
            raise StageDivisionError(
                f"The stack {site} has {depth} layers, which stage={spec.stage}{repeats} pipeline "
                f"chunks do not divide; {fix}."
            )


def with_bubble(step: Callable[[StateT, BatchT], tuple[StateT, dict]],
                schedule: PipelineSchedule) -> Callable[[StateT, BatchT], tuple[StateT, dict]]:
    """step, reporting its schedule's bubble fraction as the metric pipeline_bubble when it
    pipelines (the share of stage-iterations a stage spends idle)."""
    if schedule.stages == 1:
        return step

    def reported(state: StateT, batch: BatchT) -> tuple[StateT, dict]:
        new, metrics = step(state, batch)
        return new, {**metrics, "pipeline_bubble": jnp.asarray(schedule.bubble, jnp.float32)}

    return reported


def schedule_of(spec: MeshSpec) -> PipelineSchedule:
    """The pipeline schedule a mesh spec asks for."""
    return PipelineSchedule(stages=spec.stage, microbatches=spec.microbatches, kind=spec.schedule,  # type: ignore[arg-type]
                            repeats=spec.circular_repeats)
