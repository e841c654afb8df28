"""One writer per checkpoint directory, readers that never harm it, and saves finished at exit: real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dew.checkpoints.errors import CheckpointDirectoryError, CheckpointLeaseHeldError
from dew.checkpoints.lease import LEASE, this_process
from dew.checkpoints.manager import Checkpoints
from dew.data.base import DataPartition
from test_checkpoints_crash import HERE, STATE  # every test folder is on sys.path (conftest.py)

ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")

TRAINER = """
import sys
import jax, jax.numpy as jnp, numpy as np, optax
from flax import linen as nn
from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective

class Wide(Objective):  # about 12 MiB of parameters and Adam state: each save takes a while
    def __init__(self):
        self.model = nn.Dense(features=1024)
    def init(self, key, variables=None):
        return self.model.init(key, jnp.zeros((1, 1024), jnp.float32))
    def loss(self, variables, batch, step):
        errors = (self.model.apply(variables, batch["x"]) - 1.0) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size)), Aux(metrics={})

def stream(partition):
    while True:
        yield {"x": np.ones((4, 1024), np.float32)}

checkpoints = Checkpoints(sys.argv[1], keep=2)
Trainer(Wide(), optax.adam(1e-3), key=jax.random.key(0), checkpoints=checkpoints).fit(
    Dataset(train=stream, batch=4), steps=6, checkpoint_every=1)
checkpoints.close()
print("trained", flush=True)
"""

READER = """
import sys, time
from pathlib import Path
from dew.checkpoints.manager import Checkpoints
directory, stop = sys.argv[1], Path(sys.argv[2])
polls, seen = 0, set()
while not stop.exists():
    latest = Checkpoints(directory).latest
    polls += 1
    if polls == 1:
        print("polling", flush=True)
    if latest is not None:
        seen.add(latest)
    time.sleep(0.02)
print("polls", polls, "seen", sorted(seen), flush=True)
"""

HOLDER = STATE + """
import sys
checkpoints = Checkpoints(sys.argv[1])
checkpoints.save(1, make_state(1, 8), position=b"one", partition=DataPartition(), meta={})
checkpoints.wait()
print("holding", flush=True)
sys.stdin.read()  # until the test closes our stdin
checkpoints.close()
print("released", flush=True)
"""


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _popen(script: Path, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, **kwargs)


def _save(directory: Path, step: int, width: int = 8) -> Checkpoints:
    checkpoints = Checkpoints(directory)
    checkpoints.save(step, HERE["make_state"](step, width), position=f"at {step}".encode(),
                     partition=DataPartition(), meta={})
    checkpoints.wait()
    return checkpoints


@pytest.mark.slow
def test_a_reader_polling_every_20_ms_never_harms_the_writer(tmp_path: Path) -> None:
    directory, stop = tmp_path / "run", tmp_path / "stop"
    reader = _popen(_script(tmp_path, "reader.py", READER), str(directory), str(stop))
    assert reader.stdout is not None and reader.stdout.readline().strip() == "polling"  # before training
    trainer = _popen(_script(tmp_path, "trainer.py", TRAINER), str(directory))
    try:
        out, err = trainer.communicate(timeout=300)
    finally:
        stop.touch()
        reader_out, reader_err = reader.communicate(timeout=60)
    assert trainer.returncode == 0 and out.strip().endswith("trained"), err[-3000:]
    assert reader.returncode == 0, reader_err[-3000:]
    polls = int(reader_out.split()[1])  # the first line ("polling") was read above
    assert polls >= 20, reader_out  # the reader really was polling while the trainer saved
    assert sorted(p.name for p in directory.iterdir()) == ["5", "6"]  # no lease, no half-written step left
    checkpoints = Checkpoints(directory)
    assert checkpoints.latest == 6
    assert checkpoints.meta()["accumulation"] == 1


def test_a_second_writer_is_refused_naming_the_first(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    holder = _popen(_script(tmp_path, "holder.py", HOLDER), str(directory), stdin=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        # Reading a directory someone writes is fine.
        assert Checkpoints(directory).latest == 1
        second = Checkpoints(directory)
        with pytest.raises(CheckpointLeaseHeldError) as caught:
            second.save(2, HERE["make_state"](2, 8), position=None, partition=DataPartition(), meta={})
        message = str(caught.value)
        assert f"process {holder.pid} on host {socket.gethostname()!r}" in message, message
        assert str(directory / LEASE) in message
        assert not (directory / "2").exists() and not second.writing
        out, err = holder.communicate(input="", timeout=120)
        assert holder.returncode == 0 and "released" in out, err[-3000:]
    finally:
        if holder.poll() is None:
            holder.kill()
    assert not (directory / LEASE).exists()
    _save(directory, 2).close()  # once the first writer is gone, the second may write
    assert Checkpoints(directory).latest == 2


def test_a_lease_left_by_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    holder = _popen(_script(tmp_path, "holder.py", HOLDER), str(directory), stdin=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    assert json.loads((directory / LEASE).read_text())["pid"] == holder.pid  # left behind by kill -9
    checkpoints = _save(directory, 2)
    assert json.loads((directory / LEASE).read_text())["pid"] == os.getpid()
    checkpoints.close()
    assert not (directory / LEASE).exists()
    restored = Checkpoints(directory).restore(HERE["template"](HERE["make_state"](0, 8)), partition=DataPartition())
    assert restored.step == 2 and HERE["same"](restored.state, HERE["make_state"](2, 8))


def _plant(directory: Path, **fields) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    me = this_process()
    lease = {"host": me.host, "pid": me.pid, "start": me.start, "taken": time.time(), **fields}
    (directory / LEASE).write_text(json.dumps(lease))


def test_a_reused_process_id_does_not_hold_the_lease(tmp_path: Path) -> None:
    """Same host, a live process with the recorded id, but started at another time: the holder is gone."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        _plant(tmp_path, pid=child.pid, start="another-boot/12345")
        _save(tmp_path, 1).close()
    finally:
        child.communicate(input=b"", timeout=30)
    assert Checkpoints(tmp_path).latest == 1


def test_a_lease_from_another_host_is_never_taken_over(tmp_path: Path) -> None:
    _plant(tmp_path, host="elsewhere.example", pid=4242, start="b/1")
    with pytest.raises(CheckpointLeaseHeldError, match=r"process 4242 on host 'elsewhere.example'.*delete .*"
                                                   + LEASE.replace(".", r"\.")):
        _save(tmp_path, 1)
    (tmp_path / LEASE).unlink()  # as the message says, once that process is known to be gone
    _save(tmp_path, 1).close()


EXIT = STATE + """
import sys
directory, how = sys.argv[1], sys.argv[2]
checkpoints = Checkpoints(directory, keep=1)
checkpoints.save(1, make_state(1, 16), position=b"one", partition=DataPartition(), meta={})
checkpoints.wait()
if how == "failing":  # the background write of step 2 fails where dew records it
    import dew.checkpoints.integrity as integrity
    def broken(*args, **kwargs):
        raise OSError("simulated write failure")
    integrity.file_table = broken
checkpoints.save(2, make_state(2, 1024), position=b"two", partition=DataPartition(), meta={})
print("handed over", flush=True)
# no wait(), no close(): the interpreter exits with the save in flight
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["finishing", "failing"])
def test_a_save_in_flight_at_exit_is_finished_or_abandoned_loudly(tmp_path: Path, how: str) -> None:
    directory = tmp_path / "run"
    child = subprocess.run([sys.executable, str(_script(tmp_path, "exit.py", EXIT)), str(directory), how],
                           capture_output=True, text=True, env=ENV, timeout=240)
    assert "handed over" in child.stdout, child.stderr[-3000:]
    assert f"dew: finishing checkpoint step 2 in {directory} before exit." in child.stderr, child.stderr[-3000:]
    checkpoints = Checkpoints(directory, fallback=False)
    if how == "finishing":
        assert child.returncode == 0, child.stderr[-3000:]
        assert f"dew: checkpoint step 2 in {directory} committed." in child.stderr
        width, step, position = 1024, 2, b"two"
    else:
        assert f"dew: abandoned checkpoint step 2 in {directory} at exit" in child.stderr, child.stderr[-3000:]
        assert "simulated write failure" in child.stderr and "step 1 is intact" in child.stderr
        width, step, position = 16, 1, b"one"
    assert checkpoints.latest == step
    restored = checkpoints.restore(HERE["template"](HERE["make_state"](0, width)), partition=DataPartition())
    assert (restored.step, restored.position) == (step, position)
    assert HERE["same"](restored.state, HERE["make_state"](step, width))
    assert not (directory / LEASE).exists()


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_directory_that_is_a_file_is_refused_naming_it_and_the_file_is_kept(tmp_path: Path, under: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("a user's file\n")
    directory = afile / under if under else afile
    checkpoints = Checkpoints(directory)
    with pytest.raises(CheckpointDirectoryError, match=rf"{directory} cannot be used: it, or a folder above it, is a file"):
        checkpoints.latest  # noqa: B018 - the first look at the directory
        checkpoints.acquire()
    assert afile.read_text() == "a user's file\n"


def test_a_folder_where_the_lease_goes_is_named_and_kept(tmp_path: Path) -> None:
    folder = tmp_path / "run" / LEASE
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("a user's file\n")
    with pytest.raises(CheckpointDirectoryError, match=rf"cannot be used: {LEASE} in it is a folder where dew "
                                                       "keeps a file; move that folder away"):
        Checkpoints(tmp_path / "run").acquire()
    assert (folder / "notes.txt").read_text() == "a user's file\n"


def test_a_full_disk_while_taking_the_lease_is_named_and_leaves_no_empty_lease(tmp_path: Path, monkeypatch) -> None:
    import errno

    from dew.checkpoints import lease

    def full(descriptor: int, data: bytes) -> int:  # a fault this machine cannot cause on its own disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lease.os, "write", full)
    with pytest.raises(CheckpointDirectoryError, match=r"cannot be used: its disk is full"):
        Checkpoints(tmp_path / "run").acquire()
    assert not (tmp_path / "run" / LEASE).exists()
    monkeypatch.undo()
    held = Checkpoints(tmp_path / "run")
    held.acquire()  # with room again, the run takes its directory
    assert json.loads((tmp_path / "run" / LEASE).read_text())["pid"] == os.getpid()
    held.close()


def test_a_writer_dropped_without_close_lets_go_of_its_lease(tmp_path):
    """A notebook's Trainer deleted after fit kept the directory's lease for as long as the kernel
    lived: `dew train` from a terminal was refused it as written by that process."""
    import gc

    from dew.checkpoints import lease as leases

    writer = Checkpoints(tmp_path)
    writer.acquire()
    assert leases.holds(tmp_path) and (tmp_path / leases.LEASE).is_file()
    del writer
    gc.collect()
    assert not leases.holds(tmp_path) and not (tmp_path / leases.LEASE).exists()
    closed = Checkpoints(tmp_path)  # closed first: the lease is let go of once, not again when collected
    closed.acquire()
    other = Checkpoints(tmp_path)  # a second holder in this process keeps it
    other.acquire()
    closed.close()
    del closed
    gc.collect()
    assert leases.holds(tmp_path) and (tmp_path / leases.LEASE).is_file()
    other.close()
    assert not (tmp_path / leases.LEASE).exists()
