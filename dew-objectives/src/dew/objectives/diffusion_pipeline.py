"""Pipelines: sample from a trained diffusion, masked- or block-diffusion model, save and load it.

``objective.pipeline(state)`` returns a pipeline holding the objective and
the trained variables (the EMA copy when kept). A ``DiffusionPipeline`` turns
class labels, text prompts or nothing into uint8 images or videos; a
``TextDiffusionPipeline`` writes token sequences and decodes them.

``save(directory)`` writes dew's own layout, which ``load_pipeline`` reads:

- ``config.json``: ``{"format": "dew-pipeline", "version": 1, "model": {"name":
  <registered model name>, "fields": {...}}, "objective": {"name": <registered
  objective name>, "fields": {...}}}``; every field is as the recipe would give it.
- ``params.npz``: every variable as a numpy array, named by its path with
  "/" between keys (``params/blocks_0/attention/query``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DiffusionPipeline",
    "PipelineFormatError",
    "TextDiffusionPipeline",
    "load_pipeline",
    "variables_of",
]

CONFIG, PARAMS, FORMAT = "config.json", "params.npz", "dew-pipeline"
_SKIPPED = {"model", "tokenizer", "ema", "parent", "name"}


class PipelineFormatError(ValueError):
    """A directory that is not a saved dew pipeline, or a pipeline that cannot be saved."""


def variables_of(state: Any, ema: bool = True) -> Mapping[str, Any]:
    """A TrainState's EMA copy (when kept and ema) or its parameters; variables pass through."""
    if hasattr(state, "params"):
        averaged = getattr(state, "averaged", None)
        return averaged if ema and averaged is not None else state.params
    return state


def _registered_name(group: str, component: Any) -> str:
    from dew import registry

    found = registry.registry(group)
    for name in found.names():
        if found.load(name) is type(component):
            return name
    raise PipelineFormatError(f"{type(component).__name__} is not registered in {group!r}; register "
                              "it (an entry point) so that a saved pipeline can be built again.")


def _fields(component: Any) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(component):
        if field.name in _SKIPPED or field.name.startswith("_"):
            continue
        value = _dtype_name(getattr(component, field.name))
        try:
            json.dumps(value)
        except TypeError as error:
            raise PipelineFormatError(
                f"{type(component).__name__}.{field.name}={value!r} cannot be written to "
                f"{CONFIG}; give it by name (a schedule as 'vp_cosine', say) to save.") from error
        out[field.name] = value
    return out


def _dtype_name(value: Any) -> Any:
    """A dtype field (jnp.float32, say) by its name ("float32"), which builds the same module; else value."""
    scalar_type = isinstance(value, type) and (issubclass(value, np.generic) or hasattr(value, "dtype"))
    if scalar_type or isinstance(value, np.dtype):  # jnp.float32 is not a numpy type but has a dtype
        return np.dtype(value).name
    return value


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten(value, path))
        else:
            out[path] = np.asarray(jax.device_get(value))
    return out


def _unflatten(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in arrays.items():
        node = tree
        *parents, leaf = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    return tree


@dataclasses.dataclass(frozen=True)
class _Saved:
    objective: Any
    variables: Mapping[str, Any]

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write config.json and params.npz (see the module's docstring) into directory."""
        target = Path(directory)
        config = {
            "format": FORMAT, "version": 1,
            "model": {"name": _registered_name("dew.models", self.objective.model),
                      "fields": _fields(self.objective.model)},
            "objective": {"name": _registered_name("dew.objectives", self.objective),
                          "fields": _fields(self.objective)},
        }
        target.mkdir(parents=True, exist_ok=True)
        np.savez(target / PARAMS, **_flatten(nn.meta.unbox(self.variables)))
        (target / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return target


@dataclasses.dataclass(frozen=True)
class DiffusionPipeline(_Saved):
    """Images or videos from a DiffusionObjective's model and its trained variables."""

    def __call__(self, conditions: Sequence[Any] | None = None, *, rows: int | None = None,
                 key: jax.Array | None = None, steps: int | None = None,
                 guidance: float | None = None, method: str | None = None) -> np.ndarray:
        """uint8 samples [N, ...]: one per condition (a class label or a prompt), or rows unconditional."""
        from dew.objectives.diffusion import to_pixels

        objective = self.objective
        condition = None if conditions is None else objective.conditioning.of(list(conditions))
        count = rows if condition is None else int(condition.shape[0])
        if count is None:
            raise ValueError("Give conditions (labels or prompts) or rows for unconditional samples.")
        scale = objective.guidance if guidance is None else guidance
        objective.check_guidance(scale)
        sample = jax.jit(lambda v, k, c: objective.sample(v, k, c, count, guidance=scale,
                                                          steps=steps, method=method))
        x = sample(self.variables, key if key is not None else jax.random.key(0), condition)
        return to_pixels(x)


@dataclasses.dataclass(frozen=True)
class TextDiffusionPipeline(_Saved):
    """Token sequences from a masked- or block-diffusion objective's model."""

    def __call__(self, rows: int = 1, *, key: jax.Array | None = None,
                 steps: int | None = None) -> list[str] | jax.Array:
        """rows samples, decoded to text when the objective has a tokenizer (else ids)."""
        tokens = self.objective.generate(self.variables, key if key is not None else jax.random.key(0),
                                         rows, steps=steps)
        tokenizer = self.objective.tokenizer
        if tokenizer is None:
            return tokens
        return [tokenizer.decode([int(i) for i in row]) for row in tokens]


def load_pipeline(directory: str | os.PathLike[str], *, tokenizer: Any = None) -> Any:
    """The pipeline a save wrote: its model and objective built again, its variables read back."""
    from dew import models, registry

    source = Path(directory)
    try:
        config = json.loads((source / CONFIG).read_text())
    except FileNotFoundError as error:
        raise PipelineFormatError(f"{source} holds no {CONFIG}; point at a directory a pipeline's "
                                  "save wrote.") from error
    if config.get("format") != FORMAT:
        raise PipelineFormatError(f"{source / CONFIG} is not a dew pipeline (format "
                                  f"{config.get('format')!r}, expected {FORMAT!r}).")
    model = models.build(config["model"]["name"], **config["model"]["fields"])
    fields = dict(config["objective"]["fields"])
    if tokenizer is not None:
        fields["tokenizer"] = tokenizer
    objective = registry.objectives.build(config["objective"]["name"], model=model, **fields)
    with np.load(source / PARAMS) as arrays:
        variables = _unflatten({name: arrays[name] for name in arrays.files})
    return objective.pipeline(variables)
