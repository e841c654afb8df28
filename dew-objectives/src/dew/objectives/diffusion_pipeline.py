"""Pipelines: sample from a trained diffusion, masked- or block-diffusion model, save and load it.

``objective.pipeline(state)`` returns a pipeline holding the objective and
the trained variables (the EMA copy when kept). A ``DiffusionPipeline`` turns
class labels, text prompts or nothing into uint8 images or videos; a
``TextDiffusionPipeline`` writes token sequences and decodes them. Both are
``dew.objectives.inference.Pipeline``s: ``generate(request)`` serves
``dew generate``, writing images as a PNG grid (and one PNG each) and videos
as animated GIFs.

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import jax
import jax.numpy as jnp
import numpy as np

from dew.errors import DewError
from dew.objectives.inference import (
    Generated,
    GenerateRequest,
    Pipeline,
    UnsupportedRequestError,
    write_texts,
    writing_samples,
)
from dew.telemetry.render import write_file
from dew.tree_summary import brief_repr

if TYPE_CHECKING:
    from dew.data.base import Tokenizer
    from dew.inputs import Conditioning
    from dew.pretrained.model import Pretrained as PretrainedModel

__all__ = [
    "DiffusionPipeline",
    "PipelineFormatError",
    "PixelPipeline",
    "TextDiffusionPipeline",
    "draw_in_chunks",
    "load_pipeline",
    "write_samples",
]


class PipelineFormatError(DewError, ValueError):
    """A directory whose saved task is not the pipeline it is loaded as."""


@dataclasses.dataclass(frozen=True)
class _Saved(Pipeline):
    objective: Any
    variables: Mapping[str, Any]

    __repr__ = brief_repr  # the variables as one line; subclasses keep it (repr=False)

    def pretrained(self) -> PretrainedModel:
        """The model, variables, tokenizer and task (the objective) as a Pretrained."""
        from dew.pretrained.native import objective_pretrained

        return objective_pretrained(self.objective, self.variables)

    @classmethod
    def load(cls, directory: str | os.PathLike[str], **fields: object) -> Self:
        """The pipeline save wrote in directory (fields override the saved objective's)."""
        pipeline = load_pipeline(directory, **fields)
        if not isinstance(pipeline, cls):
            raise PipelineFormatError(f"{directory} holds a {type(pipeline).__name__}, not a "
                                      f"{cls.__name__}; load it with load_pipeline.")
        return pipeline


def _tile(pixels: np.ndarray, columns: int) -> np.ndarray:
    from dew.objectives.diffusion import _tile

    return _tile(pixels, columns)


def write_samples(pixels: np.ndarray, directory: str | os.PathLike[str], *, video: bool,
                  columns: int) -> tuple[Path, ...]:
    """uint8 samples [N, H, W, C] (or videos [N, T, H, W, C]) as files in directory.

    Images: ``samples.png``, a grid of columns per row, and ``sample_000.png``
    onwards; videos: ``samples.gif``, the grid animated, and one GIF each.
    A folder written into before ends with these samples alone: an earlier
    request's sample files past them are removed, so old and new do not read
    as one request. Returns the paths, the grid first.
    """
    from dew.telemetry.render import gif_bytes, png_bytes

    target = Path(directory)
    suffix, encode = (".gif", gif_bytes) if video else (".png", png_bytes)
    grid = target / f"samples{suffix}"
    with writing_samples(target):
        target.mkdir(parents=True, exist_ok=True)
        write_file(grid, encode(_tile(pixels, max(1, min(columns, len(pixels))))))
        files = [grid]
        for index, sample in enumerate(pixels):
            path = target / f"sample_{index:03d}{suffix}"
            write_file(path, encode(sample))
            files.append(path)
        for stale in target.glob(f"sample_[0-9][0-9][0-9]*{suffix}"):
            if stale not in files and stale.stem.removeprefix("sample_").isdigit():
                stale.unlink()
    return tuple(files)


CHUNK_ROWS = 64
"""Samples drawn by one call of a pixel sampler: a thousand images are drawn 64 at a time, so the
sampler's memory is one chunk's whatever the count asked for."""


def draw_in_chunks(draw: Callable[[Any, jax.Array, jax.Array | None, int], jax.Array], variables: Any,
                   key: jax.Array, condition: jax.Array | None, rows: int) -> np.ndarray:
    """uint8 pixels [rows, ...] drawn CHUNK_ROWS at a time by draw(variables, key, conditions or None,
    rows), which returns samples in [-1, 1] (jitted with rows static: one program for the chunks, one
    for the rest). The first chunk draws with key itself, the next ones with key folded by their
    index, so a count within one chunk draws what one call would."""
    from dew.objectives.diffusion import to_pixels

    chunks = []
    for index, start in enumerate(range(0, rows, CHUNK_ROWS)):
        size = min(CHUNK_ROWS, rows - start)
        part = None if condition is None else condition[start:start + size]
        chunks.append(to_pixels(draw(variables, key if index == 0 else jax.random.fold_in(key, index), part, size)))
    return np.concatenate(chunks)


class PixelPipeline(_Saved):
    """What the image and video pipelines share: reading labels or prompts, writing files.

    A subclass gives ``conditioning`` (what its model reads, ``dew.inputs``),
    ``video`` and ``sample``.
    """

    @property
    def conditioning(self) -> Conditioning:
        raise NotImplementedError

    @property
    def video(self) -> bool:
        raise NotImplementedError

    def sample(self, conditions: Sequence[int | str] | None, rows: int, key: jax.Array,
               steps: int | None, guidance: float | None) -> np.ndarray:
        """uint8 samples [rows, ...] for conditions (one each) or unconditioned."""
        raise NotImplementedError

    @property
    def accepts(self) -> str:  # type: ignore[override]
        from dew.inputs import ClassLabels, TextTokens

        kind = "clips" if self.video else "images"
        conditioning = self.conditioning
        if isinstance(conditioning, ClassLabels):
            return (f"class labels 0 to {conditioning.num_classes - 1}, or none for unconditional "
                    f"{kind}")
        if isinstance(conditioning, TextTokens):
            return f"text prompts, or none for unconditional {kind}"
        return f"no inputs: its model draws unconditional {kind}"

    @property
    def options(self) -> frozenset[str]:  # type: ignore[override]
        from dew.inputs import Unconditional

        if isinstance(self.conditioning, Unconditional):
            return frozenset({"count", "steps"})
        return frozenset({"count", "steps", "guidance"})

    def usage(self, run: object) -> str:
        from dew.inputs import ClassLabels, TextTokens

        if isinstance(self.conditioning, ClassLabels):
            return f"dew generate {run} LABEL... --count N --out DIR"
        if isinstance(self.conditioning, TextTokens):
            return f"dew generate {run} PROMPT... --count N --out DIR"
        return f"dew generate {run} --count N --out DIR"

    def conditions_of(self, inputs: Sequence[str]) -> list[Any]:
        """What the model reads for each input: a label in range, or a prompt; refused in one line."""
        from dew.inputs import ClassLabels, TextTokens

        conditioning = self.conditioning
        if not inputs:
            return []
        if isinstance(conditioning, ClassLabels):
            labels = []
            for given in inputs:
                try:
                    label = int(given)
                except ValueError:
                    raise UnsupportedRequestError(
                        f"{given!r} is not a class label: {self.describe()}.") from None
                if not 0 <= label < conditioning.num_classes:
                    raise UnsupportedRequestError(
                        f"Label {label} is out of range: {self.describe()}.")
                labels.append(label)
            return labels
        if isinstance(conditioning, TextTokens):
            return list(inputs)
        raise UnsupportedRequestError(f"{', '.join(map(repr, inputs[:3]))} cannot condition this "
                                      f"model: {self.describe()}.")

    def generate(self, request: GenerateRequest) -> Generated:
        """count samples per input (8 unconditioned when none is given), written under request.out."""
        self.check(request)
        conditions = self.conditions_of(request.inputs)
        if request.guidance is not None and not conditions:
            raise UnsupportedRequestError(
                "--guidance weighs a condition against none, and unconditional samples have no "
                f"condition to weigh: give inputs with it, or leave it out. {self.describe()}.")
        count = request.count or (1 if conditions else 8)
        asked = [c for c in conditions for _ in range(count)]
        rows = len(asked) or count
        try:
            pixels = self.sample(asked or None, rows, jax.random.key(request.seed), request.steps,
                                 request.guidance)
        except ValueError as error:  # a guidance scale the model cannot use, say
            raise UnsupportedRequestError(f"{error} {self.describe()}.") from None
        files = write_samples(pixels, request.out or Path("samples"), video=self.video,
                              columns=count if conditions else 8)  # a row per label, a label's samples across
        return Generated(files=files, samples=rows)


@dataclasses.dataclass(frozen=True, repr=False)  # _Saved's repr
class DiffusionPipeline(PixelPipeline):
    """Images or videos from a DiffusionObjective's model and its trained variables."""

    @property
    def conditioning(self) -> Conditioning:
        return self.objective.conditioning

    @property
    def video(self) -> bool:
        return self.objective.key == "video"

    def __call__(self, conditions: Sequence[int | str] | None = None, *, rows: int | None = None,
                 key: jax.Array | None = None, steps: int | None = None,
                 guidance: float | None = None, method: str | None = None) -> np.ndarray:
        """uint8 samples [N, ...]: one per condition (a class label or a prompt), or rows unconditional
        (drawn CHUNK_ROWS at a time)."""
        objective = self.objective
        condition = None if conditions is None else objective.conditioning.of(list(conditions))
        count = rows if condition is None else int(condition.shape[0])
        if count is None:
            raise ValueError("Give conditions (labels or prompts) or rows for unconditional samples.")
        scale = objective.guidance if guidance is None else guidance
        objective.check_guidance(scale)
        sample = jax.jit(lambda v, k, c, n: objective.sample(v, k, c, n, guidance=scale, steps=steps,
                                                             method=method), static_argnums=3)
        return draw_in_chunks(sample, self.variables, key if key is not None else jax.random.key(0),
                              condition, count)

    def sample(self, conditions: Sequence[int | str] | None, rows: int, key: jax.Array,
               steps: int | None, guidance: float | None) -> np.ndarray:
        return self(conditions, rows=rows, key=key, steps=steps, guidance=guidance)


@dataclasses.dataclass(frozen=True, repr=False)  # _Saved's repr
class TextDiffusionPipeline(_Saved):
    """Token sequences from a masked- or block-diffusion objective's model.

    A prompt, when given, is kept as the start of each sequence and the
    model fills in the rest (block diffusion needs it to fill whole blocks).
    """

    accepts: ClassVar[str] = "text prompts to start from, or none"
    options: ClassVar[frozenset[str]] = frozenset({"count", "steps"})

    def usage(self, run: object) -> str:
        return f"dew generate {run} [PROMPT] --count N"

    def __call__(self, rows: int = 1, *, key: jax.Array | None = None,
                 steps: int | None = None, prompt: str | None = None) -> list[str] | jax.Array:
        """rows samples, decoded to text when the objective has a tokenizer (else ids)."""
        objective = self.objective
        prefix = None if prompt is None else objective.prefix_of(prompt, rows)
        write = jax.jit(lambda v, k: objective.generate(v, k, rows, steps=steps, prefix=prefix))
        tokens = write(self.variables, key if key is not None else jax.random.key(0))
        tokenizer = objective.tokenizer
        if tokenizer is None:
            return tokens
        return [tokenizer.decode([int(i) for i in row]) for row in tokens]

    def generate(self, request: GenerateRequest) -> Generated:
        """count sequences per prompt (or count from nothing), decoded."""
        self.check(request)
        if self.objective.tokenizer is None:
            raise UnsupportedRequestError(f"{self.name} has no tokenizer to write text with; build "
                                          "the objective with tokenizer=.")
        count = request.count or 1
        key = jax.random.key(request.seed)
        texts: list[str] = []
        try:
            for index, prompt in enumerate(request.inputs or (None,)):
                texts += self(count, key=jax.random.fold_in(key, index), steps=request.steps,
                              prompt=prompt)
        except ValueError as error:
            raise UnsupportedRequestError(f"{error} {self.describe()}.") from None
        return Generated(texts=tuple(texts), files=write_texts(tuple(texts), request.out),
                         samples=len(texts))


def load_pipeline(directory: str | os.PathLike[str], **fields: object) -> Pipeline:
    """The pipeline a save wrote: Pretrained.load, then its task's pipeline.

    fields override the saved objective's (a tokenizer, say, when the saved
    one could not be written).
    """
    from dew.pretrained import Pretrained

    return Pretrained.load(directory).pipeline(**fields)


def prefix_ids(tokenizer: Tokenizer, prompt: str, rows: int, length: int, multiple: int = 1) -> jax.Array:
    """prompt's ids repeated for rows, refused unless shorter than length and a multiple of multiple."""
    ids = list(tokenizer.encode(prompt))
    if not ids or len(ids) >= length:
        raise ValueError(f"The prompt {prompt!r} is {len(ids)} tokens; it must hold at least one "
                         f"and fewer than the {length} the model writes.")
    if len(ids) % multiple:
        raise ValueError(f"The prompt {prompt!r} is {len(ids)} tokens; block diffusion writes whole "
                         f"blocks of {multiple}, so a prompt must be a multiple of {multiple} tokens.")
    return jnp.asarray([ids] * rows, jnp.int32)
