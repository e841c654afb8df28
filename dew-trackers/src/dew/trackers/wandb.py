"""A Weights & Biases run as a dew tracker; wandb is imported only when it logs."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.telemetry.records import TrackerDropped, is_record, previews_of, record_row
from dew.telemetry.render import write_file
from dew.trackers import require
from dew.tracking.background import Channel, TrackerWriteError, let_others_run
from dew.tracking.protocol import Outcome, Reported, check_reported
from dew.tracking.rows import recipe_fields

if TYPE_CHECKING:
    from dew.telemetry.records import RunStarted
    from dew.tracking.background import Dropped

__all__ = ["RUN_ID_FILE", "WandbTracker"]

RUN_ID_FILE = "wandb-run.json"
"""In a run folder: the W&B run its fits report to (id, project, entity, folder), which a resume continues."""

# Seconds a batch builds up: every run.log is a round trip through wandb's own event-loop
# thread, so the writer wakes twice a second for a batch of steps rather than at every step.
_INTERVAL = 0.5


def _own_service() -> None:
    """Make wandb start this process's own service, unless this process started the one
    ``WANDB_SERVICE`` names.

    wandb hands its service's address to child processes in ``WANDB_SERVICE``, and a run
    started where it is set talks to that service: one another process started and stops
    when that process exits or finishes with W&B (its exit hook shuts it down). A run of
    a child that outlives it then loses its connection mid-run (``ConnectionResetError:
    Connection lost``) and every report after, and a run the child leaves open is only
    finished when the other process exits. The address names the process that started
    the service (``<version>-<pid>-unix-<path>``, or ``-tcp-``); one from another process
    is dropped from this process's environment, so wandb starts a service of its own.
    """
    address = os.environ.get("WANDB_SERVICE", "")
    started_by = re.match(r"[^-]+-(\d+)-(?:unix|tcp)-", address)
    if started_by is not None and int(started_by.group(1)) != os.getpid():
        del os.environ["WANDB_SERVICE"]


def _close_at_exit(tracker: weakref.ReferenceType[WandbTracker]) -> Callable[[], None]:
    """An exit hook that closes a tracker its owner left open (without keeping it alive)."""

    def close() -> None:
        alive = tracker()
        if alive is not None:
            with contextlib.suppress(Exception):
                alive.close()

    return close


_EXIT_CODES: Mapping[Outcome, int] = {"finished": 0, "failed": 1, "killed": 130}
"""The exit code W&B's run finishes with for each outcome (any but 0 is a failed run there)."""


class WandbTracker:
    """Reports into one W&B run, started on the first value.

    Scalars go to the run's history. Every preview is written as a file in
    the run's directory (``previews/<name>/step_<step>.<ext>``), and an image
    is also logged as a ``wandb.Image`` under ``previews/<name>``. A record is
    written to ``records/<type>/step_<step>.json`` in the run's directory. The
    recipe a RunStarted record carries becomes the run's config, flattened to
    dotted names. offline=True keeps everything on disk (``wandb sync``
    uploads it later) and needs no network; id resumes (or names) a run; name
    (or run_name, the key a recipe's ``trackers:`` entry uses) is its display
    name.

    The run starts on the caller's thread and must start within
    connect_timeout seconds (W&B's ``init_timeout``). Every later call to
    wandb runs on dew's tracker thread, in order, in batches gathered over half
    a second, so a step pays microseconds for a log. With stop_on_failure False (the default) a failed call is
    retried with a growing pause, dropping the oldest beyond buffer, and a
    ``tracker_dropped`` record says what was lost once W&B takes calls again;
    with True a failure is raised by the next call or by ``close``.
    """

    def __init__(
        self,
        project: str,
        name: str | None = None,
        *,
        entity: str | None = None,
        config: Mapping[str, object] | None = None,
        offline: bool = False,
        id: str | None = None,
        run_name: str | None = None,
        connect_timeout: float = 30.0,
        stop_on_failure: bool = False,
        buffer: int = 10_000,
        close_timeout: float = 30.0,
    ) -> None:
        require("wandb", "WandbTracker")
        if name is not None and run_name is not None and name != run_name:
            raise ValueError(f"WandbTracker got two run names, {name!r} and {run_name!r}; "
                             "give one (run_name is the key recipes use).")
        self.project = project
        self.name = name if name is not None else run_name
        self.entity = entity
        self.config = dict(config or {})
        self.offline = offline
        self.id = id
        self.connect_timeout = connect_timeout
        self._run: Any = None
        self._outcome: Outcome = "finished"
        self._exit_hook: Callable[[], None] | None = None
        where = f"WandbTracker for project {project!r}" + (" (offline)" if offline else "")
        self._channel = Channel(self._send, where, interval=_INTERVAL, stop_on_failure=stop_on_failure,
                                buffer=buffer, close_timeout=close_timeout,
                                on_recover=self._recovered)

    @property
    def run(self) -> Any:
        """The wandb run, initialised on first use."""
        return self._start(None)

    def _start(self, started: RunStarted | None) -> Any:
        """The run, started once: with the recipe's id, else the one an earlier fit in the same run
        folder started when started says this fit resumes there (RUN_ID_FILE), else a new one."""
        if self._run is not None:
            return self._run
        import wandb

        _own_service()
        folder = None if started is None else started.run_folder()
        run_id = self.id
        if run_id is None and folder is not None and started is not None and started.start > 0:
            run_id = self._earlier_id(Path(folder))
        try:
            self._run = wandb.init(
                project=self.project, name=self.name, entity=self.entity,
                config=self.config, id=run_id, resume="allow" if run_id else None,
                mode="offline" if self.offline else None, reinit="create_new",
                settings=wandb.Settings(console="off", init_timeout=self.connect_timeout),
            )
        except Exception as error:
            raise TrackerWriteError(
                f"WandbTracker could not start a run in project {self.project!r} within "
                f"{self.connect_timeout:g} s: {error}. Check the network and WANDB_API_KEY, "
                "use offline=True, or remove the tracker.") from error
        # W&B stops its service at exit, from a hook registered when the service started;
        # exit hooks run last registered first, so this one closes the tracker before.
        self._exit_hook = _close_at_exit(weakref.ref(self))
        atexit.register(self._exit_hook)
        if self.id is None and folder is not None:
            self._keep_id(Path(folder))
        return self._run

    def _where(self, folder: Path) -> dict[str, object]:
        """What names this tracker's run beside its id: a copy of the folder, or another project, is another run."""
        return {"folder": str(folder), "project": self.project, "entity": self.entity}

    def _earlier_id(self, folder: Path) -> str | None:
        """The id the run folder's earlier fit started its run with, when it was this tracker's run."""
        try:
            kept = json.loads((folder / RUN_ID_FILE).read_text())
        except (OSError, ValueError):
            return None  # none kept (a run trained before dew kept it): a new run, as then
        if not isinstance(kept, dict) or not isinstance(kept.get("id"), str):
            return None
        return kept["id"] if {k: kept.get(k) for k in self._where(folder)} == self._where(folder) else None

    def _keep_id(self, folder: Path) -> None:
        """Write the run's id into the run folder (when it exists), for a resume there to continue it."""
        if not folder.is_dir():
            return
        kept = {"id": self._run.id, **self._where(folder)}
        with contextlib.suppress(OSError):  # a read-only folder: a resume starts a new run, as before
            # renamed into place: a link planted at the name (a run folder someone handed over) is replaced
            write_file(folder / RUN_ID_FILE, (json.dumps(kept, indent=1) + "\n").encode())

    def _send(self, items: list[tuple[str, Any, int]]) -> None:
        """On the tracker thread: history rows, files and config, in order."""
        from dew.telemetry.records import RunStarted

        run = self.run
        for kind, value, step in items:
            let_others_run()
            if kind == "log":
                run.log({name: float(number) for name, number in value.items()}, step=int(step))
                continue
            if isinstance(value, RunStarted) and value.config:
                run.config.update(recipe_fields(value.config), allow_val_change=True)
            self._write_artifact(run, value, step)

    def _write_artifact(self, run: Any, value: Reported, step: int) -> None:
        from dew.telemetry.render import image_grid, safe_name, write_preview

        directory = Path(run.dir)
        if is_record(value):
            path = directory / "records" / safe_name(value.type) / f"step_{int(step):08d}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record_row(value, step), allow_nan=False, indent=1))
        media = {}
        for preview in previews_of(value):
            write_preview(preview, directory / "previews", step)
            if preview.kind == "image":
                import wandb

                media[f"previews/{preview.name}"] = wandb.Image(
                    image_grid(np.asarray(preview.data)), caption=preview.name
                )
        if media:
            run.log(media, step=int(step))

    def _recovered(self, dropped: Dropped) -> None:
        record = TrackerDropped.of(dropped, self._channel.where)
        self._write_artifact(self.run, record, dropped.last_step or 0)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run  # noqa: B018 - the run starts on the first value, on the caller's thread
        self._channel.submit(("log", dict(scalars), step))

    def artifact(self, value: Reported, step: int) -> None:
        from dew.telemetry.records import RunStarted

        check_reported(value)
        self._start(value if isinstance(value, RunStarted) else None)  # a fit's first report: it may resume
        self._channel.submit(("artifact", value, step))

    def conclude(self, outcome: Outcome) -> None:
        """How the run ended, given to W&B at close as its exit code: 0 when it finished, else
        1 (failed) or 130 (killed: a Ctrl-C or a preemption), which W&B shows as failed."""
        self._outcome = outcome

    def flush(self) -> None:
        """Wait until every call so far reached wandb; raise what failed. While wandb fails
        nothing is waited for: the backlog keeps retrying."""
        self._channel.flush(through_outage=False)
        self._channel.check()

    def close(self) -> None:
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        if self._run is None:
            return
        try:
            self._channel.close()
        finally:
            run, self._run = self._run, None
            run.finish(exit_code=_EXIT_CODES[self._outcome])

    def __repr__(self) -> str:
        return f"WandbTracker({self.project!r}, {self.name!r}, offline={self.offline})"
