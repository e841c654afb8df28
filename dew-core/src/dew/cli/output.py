"""The command's own output: stdout that says so when a write to it fails.

A command whose output goes to a file on a full disk (``dew describe > notes.txt``) met the
failure inside a ``print`` as a bare ``OSError`` and ended in a traceback, even where what it
was asked to make (an export, samples) was written whole. Behind ``guard_stdout`` such a write
raises ``StdoutWriteError``, which says the output is what failed and what to do, and the
stream is pointed at the null device so the interpreter's last flush does not fail again.
"""

from __future__ import annotations

import io
import os
import sys

from dew.errors import DewError, out_of_space

__all__ = ["StdoutWriteError", "guard_stdout"]


class StdoutWriteError(DewError, OSError):
    """The command's output could not be written to stdout (a full disk, a file-size limit, an
    input/output error); what the command wrote to files of its own is as its own messages say."""

    def __init__(self, reason: OSError) -> None:
        advice = ("free space on the disk it goes to (or raise the file-size limit, ulimit -f), or send it "
                  "elsewhere" if out_of_space(reason) else "send it somewhere it can be written")
        super().__init__(f"The command's output could not be written to stdout ({reason.strerror or reason}): "
                         f"{advice}.")
        self.errno = reason.errno


class _Descriptor(io.RawIOBase):
    """A file descriptor written with os.write, a failed write raised as StdoutWriteError."""

    def __init__(self, descriptor: int) -> None:
        super().__init__()
        self._descriptor = descriptor

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._descriptor

    def isatty(self) -> bool:
        return os.isatty(self._descriptor)

    def write(self, data: object) -> int:
        view = whole = memoryview(data).cast("B")  # type: ignore[arg-type]
        try:
            while view:  # all of it: an unbuffered stdout (python -u) has no buffer to finish a short write
                view = view[os.write(self._descriptor, view):]
            return len(whole)
        except (BrokenPipeError, BlockingIOError, InterruptedError):
            raise  # a reader that went away is dew.cli's exit 141
        except OSError as error:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._descriptor)  # nothing more to say there: later writes and the last flush go nowhere
            os.close(null)
            raise StdoutWriteError(error) from error


def guard_stdout() -> None:
    """Replace the interpreter's stdout by one over the same descriptor whose failed writes raise
    StdoutWriteError (its encoding, errors and buffering kept); a stdout already replaced (a test's
    capture, an earlier call) is left alone."""
    stream = sys.stdout
    if stream is not sys.__stdout__ or not isinstance(stream, io.TextIOWrapper):
        return
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError):
        return
    stream.flush()
    raw = _Descriptor(descriptor)
    unbuffered = isinstance(stream.buffer, io.RawIOBase)  # python -u, PYTHONUNBUFFERED: each write goes out
    size = os.fstat(descriptor).st_blksize
    sys.stdout = io.TextIOWrapper(
        raw if unbuffered else io.BufferedWriter(raw, size if size > 1 else io.DEFAULT_BUFFER_SIZE),
        encoding=stream.encoding, errors=stream.errors, line_buffering=stream.line_buffering,
        write_through=unbuffered or stream.write_through)
