"""A SIGTERM while a fit places its state, with its Grain stream already started (worker
processes spawned, the first batch read), ends the process by the signal as before, and the
stream's worker processes with it: the fit closes the stream first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dew.testing.processes import device_env

SIGTERM_WHILE_PLACING = """
import os, signal, sys, threading, time
from absl import flags
flags.FLAGS(sys.argv[:1])
import jax, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.data.sources import ArrayRecords
from dew.data.stream import train_stream
from dew.testing.doubles import Linear, WatchedStream

READ = threading.Event()  # set when the Grain stream (one worker process) yields its first batch

def children():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == os.getpid():
            found.append(pid)
    return found

if __name__ == "__main__":
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    source = ArrayRecords({"x": x, "y": x.sum(axis=1, keepdims=True)})
    def train(partition):
        return WatchedStream(train_stream(source, batch=8, partition=partition, workers=1),
                             lambda batch: READ.set())
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0))
    def place():
        assert READ.wait(180), "the first batch was never read"
        with open(sys.argv[1], "w") as handle:  # a file: orphans would hold a pipe open
            handle.write(" ".join(children()))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("SURVIVED", flush=True)
    trainer.place = place
    trainer.fit(Dataset(train=train, val=None, batch=8), steps=2)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_sigterm_while_placing_ends_the_streams_grain_workers_with_the_process(tmp_path):
    listed = tmp_path / "workers"
    script = tmp_path / "run.py"
    script.write_text(SIGTERM_WHILE_PLACING)
    with (tmp_path / "out").open("w+") as out:
        child = subprocess.Popen([sys.executable, str(script), str(listed)], stdout=out, stderr=subprocess.STDOUT,
                                 env=device_env(1))
        try:
            returncode = child.wait(timeout=240)
        finally:
            if child.poll() is None:
                child.kill()
        out.seek(0)
        printed = out.read()
    workers = [int(pid) for pid in listed.read_text().split()] if listed.exists() else []
    try:
        assert workers, f"the stream started no worker process: {printed[-3000:]}"
        assert returncode == -signal.SIGTERM, (returncode, printed[-3000:])  # ended by the signal, as before
        assert "SURVIVED" not in printed
        deadline = time.monotonic() + 20
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, workers)), "Grain's worker processes outlived the run"
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
