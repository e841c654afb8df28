"""What a person watching a fit sees: a few plain lines, and a live bar on a terminal.

The plain lines (the fit's range and mesh, the loss at each log step, the
goodput at the end) are printed in every mode. On a terminal a rich progress
bar shows the step, steps per second, the time left and the last loss, and
the lines are printed above it. The trainer calls ``advance`` every step, so
it only stores the step; the bar redraws itself from a background thread.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING

from dew.telemetry.records import Goodput

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

__all__ = ["Console"]


def _format(value: float) -> str:
    return f"{value:.4g}" if abs(value) >= 1e4 or (value != 0 and abs(value) < 1e-3) else (
        f"{value:.4f}"
    )


class Console:
    """Progress output of one fit (process 0 only).

    ``live`` chooses the rich display: None means "when the stream is a terminal".

    >>> import io
    >>> out = io.StringIO()
    >>> console = Console(out)
    >>> console.start(0, 100, {"data": 1}, 1)
    >>> console.log(25, {"train/loss": 0.03061, "train/lr": 0.003, "train/step_time": 0.25})
    >>> print(out.getvalue().strip())
    Training from step 0 to 100 on {'data': 1} (1 process(es))
    step 25: loss 0.0306, lr 0.003, 0.25 s/step
    """

    def __init__(self, stream: IO[str] | None = None, *, live: bool | None = None) -> None:
        self.stream = stream
        self.live = live
        self._progress: Progress | None = None
        self._task: TaskID  # the bar's task, set with _progress
        self._start = 0
        self._steps = 0
        self._step = 0

    # -- output -----------------------------------------------------------------
    def _out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stdout

    def _print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            out = self._out()
            out.write(line + "\n")
            out.flush()

    def _wants_live(self) -> bool:
        if self.live is not None:
            return self.live
        isatty = getattr(self._out(), "isatty", None)  # any writable stream: a test's may have none
        return bool(isatty and isatty())

    # -- the trainer's calls ----------------------------------------------------
    def start(self, start: int, steps: int, mesh: Mapping[str, int], processes: int) -> None:
        """Announce the fit and, on a terminal, open the live display."""
        self._start, self._steps, self._step = int(start), int(steps), int(start)
        self._print(
            f"Training from step {start} to {steps} on {dict(mesh)} ({processes} process(es))"
        )
        if self._wants_live() and steps > start:
            self._open_live()

    def _open_live(self) -> None:
        from rich.console import Console as RichConsole
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
        )

        console = RichConsole(file=self._out(), force_terminal=True if self.live else None)
        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[rate]} steps/s"),
            TextColumn("eta {task.fields[eta]}"),
            TextColumn("loss {task.fields[loss]}"),
            console=console,
            refresh_per_second=4,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "fit", total=self._steps, completed=self._start, rate="-", eta="-", loss="-"
        )
        self._started_at = time.perf_counter()

    def advance(self, step: int) -> None:
        """Note that step steps are done (cheap: no printing, no device access).

        The bar's rate and its time left come from the same count, so they
        agree: time left is the steps left over that rate.
        """
        self._step = step
        if self._progress is not None:
            elapsed = time.perf_counter() - self._started_at
            done = step - self._start
            if elapsed > 0 and done > 0:
                rate = done / elapsed
                left = int(round((self._steps - step) / rate))
                rate_text, eta = f"{rate:.2f}", f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"
            else:
                rate_text, eta = "-", "-"
            self._progress.update(self._task, completed=step, rate=rate_text, eta=eta)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Print a log step's loss, learning rate, tokens per second and step time (every
        scalar when there is no training loss, as for validation)."""
        if "train/loss" in scalars:
            loss = float(scalars["train/loss"])
            fields = [f"loss {loss:.4f}"]
            if "train/lr" in scalars:
                fields.append(f"lr {float(scalars['train/lr']):.3g}")
            if "throughput/tokens_per_second" in scalars:
                fields.append(f"{float(scalars['throughput/tokens_per_second']):.4g} tokens/s")
            if "train/step_time" in scalars:
                fields.append(f"{float(scalars['train/step_time']):.3g} s/step")
            self._print(f"step {step}: {', '.join(fields)}")
            if self._progress is not None:
                self._progress.update(self._task, loss=f"{loss:.4f}")
        else:
            shown = ", ".join(f"{name} {_format(float(v))}" for name, v in scalars.items())
            self._print(f"step {step}: {shown}")

    def note(self, line: str) -> None:
        """Print one line of news (a rejected step, a checkpoint) above the bar."""
        self._print(line)

    def finish(self, goodput: Goodput) -> None:
        """Close the live display and print where the wall time went."""
        self._close_live()
        self._print(
            f"Goodput: first step after {goodput.first_step_seconds:.2f} s, "
            f"{100 * goodput.fraction:.1f}% of the wall time in steps"
        )

    def _close_live(self) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self._step)
            self._progress.stop()
            self._progress = None

    def close(self) -> None:
        """Stop the live display if a fit ended without finish()."""
        self._close_live()
