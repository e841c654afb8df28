"""A real `mlflow server` on 127.0.0.1 for the tracker tests: started, killed and restarted
on the same port and SQLite store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dew.testing.processes import free_port  # noqa: F401 - the tests take it from here

START_TIMEOUT = 240.0  # a cold server on a busy 2-core machine took ~60 s


def start(root: Path, port: int) -> subprocess.Popen:
    """Start a server over root's SQLite store and artifacts; return once it answers."""
    mlflow = Path(sys.executable).with_name("mlflow")
    environment = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(root / "server.log", "a")  # noqa: SIM115 - closed with the process's output
    process = subprocess.Popen(
        [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        cwd=root, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True,
    )
    log.close()
    probe = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if process.poll() is not None:
            pytest.fail(f"mlflow server exited with {process.returncode}:\n"
                        + (root / "server.log").read_text()[-3000:])
        try:
            with urllib.request.urlopen(probe, timeout=30) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop(process)
            pytest.fail(f"mlflow server did not answer within {START_TIMEOUT:.0f} s:\n"
                        + (root / "server.log").read_text()[-3000:])
        time.sleep(0.5)


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal the server's process group and wait for it (SIGKILL after 20 s)."""
    if process.poll() is None:
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
