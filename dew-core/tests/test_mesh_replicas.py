"""replicas: a hybrid mesh over a real pool of 2 processes x 4 CPU devices (gloo over loopback).

Each process is one granule (every CPU device shares one slice), so
replicas=2 gives each process one data-parallel group with fsdp inside it.
The losses must be those of one device training the same model on the same
batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dew.testing.processes import free_port

MODEL = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.testing.doubles import NextToken, RecordingTracker
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec

ROWS = 16

def LM():  # the next-token cross entropy of a tiny decoder, dew.testing's double
    return NextToken(CausalTransformer(vocab_size=32, emb_features=16, num_layers=2, num_heads=2,
                                       mlp_features=32, max_seq_len=8))

def batches(partition):
    step = 0
    while True:
        rows = np.random.default_rng(step).integers(0, 32, size=(ROWS, 9)).astype(np.int32)
        share = ROWS // partition.shares
        yield {"text": rows[partition.share * share:(partition.share + 1) * share]}
        step += 1


def train(spec):
    log = RecordingTracker()
    trainer = Trainer(LM(), optax.adamw(1e-2), key=jax.random.key(0), mesh=MeshSpec(**spec),
                      layout=Layout(min_shard=0, tolerance=1.0), tracker=log)
    state = trainer.fit(Dataset(train=batches, batch=ROWS), steps=10, log_every=1)
    return trainer, state, log.values("train/loss")
"""

WORKER = r"""
import sys
process, port = int(sys.argv[1]), sys.argv[2]
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
""" + MODEL + r"""
trainer, state, losses = train({"replicas": 2, "fsdp": 4})
mesh = trainer.device_mesh
grid = mesh.devices
data, fsdp = mesh.axis_names.index("data"), mesh.axis_names.index("fsdp")
owners = np.vectorize(lambda d: d.process_index)(grid)
# fsdp stays inside one process; the data axis crosses them.
inside = bool((np.moveaxis(owners, fsdp, -1) == np.moveaxis(owners, fsdp, -1)[..., :1]).all())
across = sorted(set(np.moveaxis(owners, data, 0).reshape(mesh.shape["data"], -1)[:, 0].tolist()))
kernel = state.params["params"]["layers_0"]["mlp"]["wi"]
print("RESULT" + json.dumps({"losses": losses, "shape": dict(mesh.shape), "inside": inside,
                             "across": across, "spec": str(kernel.sharding.spec)}), flush=True)
"""


def _result(out: str) -> dict:
    return json.loads(next(x for x in out.splitlines() if x.startswith("RESULT"))[len("RESULT"):])


@pytest.mark.slow
def test_replicas_in_a_two_process_pool_match_one_device(tmp_path: Path, python_in_subprocess) -> None:
    single = _result(python_in_subprocess(MODEL + '\nprint("RESULT" + json.dumps({"losses": train({})[2]}))',
                                          devices=1))["losses"]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    # A device thread can wait past XLA:CPU's 40 s collective deadline on a loaded machine.
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4 "
                         "--xla_cpu_collective_call_terminate_timeout_seconds=600")
    workers = [subprocess.Popen([sys.executable, str(script), str(index), port], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env) for index in range(2)]
    results = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=900)
            results.append((worker.returncode, out, err))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for index, (code, out, err) in enumerate(results):
        assert code == 0, f"process {index}: {err[-4000:]}"
        result = _result(out)
        if index == 0:  # the trainer reports on process 0
            assert result["losses"] == pytest.approx(single, abs=1e-5, rel=1e-5)
        assert result["shape"]["data"] == 2 and result["shape"]["fsdp"] == 4
        assert result["inside"] and result["across"] == [0, 1]
        assert "fsdp" in result["spec"]


def test_replicas_that_do_not_divide_the_granules_are_refused(python_in_subprocess) -> None:
    out = python_in_subprocess(r"""
from dew.training.placement.mesh import MeshSpec, ReplicaError, build_mesh
try:
    build_mesh(MeshSpec(replicas=2))
except ReplicaError as error:
    print("REFUSED", error)
""", devices=4)
    assert "replicas=2" in out and "1 granules" in out and "process_index" in out
