"""An MLflow run as a dew tracker, through MLflow's client."""

from __future__ import annotations

import json
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dew.telemetry.records import is_record, previews_of, record_row
from dew.trackers import require
from dew.training.trackers import Reported, check_reported

__all__ = ["MLflowTracker"]


class MLflowTracker:
    """Reports into one MLflow run of experiment, created on the first value.

    Scalars are the run's metrics, sent without waiting for the server
    (MLflow's asynchronous logging; ``close`` waits for them and raises what
    failed). A preview is uploaded as the file dew's renderers write, under
    ``previews/<name>/``; a record becomes ``records/<type>/step_<step>.json``
    (not a parameter, which MLflow allows one value of). uri is the tracking
    server, or None for MLflow's own default (``MLFLOW_TRACKING_URI``).
    """

    def __init__(self, experiment: str, name: str | None = None, *, uri: str | None = None) -> None:
        require("mlflow", "mlflow", "MLflowTracker")
        self.experiment = experiment
        self.name = name
        self.uri = uri
        self._run: tuple[Any, str] | None = None
        self._pending: deque[Any] = deque()

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

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        client, run_id = self.run
        stamp = int(time.time() * 1000)
        metrics = [Metric(name, float(value), stamp, int(step)) for name, value in scalars.items()]
        self._pending.append(client.log_batch(run_id, metrics=metrics, synchronous=False))
        self._settle(block=False)

    def _settle(self, block: bool) -> None:
        """Wait on finished (or, with block, all) pending writes, raising a failed one."""
        while self._pending:
            head = self._pending[0]
            futures = getattr(head, "_operation_futures", None) or []
            if not block and not all(f.done() for f in futures):
                return
            self._pending.popleft()
            if head is not None:
                head.wait()

    def artifact(self, value: Reported, step: int) -> None:
        from dew.telemetry.render import safe_name, write_preview

        check_reported(value)
        client, run_id = self.run
        if is_record(value):
            row = json.dumps(record_row(value, step), allow_nan=False, indent=1)
            client.log_text(run_id, row, f"records/{safe_name(value.type)}/step_{int(step):08d}.json")
        previews = previews_of(value)
        if previews:
            with tempfile.TemporaryDirectory(prefix="dew-mlflow-") as folder:
                for preview in previews:
                    path = write_preview(preview, folder, step)
                    client.log_artifact(run_id, str(path),
                                        f"previews/{Path(path).parent.name}")

    def close(self) -> None:
        if self._run is None:
            return
        client, run_id = self._run
        try:
            self._settle(block=True)
        finally:
            self._run = None
            client.set_terminated(run_id)

    def __repr__(self) -> str:
        return f"MLflowTracker({self.experiment!r}, {self.name!r}, uri={self.uri!r})"
