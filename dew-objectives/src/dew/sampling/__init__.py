"""Generation from trained models: choose tokens, decode with a key/value cache."""

from dew.sampling.generate import (
    Generation,
    InvalidPromptError,
    PromptTooLongError,
    generate,
    sample_on_device,
)
from dew.sampling.options import InvalidSamplingError, Sampling, choose
from dew.sampling.pipeline import TextGeneration

__all__ = [
    "Generation",
    "InvalidPromptError",
    "InvalidSamplingError",
    "PromptTooLongError",
    "Sampling",
    "TextGeneration",
    "choose",
    "generate",
    "sample_on_device",
]
