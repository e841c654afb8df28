"""Pipelines: sample from a trained diffusion, masked- or block-diffusion model, save and load it.

``objective.pipeline(state)`` returns a pipeline holding the objective and
the trained variables (the EMA copy when kept). A ``DiffusionPipeline`` turns
class labels, text prompts or nothing into uint8 images or videos; a
``TextDiffusionPipeline`` writes token sequences and decodes them.

``save(directory)`` writes through ``Pretrained.save`` in dew's own layout
(``dew.pretrained.native``: config.json naming the registered model and its
fields and the objective as the task, model.safetensors with every variable
by its path, the tokenizer beside them). ``Pretrained.load(directory)``
reads it back and its ``pipeline()`` samples exactly as the saved pipeline
did; ``DiffusionPipeline.load`` and ``TextDiffusionPipeline.load`` (or
``load_pipeline``) do both at once.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from dew.errors import DewError
from dew.objectives.base import variables_of

__all__ = [
    "DiffusionPipeline",
    "PipelineFormatError",
    "TextDiffusionPipeline",
    "load_pipeline",
    "variables_of",
]


class PipelineFormatError(DewError, ValueError):
    """A directory whose saved task is not the pipeline it is loaded as."""


@dataclasses.dataclass(frozen=True)
class _Saved:
    objective: Any
    variables: Mapping[str, Any]

    def pretrained(self) -> Any:
        """The model, variables, tokenizer and task (the objective) as a Pretrained."""
        from dew.pretrained import Pretrained
        from dew.pretrained.native import component_fields, registered_name

        task = {"name": registered_name("dew.objectives", self.objective),
                "fields": component_fields(self.objective)}
        return Pretrained(self.objective.model, nn.meta.unbox(self.variables),
                          self.objective.tokenizer, task)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the pipeline through Pretrained.save, in dew's own layout; return directory."""
        return self.pretrained().save(directory)

    @classmethod
    def load(cls, directory: str | os.PathLike[str], **fields: Any) -> Any:
        """The pipeline save wrote in directory (fields override the saved objective's)."""
        pipeline = load_pipeline(directory, **fields)
        if not isinstance(pipeline, cls):
            raise PipelineFormatError(f"{directory} holds a {type(pipeline).__name__}, not a "
                                      f"{cls.__name__}; load it with load_pipeline.")
        return pipeline


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


def load_pipeline(directory: str | os.PathLike[str], **fields: Any) -> Any:
    """The pipeline a save wrote: Pretrained.load, then its task's pipeline.

    fields override the saved objective's (a tokenizer, say, when the saved
    one could not be written).
    """
    from dew.pretrained import Pretrained

    return Pretrained.load(directory).pipeline(**fields)
