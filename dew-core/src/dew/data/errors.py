"""Errors the data readers raise, each named for what went wrong.

Every message says what is wrong (the file, the sizes or the key) and how to
fix it. They all derive from DataError, and each also derives from the
built-in exception a caller would otherwise catch (FileNotFoundError,
ValueError, KeyError).
"""

from __future__ import annotations

from dew.errors import DewError, DewKeyError

__all__ = [
    "BatchDivisionError",
    "DataError",
    "EmptyDatasetError",
    "ForeignPositionError",
    "LoadingScriptError",
    "MalformedRecordError",
    "MissingFileError",
    "MissingKeyError",
    "PositionMismatchError",
    "RampError",
    "UnreadableFileError",
    "UnreadableTokenizerError",
]


class DataError(DewError):
    """Base class of dew-data's errors."""


class MissingFileError(DataError, FileNotFoundError):
    """A path or glob names no readable file."""


class EmptyDatasetError(DataError, ValueError):
    """The inputs hold no record (or too few for one window or batch)."""


class LoadingScriptError(DataError, ValueError):
    """A dataset would need its own Python loading script run; dew never runs code from data."""


class BatchDivisionError(DataError, ValueError):
    """A global batch does not split evenly among the data shares."""


class MissingKeyError(DataError, DewKeyError):
    """A record, column or feature lacks the key the reader was told to read."""


class MalformedRecordError(DataError, ValueError):
    """A record in an input file cannot be parsed (a JSONL line that is not a JSON object)."""


class ForeignPositionError(DataError, ValueError):
    """A saved position was not written by train_stream (or is corrupt)."""


class PositionMismatchError(DataError, ValueError):
    """A saved position belongs to another shuffle seed or another set of records."""


class RampError(DataError, ValueError):
    """A batch-size ramp schedule is malformed or its reader cannot change batch size."""


class UnreadableFileError(DataError, ValueError):
    """A data file is there, but not readable as the format its name says (a Parquet or Arrow file
    cut short, or another format under that name)."""


class UnreadableTokenizerError(DataError, ValueError):
    """A tokenizer file is there, but the tokenizers library cannot read it (truncated, or not a
    tokenizer.json at all)."""
