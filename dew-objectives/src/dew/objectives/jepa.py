"""JEPA: predict the embeddings of hidden image (or video) regions from the visible rest.

Three networks: a context encoder (the model, trained), a predictor
(trained) and a target encoder that is the exponential moving average of the
context encoder. The target encoder is the trainer's EMA of
``params/encoder`` (``Objective.ema``), its momentum rising from 0.996 to 1.0
along a half cosine (``cosine_decay``); the loss reads it through
``Step.ema``, so it is never differentiated and costs no optimizer state.

Each step draws ``blocks`` rectangles of ``block`` patches per example
(I-JEPA's multi-block mask); for a video every rectangle runs through all
frames (V-JEPA's tube mask). The context encoder sees the patches outside
every rectangle; for each rectangle the predictor, given the context's
embeddings and mask tokens at the rectangle's places, predicts the target
encoder's layer-normalized embeddings there. The loss is the mean squared
error in that latent space, per predicted patch.

Two metrics warn of collapse (every image mapped to one embedding): the
standard deviation of the target encoder's normalized, pooled embeddings
across the batch (near 0 when collapsed; 1/sqrt(width) for spread-out ones)
and their effective rank (exp of the entropy of the normalized singular
values; near 1 when collapsed).

What a run leaves for others is the target encoder as a feature extractor:
``objective.pipeline(state)`` maps images (or videos) to one mean-pooled
embedding each, for a linear probe or retrieval; its ``save`` writes the
encoder's parameters through ``Pretrained.save`` in dew's own layout, which
``Pretrained.load(directory).pipeline()`` (or
``dew.objectives.diffusion_pipeline.load_pipeline``) reads back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from dew.errors import DewError
from dew.nn.kinds import PatchEncoder
from dew.nn.vit import Predictor, ViTEncoder
from dew.objectives.base import (
    Aux,
    Batch,
    EMASpec,
    Mean,
    Objective,
    Step,
    Variables,
    cosine_decay,
    under,
)
from dew.objectives.diffusion_pipeline import _Saved
from dew.objectives.inference import UnsupportedRequestError, variables_of
from dew.objectives.lm import BatchShapeError, MissingBatchKeyError
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.training.state import TrainState

__all__ = ["FeatureExtraction", "JepaObjective", "MaskCoversImageError", "block_masks", "collapse_metrics"]


class MaskCoversImageError(DewError, ValueError):
    """The masking could hide every patch, leaving the context encoder nothing to see."""


def block_masks(key: jax.Array, grid: tuple[int, int, int], blocks: int, block: tuple[int, int]) -> jax.Array:
    """[blocks, N] bool: rectangles of block (rows, columns) patches at random places, through all frames.

    >>> import jax
    >>> masks = block_masks(jax.random.key(0), (1, 4, 4), 2, (2, 3))
    >>> masks.shape, [int(m.sum()) for m in masks]
    ((2, 16), [6, 6])
    """
    frames, rows, columns = grid
    top_key, left_key = jax.random.split(key)
    tops = jax.random.randint(top_key, (blocks, 1, 1), 0, rows - block[0] + 1)
    lefts = jax.random.randint(left_key, (blocks, 1, 1), 0, columns - block[1] + 1)
    r = jnp.arange(rows)[None, :, None]
    c = jnp.arange(columns)[None, None, :]
    inside = (r >= tops) & (r < tops + block[0]) & (c >= lefts) & (c < lefts + block[1])  # [blocks, rows, cols]
    return jnp.broadcast_to(inside[:, None], (blocks, frames, rows, columns)).reshape(blocks, -1)


def collapse_metrics(embeddings: jax.Array) -> dict[str, jax.Array]:
    """embedding_std and effective_rank of pooled embeddings [B, E] (see the module docstring)."""
    x = embeddings.astype(jnp.float32)
    normed = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-6)
    std = jnp.mean(jnp.std(normed, axis=0))
    singular = jnp.linalg.svd(x - x.mean(axis=0, keepdims=True), compute_uv=False)
    p = singular / jnp.maximum(jnp.sum(singular), 1e-12)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.maximum(p, 1e-12)), 0.0))
    return {"embedding_std": std, "effective_rank": jnp.exp(entropy)}


def _layer_norm(x: jax.Array) -> jax.Array:
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(x.var(axis=-1, keepdims=True) + 1e-6)


@dataclass(frozen=True)
class JepaObjective(Objective):
    """I-JEPA / V-JEPA around a ViTEncoder: latent prediction of masked blocks from the context.

    model is the context encoder (its EMA is the target encoder). The batch
    holds pixels under input_key: [B, H, W, C] images or [B, F, H, W, C]
    videos. momentum (start, end) and momentum_steps set the EMA's schedule.
    pixel_mean and pixel_std standardize the pixels (after uint8 is scaled
    to [0, 1]) before every encoder sees them, in training and in the
    feature extractor alike (a blank patch of a digit is then no longer
    all zeros); on digits they are part of the setting in which JEPA's
    features measurably beat a random encoder's under a linear probe.
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model"})
    trains: ClassVar[type[Any] | None] = PatchEncoder
    heads: ClassVar[tuple[str, ...]] = ("predictor",)
    tokenizer = None  # pixels in, embeddings out: its pipeline saves no tokenizer (not a field)

    model: ViTEncoder
    _: KW_ONLY
    input_key: str = "image"
    blocks: int = 4
    block: tuple[int, int] = (2, 2)
    predictor_features: int = 32
    predictor_layers: int = 2
    predictor_heads: int = 2
    momentum: tuple[float, float] = (0.996, 1.0)
    momentum_steps: int = 1000
    pixel_mean: float = 0.0
    pixel_std: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", tuple(self.block))
        object.__setattr__(self, "momentum", tuple(self.momentum))
        _, rows, columns = self.model.grid
        limit = rows * columns
        if not self.pixel_std > 0:
            raise ValueError(f"JepaObjective divides pixels by pixel_std, which must be positive; got "
                             f"{self.pixel_std}.")
        if not all(0.0 <= m <= 1.0 for m in self.momentum) or len(self.momentum) != 2 or self.momentum_steps < 1:
            raise ValueError(f"JepaObjective.momentum={list(self.momentum)} is the target encoder's EMA decay from "
                             "start to end, each in [0, 1], over momentum_steps >= 1 updates (got "
                             f"{self.momentum_steps}).")
        if min(self.predictor_features, self.predictor_layers, self.predictor_heads) < 1 \
                or self.predictor_features % self.predictor_heads:
            raise ValueError(f"JepaObjective's predictor needs predictor_features, predictor_layers and predictor_heads "
                             f"of at least 1, the heads dividing the features; got {self.predictor_features}, "
                             f"{self.predictor_layers} and {self.predictor_heads}.")
        if self.blocks < 1 or min(self.block) < 1:
            raise ValueError(f"JepaObjective needs at least one block of at least 1x1 patches, got "
                             f"blocks={self.blocks}, block={self.block}.")
        if self.block[0] > rows or self.block[1] > columns or self.blocks * self.block[0] * self.block[1] >= limit:
            raise MaskCoversImageError(
                f"{self.blocks} blocks of {self.block[0]}x{self.block[1]} patches can hide all {limit} patches of a "
                f"{rows}x{columns} patch grid, leaving the context encoder nothing to see; blocks x block area must "
                f"stay below {limit}. Use fewer or smaller blocks, or a smaller patch."
            )
        object.__setattr__(self, "ema", EMASpec(decay=cosine_decay(*self.momentum, self.momentum_steps),
                                                select=under("params/encoder")))

    @property
    def predictor(self) -> Predictor:
        return Predictor(self.model.grid, self.predictor_features, self.model.emb_features,
                         self.predictor_layers, self.predictor_heads, 2 * self.predictor_features)

    def _example(self) -> jax.Array:
        frames = () if self.model.frames == 1 and self.input_key == "image" else (self.model.frames,)
        side = self.model.image_size
        return jnp.zeros((1, *frames, side, side, self.model.channels), jnp.float32)

    # -- the Objective protocol ----------------------------------------------------------------
    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """The context encoder and the predictor (given variables pass through)."""
        if variables is not None:
            return variables
        encoder_key, predictor_key = jax.random.split(key)
        encoder = self.model.init(encoder_key, self._example())["params"]
        n, width = self.model.num_patches, self.model.emb_features
        predictor = self.predictor.init(predictor_key, jnp.zeros((1, n, width)), jnp.ones((1, n), bool),
                                        jnp.zeros((1, n), bool))["params"]
        return {"params": {"encoder": encoder, "predictor": predictor}}

    def required_keys(self) -> Sequence[str]:
        return (self.input_key,)

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        """Mean squared latent error over every predicted patch, and the collapse metrics."""
        pixels = self._pixels(batch)
        params = variables["params"]
        target_params = (step.ema if step.ema is not None else variables)["params"]["encoder"]
        targets = _layer_norm(jax.lax.stop_gradient(self.model.apply({"params": target_params}, pixels)))
        keys = jax.random.split(step.key, pixels.shape[0])
        masks = jax.vmap(lambda k: block_masks(k, self.model.grid, self.blocks, self.block))(keys)  # [B, blocks, N]
        visible = ~jnp.any(masks, axis=1)
        context = self.model.apply({"params": params["encoder"]}, pixels, visible)
        total = Mean(jnp.asarray(0.0), jnp.asarray(0.0))
        for j in range(self.blocks):
            predicted = self.predictor.apply({"params": params["predictor"]}, context, visible, masks[:, j])
            error = jnp.mean((predicted - targets) ** 2, axis=-1)
            total = total + Mean.of(error, masks[:, j])
        metrics: dict[str, Mean | jax.Array] = dict(collapse_metrics(jnp.mean(targets, axis=1)))
        metrics["visible_fraction"] = jnp.mean(visible.astype(jnp.float32))
        return total, Aux(metrics=metrics)

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        loss, aux = self.loss(variables, batch, step)
        return {"loss": loss, **{k: v if isinstance(v, Mean) else Mean(v, jnp.asarray(1.0)) for k, v in aux.metrics.items()}}

    # -- a feature extractor -------------------------------------------------------------------
    def features(self, variables: Variables, pixels: jax.Array) -> jax.Array:
        """Mean-pooled embeddings [B, E] of the encoder in variables (pass ``state.averaged`` for the target's).

        Integer pixels are read as 0-255 and scaled to [0, 1], then standardized, as in training.
        """
        return jnp.mean(self.model.apply({"params": variables["params"]["encoder"]}, self._standardized(pixels)),
                        axis=1)

    def _standardized(self, pixels: ArrayLike) -> jax.Array:
        """Pixels as the encoders see them: uint8 scaled to [0, 1], then (x - pixel_mean) / pixel_std."""
        pixels = jnp.asarray(pixels)
        if jnp.issubdtype(pixels.dtype, jnp.integer):  # uint8 pixels (the digits reader's) to [0, 1]
            pixels = jnp.asarray(pixels, jnp.float32) / 255.0
        return (jnp.asarray(pixels, jnp.float32) - self.pixel_mean) / self.pixel_std

    def pipeline(self, state: TrainState | Variables, *, ema: bool = True) -> FeatureExtraction:
        """A feature extractor over state's target encoder (its EMA; the context encoder when ema=False).

        state is a TrainState or a variables tree holding ``params/encoder``;
        the predictor is left behind (inference never needs it).
        """
        variables = variables_of(state, ema)
        encoder = variables["params"]["encoder"] if "params" in variables else None
        if encoder is None:
            raise ValueError(f"JepaObjective.pipeline needs variables with params/encoder; got collections "
                             f"{sorted(variables)}.")
        return FeatureExtraction(self, {"params": {"encoder": encoder}})

    def _pixels(self, batch: Batch) -> jax.Array:
        if self.input_key not in batch:
            raise MissingBatchKeyError(
                f"JepaObjective reads pixels under {self.input_key!r}, but the batch has keys {sorted(batch)}."
            )
        pixels = batch[self.input_key]
        side = self.model.image_size
        expected = (side, side, self.model.channels)
        if tuple(pixels.shape[-3:]) != expected or pixels.ndim not in (4, 5):
            raise BatchShapeError(
                f"Batch key {self.input_key!r} has shape {tuple(pixels.shape)}; the encoder expects "
                f"[batch, {', '.join(map(str, expected))}] images or [batch, frames, ...] videos."
            )
        return self._standardized(pixels)



@dataclass(frozen=True, repr=False)  # _Saved's repr
class FeatureExtraction(_Saved):
    """Images (or videos) to the JEPA encoder's mean-pooled embeddings, [N, emb_features] numpy.

    Pixels come as the training batches held them: floats, or uint8 scaled to
    [0, 1]; the objective's pixel_mean and pixel_std standardize them as in
    training. ``batch`` rows go through the encoder at a time.
    """

    @property
    def accepts(self) -> str:  # type: ignore[override]
        model = self.objective.model
        side, channels = model.image_size, model.channels
        return f"images [N, {side}, {side}, {channels}] (uint8 or floats) to embed"

    def usage(self, run: object) -> str:
        return f"dew embed {run} INPUTS OUT.npy"

    def instead_of(self, command: str) -> str:
        return "it turns images into vectors: use `dew embed RUN INPUTS OUT.npy`."

    def embed(self, inputs: ArrayLike) -> np.ndarray:
        """One embedding per image, [N, emb_features]; inputs of another shape are refused in one line."""
        pixels = np.asarray(inputs)
        model = self.objective.model
        expected = (model.image_size, model.image_size, model.channels)
        if pixels.ndim not in (4, 5) or tuple(pixels.shape[-3:]) != expected:
            raise UnsupportedRequestError(f"Inputs of shape {pixels.shape} cannot be embedded: "
                                          f"{self.name} takes {self.accepts}.")
        return self(pixels)

    def __call__(self, pixels: ArrayLike, *, batch: int = 256) -> np.ndarray:
        """Embeddings of pixels [N, H, W, C] (or [N, F, H, W, C]), in order."""
        pixels = np.asarray(pixels)
        extract = self._extract
        parts = [np.asarray(extract(self.variables, jnp.asarray(pixels[i:i + batch])))
                 for i in range(0, len(pixels), batch)]
        return np.concatenate(parts) if parts else np.zeros((0, self.objective.model.emb_features), np.float32)


    @functools.cached_property
    def _extract(self) -> Callable[[Variables, jax.Array], jax.Array]:
        """The objective's feature function, compiled once per pipeline."""
        return jax.jit(self.objective.features)
