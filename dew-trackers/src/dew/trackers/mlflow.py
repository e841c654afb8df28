"""An MLflow run as a dew tracker, through MLflow's client."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dew.telemetry.records import TrackerDropped, is_record, previews_of, record_row
from dew.telemetry.render import safe_name, write_preview
from dew.trackers import require
from dew.tracking.background import Channel, TrackerWarning, TrackerWriteError, let_others_run
from dew.tracking.protocol import Outcome, Reported, check_reported
from dew.tracking.rows import locates_the_run, recipe_fields

if TYPE_CHECKING:
    from dew.telemetry.artifacts import Artifact
    from dew.telemetry.records import Record, RunStarted
    from dew.tracking.background import Dropped

__all__ = ["MLflowTracker", "TrackerUnreachableError"]


_METRICS = 1000  # the most metrics MLflow takes in one log_batch request
_PARAMS = 100  # the most parameters
_PARAM_LENGTH = 6000  # the longest parameter value
_INTERVAL = 1.0  # seconds between requests while values keep arriving
_FOLDER_TAG = "dew.checkpoint_dir"  # the run folder a run was trained in: a resume reopens its run
_UNSET = "<unset>"  # a resumed_at tag's value for a field the resume's recipe no longer sets
_STATUS: Mapping[str, str] = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


class TrackerUnreachableError(TrackerWriteError):
    """A tracking server did not answer the connect check when the run opened."""


@contextlib.contextmanager
def _bounded_requests(timeout: float, retries: int) -> Iterator[None]:
    """MLflow's HTTP retries bounded for the calls inside (MLflow reads them from the
    environment at each request; its defaults retry for minutes). A value the user set
    in the environment is kept."""
    names = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries),
             "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, round(timeout))),
             "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    added = [name for name in names if name not in os.environ]
    for name in added:
        os.environ[name] = names[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _shown(uri: str) -> str:
    """uri as messages and records show it: a password or token in it becomes ``***``."""
    from dew.telemetry.redaction import redact_text

    return redact_text(uri)


def _quoted(text: str) -> str:
    """text inside single quotes of an MLflow search filter."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _param_name(name: str) -> str:
    """name as MLflow accepts a parameter's: other characters become ``_``, at most 250."""
    return re.sub(r"[^\w\-. /]", "_", name)[:250]


def _retryable(error: BaseException) -> bool:
    """A request worth repeating: anything but a refusal of the request itself (4xx)."""
    from mlflow.exceptions import MlflowException

    cause = error.__cause__ if isinstance(error, TrackerWriteError) else error
    return not (isinstance(cause, MlflowException) and 400 <= cause.get_http_status_code() < 500)


class MLflowTracker:
    """Reports into one MLflow run of experiment, created on the first value.

    Scalars are the run's metrics. A preview is uploaded as the file dew's
    renderers write, under ``previews/<name>/``; a record becomes
    ``records/<type>/step_<step>.json`` (not a parameter, which MLflow allows
    one value of). The recipe a RunStarted record carries becomes the run's
    parameters, flattened to dotted names, so runs are searchable by them.
    A run trained in a run folder is tagged ``dew.checkpoint_dir`` with it, and
    a fit resumed there reopens that run (the steps it trains again are
    logged a second time, as MLflow keeps every value it was sent); the run
    ends FINISHED, FAILED or KILLED (a signal or Ctrl-C) as the fit did.
    name (or run_name, the key a recipe's ``trackers:`` entry uses) names the
    run; uri is the tracking server, or None for MLflow's default
    (``MLFLOW_TRACKING_URI``).

    When the run opens, an HTTP server must answer within connect_timeout
    seconds (TrackerUnreachableError otherwise, naming the address). After
    that, everything is sent by dew's tracker thread, metrics batched into one
    request a second, so a step pays microseconds. With stop_on_failure False
    (the default) a failed request is retried with a growing pause, at most
    buffer reports wait (the oldest are dropped), and once the server answers
    again a ``tracker_dropped`` record says what was lost; close waits at most
    close_timeout seconds for a server that stays away, then warns. With
    stop_on_failure True a failure is raised by the next call or by close.
    """

    def __init__(self, experiment: str, name: str | None = None, *, uri: str | None = None,
                 run_name: str | None = None, connect_timeout: float = 10.0,
                 request_timeout: float = 10.0, stop_on_failure: bool = False,
                 buffer: int = 10_000, close_timeout: float = 30.0) -> None:
        require("mlflow", "MLflowTracker")
        if name is not None and run_name is not None and name != run_name:
            raise ValueError(f"MLflowTracker got two run names, {name!r} and {run_name!r}; "
                             "give one (run_name is the key recipes use).")
        self.experiment = experiment
        self.name = name if name is not None else run_name
        self.uri = uri
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._run: tuple[Any, str] | None = None
        self._outcome: Outcome = "finished"
        self._params: set[str] = set()
        self._held: dict[str, str] = {}  # the parameters a reopened run holds from its earlier fits
        self._channel = Channel(
            self._send, f"MLflowTracker at {self._named_uri()}", interval=_INTERVAL,
            stop_on_failure=stop_on_failure, buffer=buffer, close_timeout=close_timeout,
            on_recover=self._recovered, retryable=_retryable)

    def _named_uri(self) -> str:
        """The address for messages, without importing MLflow."""
        if self.uri is not None:
            return _shown(self.uri)
        # MLflow's default has changed between releases (./mlruns, then sqlite:///mlflow.db): named, not guessed.
        return _shown(os.environ.get("MLFLOW_TRACKING_URI",
                                     "MLflow's default tracking URI (no uri given, MLFLOW_TRACKING_URI unset)"))

    def _resolved_uri(self) -> str:
        if self.uri is not None:
            return self.uri
        from mlflow.tracking import get_tracking_uri

        return get_tracking_uri()

    @property
    def where(self) -> str:
        """The tracking URI this tracker reports to, as MLflow resolves it (a password
        in it shown as ``***``)."""
        return _shown(self._resolved_uri())

    def _check_server(self) -> None:
        """Fail within connect_timeout when an HTTP tracking server does not answer."""
        where, uri = self.where, self._resolved_uri()
        if not uri.startswith(("http://", "https://")):
            return
        parts = urllib.parse.urlsplit(uri)
        host = parts.netloc.rpartition("@")[2]  # any answer will do, so no credentials
        probe = urllib.parse.urlunsplit((parts.scheme, host, f"{parts.path.rstrip('/')}/health",
                                         "", ""))
        try:
            with urllib.request.urlopen(probe, timeout=self.connect_timeout):  # noqa: S310
                return
        except urllib.error.HTTPError:
            return  # it answered: a server without /health, or behind a proxy
        except (OSError, ValueError) as error:
            reason = getattr(error, "reason", error)  # urllib's URLError says why; others are it
            raise TrackerUnreachableError(
                f"MLflowTracker: the tracking server {where} did not answer within "
                f"{self.connect_timeout:g} s ({reason}). Start it, fix the uri (or "
                f"MLFLOW_TRACKING_URI), raise connect_timeout, or remove the tracker."
            ) from error

    @property
    def run(self) -> tuple[Any, str]:
        """The client and the run id; the experiment and the run are created once."""
        return self._open(None)

    def _open(self, started: RunStarted | None) -> tuple[Any, str]:
        """The run, opened once: the one an earlier fit in the same run folder opened, when
        started says this fit resumes there, else a new one tagged with the folder."""
        if self._run is not None:
            return self._run
        from mlflow import MlflowClient

        self._check_server()
        folder = None if started is None else started.run_folder()
        try:
            with _bounded_requests(self.connect_timeout, retries=2):
                client = MlflowClient(tracking_uri=self.uri)
                found = client.get_experiment_by_name(self.experiment)
                experiment_id = (found.experiment_id if found is not None
                                 else client.create_experiment(self.experiment))
                run_id = None
                if folder is not None and started is not None and started.start > 0:
                    earlier = client.search_runs(
                        [experiment_id], filter_string=f"tags.`{_FOLDER_TAG}` = '{_quoted(folder)}'",
                        order_by=["attributes.start_time DESC"], max_results=1)
                    run_id = earlier[0].info.run_id if earlier else None
                if run_id is not None:
                    client.update_run(run_id, status="RUNNING")
                    self._held = dict(client.get_run(run_id).data.params)
                else:
                    tags = {} if folder is None else {_FOLDER_TAG: folder}
                    run_id = client.create_run(experiment_id, run_name=self.name, tags=tags).info.run_id
        except Exception as error:
            raise TrackerUnreachableError(self._scrub(
                f"MLflowTracker could not open a run in experiment {self.experiment!r} at "
                f"{self.where}: {error}")) from error
        self._run = (client, run_id)
        return self._run

    def _scrub(self, text: str) -> str:
        """text with credentials hidden (MLflow's errors quote the URL they called)."""
        return _shown(text)

    def _send(self, items: list[tuple[Any, ...]]) -> None:
        """On the tracker thread: everything in order, a failure named with the URI."""
        try:
            self._send_all(items)
        except Exception as error:
            raise TrackerWriteError(self._scrub(
                f"MLflowTracker at {self.where}: {type(error).__name__}: {error}")) from error

    def _send_all(self, items: list[tuple[Any, ...]]) -> None:
        """Metrics in batched requests, other uploads in order."""
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        from dew.telemetry.records import RunStarted

        client, run_id = self.run
        with _bounded_requests(self.request_timeout, retries=0):
            metrics: list[Any] = []
            for kind, value, step, stamp in [*items, ("end", None, 0, 0)]:
                let_others_run()
                if kind == "log":
                    metrics += [Metric(key, float(number), stamp, int(step))
                                for key, number in value.items()]
                    continue
                for begin in range(0, len(metrics), _METRICS):
                    client.log_batch(run_id, metrics=metrics[begin:begin + _METRICS])
                    let_others_run()
                metrics = []
                if kind != "artifact":
                    continue
                if isinstance(value, RunStarted) and value.config:
                    try:
                        self._log_params(client, run_id, value.config, value.start)
                    except MlflowException as error:
                        if _retryable(error):
                            raise
                        # a field MLflow refuses costs no metrics
                        warnings.warn(self._scrub(
                            f"MLflowTracker at {self.where} could not record the recipe as "
                            f"parameters: {error}"), TrackerWarning, stacklevel=2)
                if is_record(value):
                    self._log_record(client, run_id, value, step)
                for preview in previews_of(value):
                    _upload(client, run_id, preview, int(step))

    def _log_params(self, client: Any, run_id: str, config: Mapping[str, Any], start: int = 0) -> None:
        """The recipe as parameters; in a reopened run, whose parameters MLflow will not change, a field
        a resume changed, added or removed is a tag ``dew.resumed_at.<step>.<field>`` (a removed one
        ``<unset>``; where the run lives is no change), so its parameters stay the first fit's recipe."""
        from mlflow.entities import Param, RunTag

        every = {_param_name(name): str(value)[:_PARAM_LENGTH]
                 for name, value in recipe_fields(config).items()}
        fields = {name: value for name, value in every.items() if name not in self._params}
        gone = {name: _UNSET for name in self._held
                if name not in every and name not in self._params and not locates_the_run(name)}
        params = [] if self._held else [Param(name, value) for name, value in fields.items()]
        changed = [RunTag(f"dew.resumed_at.{start}.{name}", value) for name, value in {**fields, **gone}.items()
                   if self._held and self._held.get(name) != value and not locates_the_run(name)]
        for begin in range(0, len(params), _PARAMS):
            client.log_batch(run_id, params=params[begin:begin + _PARAMS])
        for begin in range(0, len(changed), _PARAMS):
            client.log_batch(run_id, tags=changed[begin:begin + _PARAMS])
        self._params.update({*fields, *gone})

    def _log_record(self, client: Any, run_id: str, value: Record, step: int) -> None:
        row = json.dumps(record_row(value, step), allow_nan=False, indent=1)
        client.log_text(run_id, row, f"records/{safe_name(value.type)}/step_{int(step):08d}.json")

    def _recovered(self, dropped: Dropped) -> None:
        client, run_id = self.run
        with _bounded_requests(self.request_timeout, retries=0):
            self._log_record(client, run_id, TrackerDropped.of(dropped, self.where),
                             dropped.last_step or 0)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run  # noqa: B018 - the run opens on the first value, on the caller's thread
        self._channel.submit(("log", dict(scalars), step, int(time.time() * 1000)))

    def artifact(self, value: Reported, step: int) -> None:
        from dew.telemetry.records import RunStarted

        check_reported(value)
        self._open(value if isinstance(value, RunStarted) else None)  # a fit's first report: it may resume
        self._channel.submit(("artifact", value, step, 0))

    def conclude(self, outcome: Outcome) -> None:
        """The status the run ends with at close: FINISHED, FAILED or KILLED."""
        self._outcome = outcome

    def flush(self) -> None:
        """Wait until everything so far is sent (or given up on); raise what failed. While the
        server is unreachable nothing is waited for: the backlog keeps retrying."""
        self._channel.flush(through_outage=False)
        self._channel.check()

    def close(self) -> None:
        if self._run is None:
            return
        client, run_id = self._run
        status = "FAILED"
        try:
            self._channel.close()
            status = _STATUS[self._outcome]
        finally:
            self._run = None
            try:
                with _bounded_requests(self.request_timeout, retries=0):
                    client.set_terminated(run_id, status=status)
            except Exception as error:
                if self._channel.stop_on_failure:
                    raise TrackerWriteError(f"MLflowTracker could not end run {run_id} at "
                                            f"{self.where}: {error}") from error
                warnings.warn(f"MLflowTracker could not end run {run_id} at {self.where} "
                              f"(it stays RUNNING there): {error}", TrackerWarning, stacklevel=2)

    def __repr__(self) -> str:
        uri = None if self.uri is None else _shown(self.uri)
        return f"MLflowTracker({self.experiment!r}, {self.name!r}, uri={uri!r})"


def _upload(client: Any, run_id: str, preview: Artifact, step: int) -> None:
    with tempfile.TemporaryDirectory(prefix="dew-mlflow-") as folder:
        path = write_preview(preview, folder, step)
        client.log_artifact(run_id, str(path), f"previews/{Path(path).parent.name}")
