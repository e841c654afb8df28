"""Checkpoints in a real 2-process pool on CPU (jax.distributed over loopback, gloo collectives)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dew.testing.processes import free_port

WORKER = r"""
import sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

process, port, directory, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)

from dew.data.base import DataPartition
from dew.checkpoints.errors import CheckpointDirectoryNotSharedError, PositionShareMismatchError
from dew.checkpoints.manager import Checkpoints
from dew.training.state import TrainState

mesh = jax.make_mesh((4,), ("data",))
values = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.arange(8, dtype=np.float32)}

def place(array, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

def state_of(offset):
    params = {"params": {"w": place(values["w"] + offset, P("data")), "b": place(values["b"] + offset, P())}}
    counter = place(np.asarray(offset, np.int32), P())
    key = place(np.asarray([offset, 7], np.uint32), P())
    return TrainState(params=params, opt_state=(), key=key, step=counter, microstep=counter, updates=counter)

if mode == "unshared":
    try:
        Checkpoints(f"{directory}/process-{process}").latest
    except CheckpointDirectoryNotSharedError as error:
        print("refused:", error, flush=True)
        sys.exit(3)
    sys.exit(0)

mine = DataPartition(share=process, shares=2)
checkpoints = Checkpoints(directory, keep=2)
if mode == "held":  # another live process holds the writer's lease: every process is refused
    from dew.checkpoints.errors import CheckpointLeaseHeldError
    try:
        checkpoints.save(1, state_of(1), position=None, partition=mine, meta={})
    except CheckpointLeaseHeldError as error:
        print("refused:", error, flush=True)
        sys.exit(4)
    sys.exit(0)
for step in (1, 2, 3):
    checkpoints.save(step, state_of(step), position=f"share {process} at {step}".encode(), partition=mine,
                     meta={"accumulation": 1})
checkpoints.wait()
assert checkpoints.latest == 3
import json, os
from pathlib import Path
from jax.experimental import multihost_utils
first = int(multihost_utils.broadcast_one_to_all(np.int32(os.getpid())))
print("lease held by", json.loads((Path(directory) / ".dew-writer.json").read_text())["pid"], "process 0 is", first,
      flush=True)

template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_of(0))
restored = Checkpoints(directory).restore(template, partition=mine)
assert restored.step == 3 and restored.meta == {"accumulation": 1}
assert restored.position == f"share {process} at 3".encode(), restored.position
expected = state_of(3)
for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(expected)):
    assert got.sharding == want.sharding
    for shard, other in zip(got.addressable_shards, want.addressable_shards):
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(other.data))
try:
    checkpoints.restore(template, partition=DataPartition())
except PositionShareMismatchError as error:
    assert "shares [0, 1] of 2" in str(error), error
else:
    raise AssertionError("a single-share restore of two shares' positions was accepted")
checkpoints.close()
print("restored", process, sorted(p.name for p in __import__("pathlib").Path(directory).iterdir()), flush=True)
"""


def _pool(tmp_path: Path, mode: str) -> list[tuple[int, str, str]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    workers = [
        subprocess.Popen([sys.executable, str(script), str(index), port, str(tmp_path / "run"), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for index in range(2)
    ]
    results = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=240)
            results.append((worker.returncode, out, err))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    return results


@pytest.mark.slow
def test_two_processes_write_their_shards_and_process_0_commits(tmp_path: Path) -> None:
    results = _pool(tmp_path, "shared")
    for index, (code, out, err) in enumerate(results):
        assert code == 0, f"process {index}: {err[-4000:]}"
        assert out.strip().splitlines()[-1] == f"restored {index} ['2', '3']"
        holder, first = workers_pid(out)
        assert holder == first, out  # in a pool, process 0 holds the writer's lease
    manifest = (tmp_path / "run" / "3" / "state").iterdir()
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in manifest}


def workers_pid(out: str) -> tuple[int, int]:
    """The (lease holder, process 0) pids a worker printed."""
    words = next(line for line in out.splitlines() if line.startswith("lease held by")).split()
    return int(words[3]), int(words[-1])


@pytest.mark.slow
def test_every_process_is_refused_a_directory_another_process_writes(tmp_path: Path) -> None:
    from dew.checkpoints.lease import LEASE, this_process

    (tmp_path / "run").mkdir()
    me = this_process()
    (tmp_path / "run" / LEASE).write_text(json.dumps({"host": me.host, "pid": me.pid, "start": me.start}))
    for code, out, err in _pool(tmp_path, "held"):
        assert code == 4, err[-4000:]
        assert f"refused: {tmp_path / 'run'} is being written by process {me.pid}" in out, out
    assert not [p for p in (tmp_path / "run").iterdir() if p.name != LEASE]


@pytest.mark.slow
def test_every_process_refuses_a_directory_it_cannot_see(tmp_path: Path) -> None:
    for code, out, err in _pool(tmp_path, "unshared"):
        assert code == 3, err[-4000:]
        assert "refused: Processes [1] cannot see the probe file process 0 wrote into" in out
