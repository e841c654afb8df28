"""One profiler window per fit, placed after the compile so it shows the loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from dew.telemetry import profiling
from dew.telemetry.records import ProfileWindowRecord

__all__ = ["ProfileSchedule", "ProfileWindow", "ProfilerBusyError"]

ProfilerBusyError = profiling.ProfilerBusyError


@dataclass(frozen=True)
class ProfileWindow:
    """Trace ``steps`` steps into directory once ``warmup`` steps of the fit have run.

    >>> ProfileWindow("/tmp/trace", steps=3).warmup
    2
    """

    directory: str = field(metadata={"description": "where the trace is written"})
    steps: int = field(metadata={"description": "steps traced"})
    warmup: int = field(default=2, metadata={"description": "steps run before the window opens"})

    def __post_init__(self) -> None:
        if int(self.steps) < 1:
            raise ValueError(f"ProfileWindow traces at least one step; got steps={self.steps}.")
        if int(self.warmup) < 0:
            raise ValueError(f"ProfileWindow.warmup counts steps, so >= 0; got {self.warmup}.")

    def schedule(self, start: int) -> ProfileSchedule:
        """The window of a fit that starts at step start.

        Raises ProfilerBusyError when a trace (``dew.profile``) is already open.
        """
        return ProfileSchedule(self, int(start))


class ProfileSchedule:
    """Starts and stops one window during a fit.

    Call ``on_step(step)`` after each step is dispatched, with ``step`` the
    number of steps done so far (the state's new step). The trace starts at
    the first call once ``warmup`` steps of this fit are done (so calling it
    with the start step too makes ``warmup=0`` trace from the first step) and
    stops ``steps`` steps later,
    when ``on_step`` returns the ProfileWindowRecord to report. ``close()``
    stops a window the fit left open (a short or preempted fit) and returns
    its record, or None.
    """

    def __init__(self, window: ProfileWindow, start: int) -> None:
        if profiling.active():
            owner, directory = profiling.tracing() or ("a trace", "?")
            raise ProfilerBusyError(
                f"This fit asks for a ProfileWindow, but {owner} is already tracing into "
                f"{directory!r}. Remove the window (profile=None) or the enclosing dew.profile."
            )
        self.window = window
        self.begin = int(start) + int(window.warmup)
        self.end = self.begin + int(window.steps)
        self._open = False
        self._done = False

    @property
    def tracing(self) -> bool:
        return self._open

    def on_step(self, step: int, state: object = None) -> ProfileWindowRecord | None:
        """Open or close the window at step; state, if given, is waited on before closing."""
        if self._done:
            return None
        if not self._open and step >= self.begin:
            profiling.start(self.window.directory, "the fit's ProfileWindow")
            self._open = True
            self._first = step
            self.end = step + int(self.window.steps)
            return None
        if self._open and step >= self.end:
            return self._stop(step, state)
        return None

    def _stop(self, step: int, state: object) -> ProfileWindowRecord:
        if state is not None:
            import jax

            jax.block_until_ready(state)
        profiling.stop()
        self._open = False
        self._done = True
        return ProfileWindowRecord(str(self.window.directory), self._first, step - self._first)

    def close(self, step: int | None = None, state: object = None) -> ProfileWindowRecord | None:
        """Stop a window still open at the end of the fit; return its record or None."""
        if not self._open:
            return None
        return self._stop(self._first if step is None else step, state)
