"""The root of every error dew raises, and the errors more than one part of dew raises.

``except dew.DewError`` catches any error of dew's, whichever distribution
raised it. Each error class keeps the builtin base that says what kind of
mistake it is as well (a ``ValueError``, a ``KeyError``, ...), so code that
catches those keeps working. This module imports nothing, so the lowest
layer can name it.

>>> issubclass(BatchKeyError, DewError) and issubclass(BatchKeyError, KeyError)
True
>>> str(BatchKeyError("The batch has no key 'text'."))
"The batch has no key 'text'."
"""

from __future__ import annotations

__all__ = ["BatchKeyError", "DewError"]


class DewError(Exception):
    """The root of every error dew raises (see the module)."""


class BatchKeyError(DewError, KeyError, ValueError):
    """A batch lacks a key that what reads it needs, or holds it in a shape or dtype it cannot use.

    One class whoever finds it: the trainer's feed (a key missing, added or
    reshaped mid-run), an objective (the key its loss reads), a conditioning
    (the key its condition is read from). It is a ``KeyError`` for a missing
    key and a ``ValueError`` for a misshapen one, so either ``except`` works.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()
