"""Generation from trained models: choose tokens, decode with a key/value cache, unmask."""

from dew.sampling.generate import Generation, InvalidPromptError, PromptTooLongError, generate
from dew.sampling.masked import block_generate, masked_generate
from dew.sampling.options import InvalidSamplingError, Sampling, choose

__all__ = [
    "Generation",
    "InvalidPromptError",
    "InvalidSamplingError",
    "PromptTooLongError",
    "Sampling",
    "block_generate",
    "choose",
    "generate",
    "masked_generate",
]
