"""The kinds of model an objective trains, declared as protocols a model's fields satisfy.

An objective names the kind it trains (``Objective.trains``), so a recipe
that pairs it with a model of another kind is refused by name before
anything is traced, where the first trace would fail inside the model.
A plugin's model is of a kind when it has the fields and methods below.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["CausalDecoder", "PatchEncoder", "PixelDenoiser", "TokenModel", "VideoModel", "kind_phrase"]


@runtime_checkable
class TokenModel(Protocol):
    """a token model (token ids in, logits over its vocabulary out: causal_transformer, token_denoiser or a
    family such as llama or qwen3)"""

    vocab_size: int
    max_seq_len: int


@runtime_checkable
class CausalDecoder(TokenModel, Protocol):
    """a causal decoder (a token model that reads left to right with a key/value cache:
    causal_transformer or a family such as llama or qwen3)"""

    num_kv_heads: int | None


@runtime_checkable
class PixelDenoiser(Protocol):
    """a pixel denoiser (noisy images or clips and a noise level in, conditioned on a label or text:
    dit, video_dit or unet)"""

    image_size: int
    channels: int
    num_classes: int
    text_vocab_size: int

    def conditioning(self, level: Any, condition: Any) -> Any: ...


@runtime_checkable
class VideoModel(Protocol):
    """a model of clips (frames of images: video_dit, or vit_encoder with frames)"""

    frames: int


@runtime_checkable
class PatchEncoder(Protocol):
    """a patch encoder (images in, one embedding per patch of its grid out: vit_encoder)"""

    image_size: int
    channels: int
    emb_features: int
    grid: tuple[int, ...]


def kind_phrase(kind: type[Any]) -> str:
    """The kind's docstring as one phrase, for an error that names it."""
    return " ".join((kind.__doc__ or kind.__name__).split())
