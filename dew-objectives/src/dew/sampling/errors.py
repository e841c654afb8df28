"""What generation refuses, each error named for what is wrong."""

from __future__ import annotations

from dew.errors import DewError, DewKeyError

__all__ = ["EngineConfigError", "InvalidPromptError", "InvalidVariablesError", "NotPagedModelError",
           "PromptTooLongError", "UnknownSequenceError"]


class InvalidPromptError(DewError, ValueError):
    """The prompts are not a batch of non-empty token-id sequences."""


class PromptTooLongError(DewError, ValueError):
    """A prompt plus the tokens to generate would not fit in the cache (the model's max_seq_len)."""


class EngineConfigError(DewError, ValueError):
    """An EngineConfig setting is out of range, or cannot hold one sequence of the model."""


class NotPagedModelError(DewError, TypeError):
    """The model has no attention layer that decodes through a paged cache."""


class InvalidVariablesError(DewError, TypeError):
    """What was passed as the model's variables is not its full variables ({'params': ...})."""


class UnknownSequenceError(DewKeyError):
    """Engine.extend or release named a sequence the engine does not keep."""
