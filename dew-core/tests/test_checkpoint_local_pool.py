"""Local emergency checkpoints in a real 2-process pool (jax.distributed over 127.0.0.1): each process
writes its own shards into its own local directory (a separate folder per process, as separate disks
would be), the pool restores a local step only when every process holds it and only into the
placement that saved it, and falls back to the shared persistent step otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dew.testing.processes import free_port

WORKER = r"""
import sys
from pathlib import Path
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

process, port, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)

from jax.experimental import multihost_utils
from dew.data.base import DataPartition
from dew.checkpoints.local import LocalPlacementMismatchError
from dew.checkpoints.manager import Checkpoints
from dew.training.state import TrainState

mesh = jax.make_mesh((4,), ("data",))
w = np.arange(64, dtype=np.float32).reshape(8, 8)

def place(array, spec):
    return jax.make_array_from_callback(array.shape, NamedSharding(mesh, spec), lambda index: array[index])

def state_of(offset, spec=P("data")):
    params = {"params": {"w": place(w + offset, spec), "b": place(np.arange(8, dtype=np.float32) + offset, P())}}
    counter = place(np.asarray(offset, np.int32), P())
    return TrainState(params=params, opt_state=(), key=place(np.asarray([offset, 7], np.uint32), P()),
                      step=counter, microstep=counter, updates=counter)

def template(spec=P("data")):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_of(0, spec))

def same(restored, expected):
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        assert got.sharding == want.sharding
        for shard, other in zip(got.addressable_shards, want.addressable_shards):
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(other.data))

mine = DataPartition(share=process, shares=2)
local = root / f"disk-of-process-{process}"  # nothing shared between the processes' local roots
checkpoints = Checkpoints(root / "shared", keep=2, local_directory=local, local_every=1)
checkpoints.save(1, state_of(1), position=f"p{process}@1".encode(), partition=mine, meta={"m": 1})
checkpoints.save(2, state_of(2), position=f"p{process}@2".encode(), partition=mine, meta={"m": 2}, local=True)
checkpoints.wait()
assert checkpoints.latest == 2
own = local / f"process-{process}"
assert sorted(p.name for p in own.iterdir() if p.name.isdigit()) == ["2"], list(own.iterdir())
assert not (root / "shared" / "2").exists()
held = sorted(p.name for p in (own / "2" / "state").iterdir() if p.name.startswith("ocdbt.process_"))
assert held == [f"ocdbt.process_{process}"], held  # this process's shards only

restored = checkpoints.restore(template(), partition=mine)
assert restored.step == 2 and restored.meta == {"m": 2} and restored.position == f"p{process}@2".encode()
same(restored.state, state_of(2))
print("local restore ok", flush=True)

# Another placement (w replicated instead of split): the local step is skipped, step 1 restores.
other = checkpoints.restore(template(P()), partition=mine)
assert other.step == 1 and other.position == f"p{process}@1".encode()
same(other.state, state_of(1, P()))
try:
    checkpoints.restore(template(P()), partition=mine, step=2)
except LocalPlacementMismatchError as error:
    assert "same processes, mesh and layout" in str(error), error
else:
    raise AssertionError("a local step was read into another placement")
print("placement limit ok", flush=True)

# A local step that one process lacks (its disk lost it) is no step of the pool.
checkpoints.save(3, state_of(3), position=None, partition=mine, meta={"m": 3}, local=True)
checkpoints.wait()
multihost_utils.sync_global_devices("saved 3")
if process == 1:
    import shutil
    shutil.rmtree(own / "3")
multihost_utils.sync_global_devices("lost 3")
assert checkpoints.latest == 2, checkpoints.latest
assert checkpoints.restore(template(), partition=mine).step == 2
checkpoints.close()
print("agreement ok", flush=True)
"""


@pytest.mark.slow
def test_a_pool_keeps_local_steps_on_each_process_s_own_disk(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    workers = [subprocess.Popen([sys.executable, str(script), str(index), port, str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
               for index in range(2)]
    try:
        results = [worker.communicate(timeout=300) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for index, (worker, (out, err)) in enumerate(zip(workers, results, strict=True)):
        assert worker.returncode == 0, f"process {index}:\n{out}\n{err[-5000:]}"
        assert out.splitlines()[-3:] == ["local restore ok", "placement limit ok", "agreement ok"], out
    assert "holds the shards of another placement" in results[0][1]
