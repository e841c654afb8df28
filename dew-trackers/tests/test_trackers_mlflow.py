"""MLflowTracker against a real tracking server on loopback (SQLite backend), read back
with MLflow's own client."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from PIL import Image

import dew
from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import Goodput
from dew.tracking.background import TrackerWarning
from dew.tracking.composite import Trackers

pytest.importorskip("mlflow")

import mlflow_server  # noqa: E402 - a helper beside the tests
from dew.testing.doubles import Regression
from dew.testing.doubles import regression_dataset as dataset


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    process = mlflow_server.start(root, port := mlflow_server.free_port())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        mlflow_server.stop(process)


@pytest.mark.slow
def test_mlflow_read_back_through_the_client(server, tmp_path):
    from mlflow import MlflowClient

    from dew.trackers.mlflow import MLflowTracker

    client = MlflowClient(tracking_uri=server)
    tracker = MLflowTracker("dew-tests", "read-back", uri=server)
    assert client.get_experiment_by_name("dew-tests") is None  # opened on the first value
    losses = [1.0 / step for step in range(1, 6)]
    for step, loss in enumerate(losses, start=1):
        tracker.log({"loss": loss, "train/throughput": 100.0 * step}, step=step)
    tracker.log({"loss": float("nan")}, step=6)
    image = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    tracker.artifact(Artifact("samples", "image", image), step=5)
    tracker.artifact(Artifact("story", "text", "once upon a time"), step=5)
    tracker.artifact(Goodput(1.0, 4.0, 3.0), step=5)
    tracker.artifact(Goodput(1.0, 8.0, 6.0), step=6)  # a second record of the same type
    tracker.close()

    experiment = client.get_experiment_by_name("dew-tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "read-back" and run.info.status == "FINISHED"
    run_id = run.info.run_id
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
    history.sort()
    assert history[:5] == list(enumerate(losses, start=1))
    assert history[5][0] == 6 and math.isnan(history[5][1])
    throughput = sorted((m.step, m.value)
                        for m in client.get_metric_history(run_id, "train/throughput"))
    assert throughput == [(step, 100.0 * step) for step in range(1, 6)]

    files = {a.path for a in client.list_artifacts(run_id, "previews/samples")}
    files |= {a.path for a in client.list_artifacts(run_id, "previews/story")}
    files |= {a.path for a in client.list_artifacts(run_id, "records/goodput")}
    assert files == {"previews/samples/step_00000005.png", "previews/story/step_00000005.txt",
                     "records/goodput/step_00000005.json", "records/goodput/step_00000006.json"}
    local = Path(client.download_artifacts(run_id, "", str(tmp_path)))
    np.testing.assert_array_equal(
        np.asarray(Image.open(local / "previews/samples/step_00000005.png")), image)
    assert (local / "previews/story/step_00000005.txt").read_text() == "once upon a time"
    second = json.loads((local / "records/goodput/step_00000006.json").read_text())
    assert second["record"]["fraction"] == 0.75 and second["type"] == "goodput"


PASSWORD = "s3cr3t-Pa55-9f1c"  # noqa: S105 - the secret the run must not write down


@pytest.mark.slow
def test_a_password_in_the_tracker_uri_reaches_the_server_but_no_file(server, tmp_path):
    """`dew train` with an MLflow URI holding user:password@: the run reaches the server
    through that URI, and the password is in no file the run writes (run.json, journals,
    checkpoints) nor in what the MLflow run stores (records, parameters)."""
    from mlflow import MlflowClient

    secret_uri = server.replace("http://", f"http://dew-user:{PASSWORD}@")
    run_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
model: {{name: causal_transformer, vocab_size: 257, emb_features: 32, num_layers: 1,
        num_heads: 2, mlp_features: 64, max_seq_len: 32}}
objective: {{name: lm, seq_len: 16}}
data: {{name: token_windows, files: "{{stdlib}}/ab*.py", length: 16, tokenizer: byte, batch: 8}}
trainer: {{steps: 3, log_every: 1, checkpoint_dir: "{run_dir}/checkpoints", checkpoint_every: 3}}
trackers:
  - {{name: local, directory: "{run_dir}/journal"}}
  - {{name: mlflow, experiment: dew-secrets, uri: "{secret_uri}"}}
""")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([str(Path(sys.executable).with_name("dew")), "train", str(recipe)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    # dew prints no password; MLflow's own client prints its "View run at <uri>" lines.
    printed = [line for line in (result.stdout + result.stderr).splitlines() if PASSWORD in line]
    assert all("View " in line for line in printed), printed

    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "run.json" for p in written) and any(p.name == "records.jsonl" for p in written)
    assert not [p for p in written if PASSWORD.encode() in p.read_bytes()]
    saved = json.loads((run_dir / "checkpoints" / "run.json").read_text())
    assert saved["trackers"][1]["uri"] == server.replace("http://", "http://dew-user:***@")

    client = MlflowClient(tracking_uri=server)
    (run,) = client.search_runs([client.get_experiment_by_name("dew-secrets").experiment_id])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == [1, 2, 3]
    assert PASSWORD not in json.dumps([run.data.params, run.data.tags])
    stored = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "stored")))
    files = [p for p in stored.rglob("*") if p.is_file()]
    assert any("run_started" in p.as_posix() for p in files)  # the recipe was recorded there
    assert not [p for p in files if PASSWORD.encode() in p.read_bytes()]


# -- faults: a dead address, a server that hangs, a server killed mid-run -----


def _trainer(tracker):
    return dew.Trainer(Regression(), optax.sgd(0.01), key=jax.random.key(0), tracker=tracker)


def test_a_dead_address_fails_before_step_one_within_seconds():
    from dew.trackers.mlflow import MLflowTracker, TrackerUnreachableError

    uri = f"http://127.0.0.1:{mlflow_server.free_port()}"  # nothing listens there
    began = time.monotonic()
    with pytest.raises(TrackerUnreachableError, match=re.escape(uri)):
        _trainer(MLflowTracker("dew-dead", uri=uri, connect_timeout=2)).fit(dataset(), steps=3)
    assert time.monotonic() - began < 60  # compile included; MLflow's own retries took 251 s


def test_an_address_with_a_password_is_named_without_it():
    from dew.trackers.mlflow import MLflowTracker, TrackerUnreachableError

    port = mlflow_server.free_port()
    tracker = MLflowTracker("dew-dead", uri=f"http://ann:hunter2@127.0.0.1:{port}",
                            connect_timeout=2)
    with pytest.raises(TrackerUnreachableError) as caught:
        tracker.log({"loss": 1.0}, step=1)
    assert f"http://ann:***@127.0.0.1:{port}" in str(caught.value)
    assert "hunter2" not in str(caught.value) and "hunter2" not in repr(tracker)


def test_a_tracker_without_an_address_names_no_store_mlflow_does_not_use(monkeypatch, tmp_path):
    """Its failures were said to be at "./mlruns", which MLflow 3 no longer uses by default
    (its default is a sqlite file): the label names where the address comes from instead."""
    from dew.trackers.mlflow import MLflowTracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert MLflowTracker("dew-default")._channel.where == "MLflowTracker at MLflow's default tracking URI (no uri given, MLFLOW_TRACKING_URI unset)"


def test_a_server_that_never_answers_fails_within_the_connect_timeout():
    from dew.trackers.mlflow import MLflowTracker, TrackerUnreachableError

    with socket.socket() as listener:  # accepts connections (the kernel does) and says nothing
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
        tracker = MLflowTracker("dew-hung", uri=uri, connect_timeout=1.5)
        began = time.monotonic()
        with pytest.raises(TrackerUnreachableError, match=rf"{re.escape(uri)}.*1\.5 s"):
            tracker.log({"loss": 1.0}, step=1)
        assert time.monotonic() - began < 10


class KillAt:
    """A sink that kills the tracking server (SIGKILL) when the run reaches a step."""

    def __init__(self, process, step):
        self.process, self.step = process, step

    def log(self, scalars, step):
        if step == self.step:
            mlflow_server.stop(self.process, signal.SIGKILL)

    def artifact(self, value, step):
        pass

    def close(self):
        pass


@pytest.mark.slow
def test_a_server_killed_mid_run_neither_stops_training_nor_hides_the_loss(tmp_path):
    from mlflow import MlflowClient

    from dew.trackers.mlflow import MLflowTracker

    port = mlflow_server.free_port()
    uri = f"http://127.0.0.1:{port}"
    process = mlflow_server.start(tmp_path, port)
    try:
        tracker = MLflowTracker("dew-outage", run_name="outage", uri=uri, buffer=5)
        steps = 30
        began = time.monotonic()
        with pytest.warns(TrackerWarning, match=re.escape(uri)):
            state = _trainer(Trackers(KillAt(process, 5), tracker)).fit(
                dataset(), steps=steps, log_every=1)
        assert int(state.step) == steps and time.monotonic() - began < 120
        process = mlflow_server.start(tmp_path, port)  # the server comes back
        tracker.close()

        client = MlflowClient(tracking_uri=uri)
        (run,) = client.search_runs([client.get_experiment_by_name("dew-outage").experiment_id])
        assert run.info.run_name == "outage" and run.info.status == "FINISHED"
        logged = {m.step for m in client.get_metric_history(run.info.run_id, "train/loss")}
        (artifact,) = client.list_artifacts(run.info.run_id, "records/tracker_dropped")
        local = Path(client.download_artifacts(run.info.run_id, artifact.path, str(tmp_path)))
        dropped = json.loads(local.read_text())["record"]
        assert dropped["where"] == uri and dropped["reports"] >= steps - 5 - 5
        lost = set(range(dropped["first_step"], dropped["last_step"] + 1))
        assert steps in logged and not logged & lost  # the newest arrived; nothing twice
        assert logged | lost >= set(range(1, steps + 1))  # every step is accounted for
    finally:
        mlflow_server.stop(process)


@pytest.mark.slow
def test_a_resumed_fit_reopens_its_run_and_the_run_ends_as_the_fit_did(server, tmp_path):
    # A resume opened a second run of the same name and left the killed one RUNNING; a failed or
    # preempted fit's run was marked FINISHED.
    from mlflow import MlflowClient

    from dew.telemetry.records import RunStarted
    from dew.trackers.mlflow import MLflowTracker

    def fit(folder, start, stop, outcome):
        # Every fit's recipe names its folder as a shipped recipe does, {timestamp} unexpanded: the run
        # is the one of the folder the fit keeps its checkpoints in (a resume of one run of a recipe
        # reopened the newest run of any, and logged its steps there)
        tracker = MLflowTracker("dew-resumes", "a-run", uri=server)
        tracker.artifact(RunStarted(config={"trainer": {"checkpoint_dir": "runs/{timestamp}"}}, start=start,
                                    steps=10, folder=str(folder)), step=start)
        for step in range(start + 1, stop + 1):
            tracker.log({"loss": float(step)}, step=step)
        tracker.conclude(outcome)
        tracker.close()

    client = MlflowClient(tracking_uri=server)
    fit(tmp_path / "run", 0, 5, "killed")
    experiment = client.get_experiment_by_name("dew-resumes").experiment_id
    (killed,) = client.search_runs([experiment])
    assert killed.info.status == "KILLED"
    fit(tmp_path / "run", 3, 7, "failed")  # resumed from its step-3 checkpoint
    (resumed,) = client.search_runs([experiment])
    assert resumed.info.run_id == killed.info.run_id and resumed.info.status == "FAILED"
    steps = sorted(m.step for m in client.get_metric_history(resumed.info.run_id, "loss"))
    assert steps == [1, 2, 3, 4, 4, 5, 5, 6, 7]  # 4 and 5 trained again, as MLflow keeps both
    fit(tmp_path / "other", 0, 2, "finished")  # another folder: another run
    runs = client.search_runs([experiment], order_by=["attributes.start_time ASC"])
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    assert runs[1].data.tags["dew.checkpoint_dir"] == str(tmp_path / "other")
    fit(tmp_path / "run", 7, 8, "finished")  # the first run again, though "other" started last
    runs = client.search_runs([experiment], order_by=["attributes.start_time ASC"])
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss"))[-1] == 8
    assert sorted(m.step for m in client.get_metric_history(runs[1].info.run_id, "loss")) == [1, 2]


def test_a_resume_that_changes_adds_or_removes_recipe_fields_tags_each_and_keeps_the_first_parameters(
        tmp_path, monkeypatch):
    """A field new to a reopened run was logged as a parameter, so a tracker the resume added read as
    the removed one's fields (trackers.1.name=wandb beside trackers.1.experiment=e2), and a removed
    field left no trace. The parameters stay the first fit's recipe; each difference is a tag."""
    from mlflow import MlflowClient

    from dew.telemetry.records import RunStarted
    from dew.trackers.mlflow import MLflowTracker

    monkeypatch.chdir(tmp_path)  # a SQLite store keeps its artifacts in ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = {"optimizer": {"learning_rate": 0.1}, "trackers": [{"name": "local"}, {"name": "wandb", "project": "p"}]}
    later = {"optimizer": {"learning_rate": 0.2}, "trackers": [{"name": "local"}, {"name": "mlflow",
                                                                                 "experiment": "e2"}]}
    for config, start in ((first, 0), (later, 4)):
        tracker = MLflowTracker("dew-fields", uri=uri)
        tracker.artifact(RunStarted(config=config, start=start, steps=8, folder=str(tmp_path / "run")), start)
        tracker.log({"loss": 1.0}, step=start + 1)
        tracker.close()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dew-fields").experiment_id])
    assert run.data.params == {"optimizer.learning_rate": "0.1", "trackers.0.name": "local",
                               "trackers.1.name": "wandb", "trackers.1.project": "p"}
    resumed = {key: value for key, value in run.data.tags.items() if key.startswith("dew.resumed_at.")}
    assert resumed == {"dew.resumed_at.4.optimizer.learning_rate": "0.2",
                       "dew.resumed_at.4.trackers.1.name": "mlflow",
                       "dew.resumed_at.4.trackers.1.experiment": "e2",
                       "dew.resumed_at.4.trackers.1.project": "<unset>"}
