"""Image and video diffusion: learn to denoise uint8 pixels noised by a schedule.

A batch holds uint8 images [B, H, W, C] under "image" (or videos
[B, T, H, W, C] under "video"), scaled to [-1, 1]; a conditional model also
reads class labels or token ids (see :mod:`dew.inputs`). Training drops the
condition with probability ``condition_dropout`` so that sampling can use
classifier-free guidance. The model is any module called as
``model(x, level, condition)`` (``dew.nn.dit.DiT``, ``VideoDiT``, ``UNet``).

Validation reports the loss and the loss per noise-level bucket: bucket k
of n holds the k-th n-quantile of the noise levels training draws, so a
model's weak band shows. Previews are sample grids (images) or animated
GIFs (videos). An EMA of the parameters is kept by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.diffusion import (
    Diffusion,
    Method,
    RectifiedFlow,
    drop_condition,
    guide,
    noise_schedule,
)
from dew.errors import BatchKeyError, DewError
from dew.inputs import ClassLabels, Conditioning, Unconditional, conditioning_of
from dew.nn.kinds import PixelDenoiser, VideoModel
from dew.objectives.base import (
    Aux,
    Batch,
    EMASpec,
    LeafFilter,
    Mean,
    MeanMetric,
    Metric,
    Objective,
    Step,
    Variables,
    under,
)
from dew.telemetry.artifacts import Artifact
from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.objectives import diffusion_pipeline
    from dew.training.state import TrainState

__all__ = [
    "DiffusionObjective",
    "ModelFrameCountError",
    "GuidanceError",
    "InvalidPixelsError",
    "MissingPixelsError",
    "check_guidance",
    "to_pixels",
]


# Images or videos that are not uint8 pixels of the shape the model was built for: dew's one
# batch-key error.
InvalidPixelsError = BatchKeyError


class ModelFrameCountError(BatchKeyError):
    """A video with another number of frames than the model was built for."""


# The batch lacks the key the pixels are read from: dew's one batch-key error.
MissingPixelsError = BatchKeyError


class GuidanceError(DewError, ValueError):
    """A guidance scale was asked of a model that has no condition to guide by."""


def check_guidance(scale: float, conditioning: Conditioning, model: nn.Module) -> None:
    """GuidanceError for a scale that is no number, or any scale but 1 for an unconditional model."""
    if not math.isfinite(scale):
        raise GuidanceError(f"guidance={scale} is no scale: give a finite number (1.0 samples the "
                            "conditional model as it is; above 1 follows the condition harder).")
    if isinstance(conditioning, Unconditional) and scale != 1.0:
        raise GuidanceError(
            f"guidance={scale} was asked of an unconditional model ({type(model).__name__} "
            "with num_classes=0 and text_vocab_size=0); guidance needs a conditional model "
            "trained with condition_dropout > 0. Use guidance=1.0.")


def to_pixels(x: jax.Array) -> np.ndarray:
    """Samples in [-1, 1] as uint8 pixels in [0, 255]."""
    return np.asarray(jnp.clip(jnp.round((x + 1.0) * 127.5), 0, 255)).astype(np.uint8)


def _tile(pixels: np.ndarray, columns: int) -> np.ndarray:
    """[N, ..., H, W, C] -> one grid [..., rows H, columns W, C] (padding with black)."""
    n = pixels.shape[0]
    rows = -(-n // columns)
    pad = rows * columns - n
    if pad:
        pixels = np.concatenate([pixels, np.zeros((pad, *pixels.shape[1:]), pixels.dtype)])
    *lead, h, w, c = pixels.shape[1:]
    grid = pixels.reshape(rows, columns, *lead, h, w, c)
    order = list(range(2, 2 + len(lead))) + [0, 2 + len(lead), 1, 3 + len(lead), 4 + len(lead)]
    return grid.transpose(order).reshape(*lead, rows * h, columns * w, c)


@dataclass(frozen=True)
class DiffusionObjective(Objective):
    """Denoising loss of a diffusion model over uint8 images or videos.

    schedule is a name (vp_linear, vp_cosine, edm, flow), a name with its
    settings (``{name: edm, sigma_max: 20}``) or a Schedule;
    target what the model predicts (eps, x0, v, velocity; velocity by default
    for flow, eps otherwise); weighting the loss weighting (uniform, min_snr,
    edm). guidance, sampler and sample_steps set how previews (and
    pipelines, by default) sample. freeze_text_encoder keeps the model's text
    encoder (``params/text``) fixed, as loaded by the trainer's initializer.
    """

    run_inputs: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    trains: ClassVar[type[Any] | None] = PixelDenoiser

    model: nn.Module
    _: KW_ONLY
    modality: Literal["image", "video"] | None = None
    schedule: str | Any = "vp_cosine"
    target: Literal["eps", "x0", "v", "velocity"] | None = None
    weighting: Literal["uniform", "min_snr", "edm"] = "uniform"
    data_std: float = 0.5
    condition_dropout: float = 0.1
    label_key: str = "label"
    text_key: str = "caption"
    tokenizer: Any = None
    guidance: float = 1.0
    sampler: Literal["ddpm", "ddim", "euler", "heun", "dpmpp_2m"] = "ddim"
    sample_steps: int = 32
    preview_count: int = 8
    noise_buckets: int = 4
    freeze_text_encoder: bool = False
    ema: EMASpec | None = field(default_factory=lambda: EMASpec(0.999))

    def __post_init__(self) -> None:
        resolved = noise_schedule(self.schedule)  # an unknown name or setting, refused before anything is built
        if isinstance(self.schedule, Mapping):  # held as the Schedule it names (a mapping does not hash)
            object.__setattr__(self, "schedule", resolved)
        if not 0.0 <= self.condition_dropout <= 1.0:
            raise ValueError("DiffusionObjective.condition_dropout must lie in [0, 1], got "
                             f"{self.condition_dropout}.")
        if self.guidance != 1.0:
            self.check_guidance(self.guidance)
        if self.noise_buckets < 1 or self.sample_steps < 1 or self.preview_count < 1:
            raise ValueError("noise_buckets, sample_steps and preview_count must each be at least 1.")
        clips = isinstance(self.model, VideoModel) and bool(self.model.frames)
        if self.modality is not None and (self.modality == "video") != clips:
            drawn = f"clips of {self.model.frames} frames" if clips else "images (it has no frames)"
            raise ValueError(f"DiffusionObjective.modality={self.modality!r}, but the model, "
                             f"{type(self.model).__name__}, draws {drawn}; leave modality out (it follows the "
                             "model) or give a model of that kind (video_dit for clips).")

    # -- what the objective is built from ----------------------------------------------
    @property
    def frozen(self) -> LeafFilter | None:  # type: ignore[override]  # derived from a field here
        """The text encoder's parameters when freeze_text_encoder (a pretrained start keeps them)."""
        return under("params/text") if self.freeze_text_encoder else None

    @property
    def key(self) -> str:
        """The batch key of the pixels: 'video' for a model with frames, else 'image'."""
        if self.modality is not None:
            return self.modality
        return "video" if isinstance(self.model, VideoModel) and self.model.frames else "image"

    @property
    def process(self) -> Diffusion:
        schedule = noise_schedule(self.schedule)
        target = self.target or ("velocity" if isinstance(schedule, RectifiedFlow) else "eps")
        return Diffusion(schedule, target=target, weighting=self.weighting, data_std=self.data_std)

    @property
    def conditioning(self) -> Conditioning:
        return conditioning_of(self.model, label_key=self.label_key, text_key=self.text_key,
                               tokenizer=self.tokenizer)

    @property
    def shape(self) -> tuple[int, ...]:
        """One example's pixel shape, as the model was built for."""
        size, channels = int(self.model.image_size), int(self.model.channels)
        if self.key == "video":
            return (int(self.model.frames), size, size, channels)
        return (size, size, channels)

    def check_guidance(self, scale: float) -> None:
        check_guidance(scale, self.conditioning, self.model)
        if scale != 1.0 and self.condition_dropout == 0.0 and not isinstance(self.conditioning, Unconditional):
            raise GuidanceError(
                f"guidance={scale} extrapolates from the model's prediction without its condition, which "
                "this objective never trains (condition_dropout=0, so the null condition is never seen); "
                "train with condition_dropout above 0 (0.1 is usual), or use guidance=1.0 (a recipe's objective.guidance).")

    # -- the Objective protocol ---------------------------------------------------------
    def required_keys(self) -> Sequence[str]:
        key = self.conditioning.key
        return (self.key,) if key is None else (self.key, key)

    def check_batch(self, batch: Mapping[str, np.ndarray], step: int) -> None:
        """Refuse, on the host before the step, labels or token ids outside the model's range."""
        self.conditioning.check_batch(batch)

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        if variables is not None:
            return variables
        x = jnp.zeros((1, *self.shape), jnp.float32)
        return self.model.init(key, x, jnp.zeros((1,), jnp.float32), self.conditioning.null(1))

    def pixels(self, batch: Batch) -> jax.Array:
        """The batch's pixels checked and scaled to [-1, 1]."""
        if self.key not in batch:
            raise MissingPixelsError(
                f"DiffusionObjective reads {self.key}s under the batch key {self.key!r}, but the "
                f"batch has keys {sorted(batch)}.")
        value = batch[self.key]
        # A batch value is whatever the reader yields (an array, a tracer, a list): probed.
        shape, dtype = tuple(getattr(value, "shape", ())), getattr(value, "dtype", None)
        if dtype != jnp.uint8:
            raise InvalidPixelsError(
                f"Batch key {self.key!r} holds {dtype} pixels; expected uint8 in [0, 255] "
                "(as dew's readers deliver them); convert with np.uint8 after scaling to [0, 255].")
        if self.key == "video" and len(shape) == 5 and shape[1] != self.shape[0]:
            raise ModelFrameCountError(
                f"Batch key 'video' holds videos of {shape[1]} frames (shape {shape}), but the model "
                f"was built for frames={self.shape[0]}; cut the clips to {self.shape[0]} frames.")
        if shape[1:] != self.shape:
            raise InvalidPixelsError(
                f"Batch key {self.key!r} has shape {shape}; expected [batch, "
                f"{', '.join(map(str, self.shape))}] for {type(self.model).__name__}.")
        return jnp.asarray(value, jnp.float32) / 127.5 - 1.0

    def _apply(self, variables: Variables, x: jax.Array, t: jax.Array, condition: jax.Array | None) -> jax.Array:
        inputs, level = self.process.model_input(x, t)
        params = {k: v for k, v in variables.items() if k != "cache"}
        return self.model.apply(params, inputs, level, condition)

    def _losses(self, variables: Variables, batch: Batch, key: jax.Array, training: bool,
                t: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        x0 = self.pixels(batch)
        # A training step leaves the in-program label check out (the trainer ran check_batch on
        # the host): a host callback, even one that never fires, makes a CPU step synchronous.
        condition = self.conditioning.read(batch, traced_check=not training)
        noise_key, drop_key = jax.random.split(key)
        if condition is not None and training and self.condition_dropout > 0:
            nulls = self.conditioning.null(1)
            assert nulls is not None  # a model with a condition has a null one
            null = nulls[0]
            condition = drop_condition(drop_key, condition, null, self.condition_dropout)
        noisy = self.process.noisy(noise_key, x0, t)
        output = self._apply(variables, noisy.x, noisy.t, condition)
        return self.process.per_example_loss(output, x0, noisy), noisy.t

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        """The weighted denoising error, averaged over examples."""
        per_example, _ = self._losses(variables, batch, step.key, step.training)
        return Mean.of(per_example), Aux()

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        """The loss at stratified noise levels, overall and per noise bucket."""
        rows = batch[self.key].shape[0] if self.key in batch else 1
        u = (jnp.arange(rows, dtype=jnp.float32) + 0.5) / rows
        u = jax.random.permutation(jax.random.fold_in(step.key, 1), u)
        t = self.process.schedule.time_at(u)
        per_example, _ = self._losses(variables, batch, step.key, False, t)
        outputs: dict[str, PyTree] = {"loss": Mean.of(per_example)}
        bucket = jnp.minimum((u * self.noise_buckets).astype(jnp.int32), self.noise_buckets - 1)
        for k in range(self.noise_buckets):
            outputs[f"loss_noise_{k}"] = Mean.of(per_example, bucket == k)
        return outputs

    def metrics(self) -> tuple[Metric, ...]:
        return (MeanMetric("loss"),
                *(MeanMetric(f"loss_noise_{k}") for k in range(self.noise_buckets)))

    # -- sampling -----------------------------------------------------------------------
    def sample(self, variables: Variables, key: jax.Array, condition: jax.Array | None = None,
               rows: int | None = None, *, guidance: float | None = None,
               steps: int | None = None, method: Method | None = None) -> jax.Array:
        """Samples in [-1, 1] [rows, *shape] for condition (model input; None: the null one)."""
        scale = self.guidance if guidance is None else guidance
        self.check_guidance(scale)
        if rows is None:
            rows = 1 if condition is None else int(jnp.shape(condition)[0])
        null = self.conditioning.null(rows)
        condition = null if condition is None else condition

        def model(c):
            def call(inputs, level):
                params = {k: v for k, v in variables.items() if k != "cache"}
                return self.model.apply(params, inputs, level, c)
            return self.process.denoiser(call)

        denoise = model(condition)
        if scale != 1.0:
            denoise = guide(denoise, model(null), scale)
        method = method or self.sampler
        noise_key, sample_key = jax.random.split(key)
        noise = jax.random.normal(noise_key, (rows, *self.shape), jnp.float32)
        return self.process.sample(denoise, noise, steps=steps or self.sample_steps,
                                   method=method, key=sample_key)

    def preview_conditions(self, rows: int) -> jax.Array | None:
        """What previews ask for: every class in turn, or the null condition."""
        number = self.conditioning.num_classes if isinstance(self.conditioning, ClassLabels) else None
        if number:
            return jnp.arange(rows, dtype=jnp.int32) % number
        return None

    def preview(self, variables: Variables, key: jax.Array) -> Artifact:
        """A grid of samples (images) or an animated grid (videos), one class per cell."""
        rows = self.preview_count
        x = jax.jit(lambda v, k: self.sample(v, k, self.preview_conditions(rows), rows))(variables, key)
        pixels = to_pixels(x)
        columns = min(rows, 8)
        conditions = self.preview_conditions(rows)
        labels = () if conditions is None else tuple(f"class {int(c)}" for c in np.asarray(conditions))
        return Artifact("samples", "video" if self.key == "video" else "image", _tile(pixels, columns),
                        labels=labels, columns=columns if labels else None)

    def pipeline(self, state: TrainState | Variables, *, ema: bool = True) -> diffusion_pipeline.DiffusionPipeline:
        """A pipeline that samples with state's (EMA) parameters (or given variables)."""
        from dew.objectives.diffusion_pipeline import DiffusionPipeline
        from dew.objectives.inference import variables_of

        return DiffusionPipeline(self, variables_of(state, ema))
