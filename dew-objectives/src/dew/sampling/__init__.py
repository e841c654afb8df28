"""Generation from trained models: choose tokens, decode with a key/value cache."""

from dew.sampling.generate import Generation, InvalidPromptError, PromptTooLongError, generate
from dew.sampling.options import InvalidSamplingError, Sampling, choose

__all__ = [
    "Generation",
    "InvalidPromptError",
    "InvalidSamplingError",
    "PromptTooLongError",
    "Sampling",
    "choose",
    "generate",
]
