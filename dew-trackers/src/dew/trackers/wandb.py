"""A Weights & Biases run as a dew tracker; wandb is imported only when it logs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from dew.telemetry.records import is_record, previews_of, record_row
from dew.trackers import require
from dew.trackers._worker import Sender
from dew.training.trackers import Reported, check_reported

__all__ = ["WandbTracker"]


class WandbTracker:
    """Reports into one W&B run, started on the first value.

    Scalars go to the run's history. Every preview is written as a file in
    the run's directory (``previews/<name>/step_<step>.<ext>``), and an image
    is also logged as a ``wandb.Image`` under ``previews/<name>``. A record is
    written to ``records/<type>/step_<step>.json`` in the run's directory.
    offline=True keeps everything on disk (``wandb sync`` uploads it later)
    and needs no network; id resumes (or names) a run.

    The run starts on the caller's thread; every later call to wandb runs on a
    background thread, in order, so a step pays microseconds for a log. A
    failure there is raised by the next call or by ``close``, which waits for
    everything queued before finishing the run.
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
    ) -> None:
        require("wandb", "wandb", "WandbTracker")
        self.project = project
        self.name = name
        self.entity = entity
        self.config = dict(config or {})
        self.offline = offline
        self.id = id
        self._run: Any = None
        self._sender = Sender(_call_each, "dew-wandb")

    @property
    def run(self) -> Any:
        """The wandb run, initialised on first use."""
        if self._run is None:
            import wandb

            self._run = wandb.init(
                project=self.project, name=self.name, entity=self.entity,
                config=self.config, id=self.id, resume="allow" if self.id else None,
                mode="offline" if self.offline else None, reinit="create_new",
                settings=wandb.Settings(console="off"),
            )
        return self._run

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        row = {name: float(value) for name, value in scalars.items()}
        self._sender.submit(partial(self.run.log, row, step=int(step)))

    def artifact(self, value: Reported, step: int) -> None:
        from dew.telemetry.render import image_grid, safe_name, write_preview

        check_reported(value)
        run = self.run
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
            self._sender.submit(partial(run.log, media, step=int(step)))

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            try:
                self._sender.drain()
            finally:
                run.finish()

    def __repr__(self) -> str:
        return f"WandbTracker({self.project!r}, {self.name!r}, offline={self.offline})"


def _call_each(calls: list[Any]) -> None:
    for call in calls:
        call()
