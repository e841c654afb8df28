"""Generation from trained models: choose tokens, decode with a key/value cache, unmask."""

from dew.sampling.generate import (
    Generation,
    InvalidPromptError,
    PromptTooLongError,
    generate,
    sample_on_device,
)
from dew.sampling.masked import block_generate, masked_generate
from dew.sampling.options import InvalidSamplingError, Sampling, choose
from dew.sampling.pipeline import TextGeneration

__all__ = [
    "Generation",
    "InvalidPromptError",
    "InvalidSamplingError",
    "PromptTooLongError",
    "Sampling",
    "TextGeneration",
    "block_generate",
    "choose",
    "generate",
    "masked_generate",
    "sample_on_device",
]
