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

__all__ = ["BatchKeyError", "DewError", "DewKeyError", "LossReturnError", "ObjectiveMethodError", "ObjectiveSignatureError", "RunFileWriteError",
           "out_of_space", "raised_from"]


class DewError(Exception):
    """The root of every error dew raises (see the module)."""


class DewKeyError(DewError, KeyError):
    """A dew error that is a ``KeyError``, printed as its message (a plain KeyError quotes it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class BatchKeyError(DewKeyError, ValueError):
    """A batch lacks a key that what reads it needs, or holds it in a shape or dtype it cannot use.

    One class whoever finds it: the trainer's feed (a key missing, added or
    reshaped mid-run), an objective (the key its loss reads), a conditioning
    (the key its condition is read from). It is a ``KeyError`` for a missing
    key and a ``ValueError`` for a misshapen one, so either ``except`` works.
    """


class LossReturnError(DewError, TypeError):
    """An objective's loss returned something other than its (Mean, Aux) pair."""


class ObjectiveMethodError(DewError, NotImplementedError):
    """An objective leaves out a method every objective implements (init, loss)."""


class ObjectiveSignatureError(DewError, TypeError):
    """An objective's init or loss cannot be called as the trainer calls it (init(key, variables),
    loss(variables, batch, step))."""


class RunFileWriteError(DewError, OSError):
    """A file of a run's folder (its run.json, a journal) could not be written: a full disk, a folder
    made read-only. The message names the file, the system's reason and what was kept."""

    def __init__(self, path: object, reason: BaseException, kept: str) -> None:
        super().__init__(
            f"{path} could not be written ({reason}); {kept}. Free space on its disk (or point "
            "trainer.checkpoint_dir at a folder this process can write) and start the run again: "
            "it goes on from its last checkpoint.")


def raised_from(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether error is a kind, or was raised from or while handling one (libraries wrap what they meet).

    >>> try:
    ...     try:
    ...         raise KeyboardInterrupt
    ...     except KeyboardInterrupt as stop:
    ...         raise ValueError("a read failed") from stop
    ... except ValueError as wrapped:
    ...     raised_from(wrapped, KeyboardInterrupt), raised_from(wrapped, OSError)
    (True, False)
    """
    return any(isinstance(link, kind) for link in _chain(error))


def out_of_space(error: BaseException) -> bool:
    """Whether error, or an error it was raised from, is a write that ran out of room: a full disk, a
    quota, a file past the size limit (ulimit -f). Its fix is space, not another folder's permissions."""
    import errno

    return any(isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
               for link in _chain(error))


def _chain(error: BaseException) -> list[BaseException]:
    """error, the error it was raised from or while handling, and so on, each once."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and all(seen is not link for link in chain):
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain
