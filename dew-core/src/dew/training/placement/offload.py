"""Host offload of train-state fields: where Layout.host keeps them, and the step that fetches them.

A field named in Layout.host (the optimizer state, the EMA) sits in pinned
host memory between steps, so the devices hold it only while a step runs.
The step copies it in, runs the transaction unchanged, and copies the new
value back out; the numbers are those of a device-resident run, only the
memory they wait in differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax

from dew.training.placement.layout import HOST_MEMORY

if TYPE_CHECKING:  # the engine's types, named in annotations only: placement sits below it
    from dew.training.state import TrainState
    from dew.training.step import StepFn

__all__ = ["fetching", "in_host_memory"]


def _moved(state: TrainState, fields: Sequence[str], kind: str | None, placement: TrainState) -> TrainState:
    changes = {}
    for name in fields:
        value = getattr(state, name)
        if value is None:
            continue
        target = getattr(placement, name)
        changes[name] = jax.tree.map(
            lambda leaf, sharding: jax.device_put(leaf, sharding if kind is None else sharding.with_memory_kind(kind)),
            value, target)
    return dataclasses.replace(state, **changes) if changes else state


def in_host_memory(shardings: TrainState, fields: Sequence[str]) -> TrainState:
    """shardings with the named fields' leaves in pinned host memory (same specs)."""
    changes = {name: jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), getattr(shardings, name))
               for name in fields if getattr(shardings, name) is not None}
    return dataclasses.replace(shardings, **changes) if changes else shardings


def fetching(step: StepFn, placement: TrainState, fields: Sequence[str]) -> StepFn:
    """step, fetching the host-resident fields to device memory first and writing them back after."""
    if not fields:
        return step

    def fetched(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict]:
        new, metrics = step(_moved(state, fields, "device", placement), batch)
        return _moved(new, fields, HOST_MEMORY, placement), metrics

    return fetched
