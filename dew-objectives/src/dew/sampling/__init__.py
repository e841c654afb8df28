"""Generation from trained models: the paged-cache engine, token choice, unmasking samplers."""

from dew.sampling.engine import Engine
from dew.sampling.errors import (
    EngineConfigError,
    InvalidPromptError,
    InvalidVariablesError,
    NotPagedModelError,
    PromptTooLongError,
    UnknownSequenceError,
)
from dew.sampling.generate import Generation, generate
from dew.sampling.masked import block_generate, masked_generate
from dew.sampling.options import InvalidSamplingError, Sampling, choose, filter_logits
from dew.sampling.pipeline import TextGeneration
from dew.sampling.requests import (
    Completion,
    EngineConfig,
    EngineSnapshot,
    EngineStats,
    Request,
    SequenceState,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineSnapshot",
    "EngineStats",
    "Generation",
    "InvalidPromptError",
    "InvalidSamplingError",
    "InvalidVariablesError",
    "NotPagedModelError",
    "PromptTooLongError",
    "Request",
    "Sampling",
    "SequenceState",
    "TextGeneration",
    "UnknownSequenceError",
    "block_generate",
    "choose",
    "filter_logits",
    "generate",
    "masked_generate",
]
