"""An MLflow run as a dew tracker, through MLflow's client."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from dew.telemetry.records import is_record, previews_of, record_row
from dew.telemetry.render import safe_name, write_preview
from dew.trackers import require
from dew.trackers._worker import Sender
from dew.training.trackers import Reported, check_reported

__all__ = ["MLflowTracker"]


_BATCH = 1000  # the most metrics MLflow takes in one log_batch request
_INTERVAL = 1.0  # seconds between requests while values keep arriving


class MLflowTracker:
    """Reports into one MLflow run of experiment, created on the first value.

    Scalars are the run's metrics. A preview is uploaded as the file dew's
    renderers write, under ``previews/<name>/``; a record becomes
    ``records/<type>/step_<step>.json`` (not a parameter, which MLflow allows
    one value of). Everything after the run's creation is sent by a
    background thread, in order, metrics batched into one request a second,
    so a step pays microseconds; a failed request is raised by the
    next call or by ``close``, which waits for everything to be sent. uri is
    the tracking server, or None for MLflow's default (``MLFLOW_TRACKING_URI``).
    """

    def __init__(self, experiment: str, name: str | None = None, *, uri: str | None = None) -> None:
        require("mlflow", "mlflow", "MLflowTracker")
        self.experiment = experiment
        self.name = name
        self.uri = uri
        self._run: tuple[Any, str] | None = None
        self._sender = Sender(self._send, "dew-mlflow", interval=_INTERVAL)

    @property
    def run(self) -> tuple[Any, str]:
        """The client and the run id; the experiment and the run are created once."""
        if self._run is None:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=self.uri)
            found = client.get_experiment_by_name(self.experiment)
            experiment_id = (found.experiment_id if found is not None
                             else client.create_experiment(self.experiment))
            run = client.create_run(experiment_id, run_name=self.name)
            self._run = (client, run.info.run_id)
        return self._run

    def _send(self, items: list[Any]) -> None:
        """On the sender thread: metrics in batched requests, other uploads in order."""
        client, run_id = self.run
        metrics: list[Any] = []
        for item in [*items, None]:
            if isinstance(item, list):
                metrics.extend(item)
                continue
            for begin in range(0, len(metrics), _BATCH):
                client.log_batch(run_id, metrics=metrics[begin:begin + _BATCH])
            metrics = []
            if item is not None:
                item(client, run_id)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        self.run  # noqa: B018 - the run opens on the first value, on the caller's thread
        stamp = int(time.time() * 1000)
        self._sender.submit(
            [Metric(name, float(value), stamp, int(step)) for name, value in scalars.items()]
        )

    def artifact(self, value: Reported, step: int) -> None:
        check_reported(value)
        self.run  # noqa: B018
        if is_record(value):
            row = json.dumps(record_row(value, step), allow_nan=False, indent=1)
            path = f"records/{safe_name(value.type)}/step_{int(step):08d}.json"
            self._sender.submit(lambda client, run_id: client.log_text(run_id, row, path))
        for preview in previews_of(value):
            self._sender.submit(partial(_upload, preview, int(step)))

    def close(self) -> None:
        if self._run is None:
            return
        client, run_id = self._run
        status = "FAILED"
        try:
            self._sender.drain()
            status = "FINISHED"
        finally:
            self._run = None
            client.set_terminated(run_id, status=status)

    def __repr__(self) -> str:
        return f"MLflowTracker({self.experiment!r}, {self.name!r}, uri={self.uri!r})"


def _upload(preview: Any, step: int, client: Any, run_id: str) -> None:
    with tempfile.TemporaryDirectory(prefix="dew-mlflow-") as folder:
        path = write_preview(preview, folder, step)
        client.log_artifact(run_id, str(path), f"previews/{Path(path).parent.name}")
