"""Emergency checkpoints across slices, in a real 2-process pool (jax.distributed over 127.0.0.1): the
processes are replicas of each other (the data axis crosses them, every leaf is split only within a
process), each keeps its local steps on its own disk; when one process's copy of the newest local step
is deleted, the pool still resumes from that step, bit for bit, the lost copy taken from the replica's.
A step whose lost shards no other process holds is still no step of the pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from dew.testing.processes import run_pool

WORKER = r"""
import os, shutil, sys
from pathlib import Path
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

process, root = int(os.environ["JAX_PROCESS_ID"]), Path(sys.argv[1])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=2, process_id=process)

from jax.experimental import multihost_utils
from dew.data.base import DataPartition
from dew.checkpoints.manager import Checkpoints
from dew.training.state import TrainState

devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
# data (the replica axis) across the processes, fsdp within each: both hold the same shards.
replicated = Mesh(np.asarray(devices).reshape(2, 2), ("data", "fsdp"))
# data within each process, fsdp across them: each holds shards the other lacks.
split = Mesh(np.asarray(devices).reshape(2, 2).T, ("data", "fsdp"))

def state_of(offset, mesh):
    def place(array, spec):
        return jax.make_array_from_callback(array.shape, NamedSharding(mesh, spec), lambda index: array[index])
    rng = np.random.default_rng(offset)
    params = {"params": {"w": place(rng.standard_normal((8, 6)).astype(np.float32), P("fsdp")),
                         "b": place(rng.standard_normal(6).astype(np.float32), P())}}
    opt = (place(rng.standard_normal((8, 6)).astype(np.float32), P("fsdp", None)),)
    counter = place(np.asarray(offset, np.int32), P())
    return TrainState(params=params, opt_state=opt, key=place(np.asarray([offset, 7], np.uint32), P()),
                      step=counter, microstep=counter, updates=counter)

def template(mesh):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_of(0, mesh))

def bitwise(restored, expected):
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        assert got.sharding == want.sharding
        for shard, other in zip(got.addressable_shards, want.addressable_shards, strict=True):
            assert shard.index == other.index
            assert np.asarray(shard.data).tobytes() == np.asarray(other.data).tobytes()

mine = DataPartition(share=process, shares=2)

def run(name, mesh):
    local = root / name / f"disk-of-process-{process}"  # nothing shared between the local roots
    checkpoints = Checkpoints(root / name / "shared", keep=3, local_directory=local, local_every=1)
    checkpoints.save(1, state_of(1, mesh), position=f"p{process}@1".encode(), partition=mine, meta={"m": 1})
    for step in (2, 3):
        checkpoints.save(step, state_of(step, mesh), position=f"p{process}@{step}".encode(), partition=mine,
                         meta={"m": step}, local=True)
    checkpoints.close()
    multihost_utils.sync_global_devices(f"{name} saved")
    own = local / f"process-{process}"
    if process == 1:  # its disk lost the newest local step
        shutil.rmtree(own / "3")
    multihost_utils.sync_global_devices(f"{name} lost")
    resumed = Checkpoints(root / name / "shared", keep=3, local_directory=local, local_every=1)
    restored = resumed.restore(template(mesh), partition=mine)
    return resumed, restored, own

checkpoints, restored, own = run("replicas", replicated)
assert restored.step == 3, restored.step
assert restored.meta == {"m": 3} and restored.position == f"p{process}@3".encode()
bitwise(restored.state, state_of(3, replicated))
assert (own / "3").is_dir()  # the copy is committed on process 1's own disk
assert sorted(p.name for p in own.iterdir() if p.name.isdigit()) == ["2", "3"]
# The pool goes on from there: its next local step is written by both processes.
checkpoints.save(4, state_of(4, replicated), position=None, partition=mine, meta={"m": 4}, local=True)
checkpoints.close()
assert (own / "4").is_dir()
print("replica restore ok", flush=True)

checkpoints, restored, own = run("no-replicas", split)
assert restored.step == 2, restored.step  # step 3's shards on process 1 are nowhere else
bitwise(restored.state, state_of(2, split))
assert (own / "3").exists() == (process == 0)  # nothing was copied
checkpoints.close()
print("no replica ok", flush=True)
"""


@pytest.mark.slow
def test_a_process_that_lost_its_local_step_resumes_from_a_replica_s(tmp_path: Path) -> None:
    results = run_pool(WORKER, processes=2, devices=2, args=[str(tmp_path)], timeout=300)
    for index, done in enumerate(results):
        assert done.returncode == 0, f"process {index}:\n{done.stdout}\n{done.stderr[-5000:]}"
        assert done.stdout.splitlines()[-2:] == ["replica restore ok", "no replica ok"], done.stdout
    # Process 1 says where its copy came from; process 0 had nothing to take.
    assert "local step 3 was missing" in results[1].stderr and "copied from process 0" in results[1].stderr
    assert "was missing" not in results[0].stderr
