"""MLflowTracker against a real tracking server on loopback (SQLite backend), read back
with MLflow's own client."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dew.telemetry.artifacts import Artifact
from dew.telemetry.records import Goodput

pytest.importorskip("mlflow")

START_TIMEOUT = 240.0  # a cold server on a busy 2-core machine took ~60 s


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    environment = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(root / "server.log", "w")  # noqa: SIM115
    process = subprocess.Popen(
        [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        cwd=root, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    probe = f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"mlflow server exited with {process.returncode}:\n"
                            + (root / "server.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(probe, timeout=30) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not answer within {START_TIMEOUT:.0f} s:\n"
                            + (root / "server.log").read_text()[-3000:])
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


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
