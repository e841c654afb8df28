"""Sharded training gives the single-device numbers: 8 fake CPU devices in a subprocess."""

from __future__ import annotations

import json

import pytest

PROGRAM = r"""
import json, sys
import jax, optax
from dew import Trainer
from dew.data import Dataset
from dew.testing.doubles import NextToken, RecordingTracker, TokenMLP, token_batches
from dew.training.placement.layout import Layout, LayoutError
from dew.training.placement.mesh import MeshSpec

def LM():
    return NextToken(TokenMLP())  # dew.testing's smallest sharded language model and its loss


out = {}
for name, spec in json.loads(sys.argv[1]).items():
    losses = RecordingTracker()
    trainer = Trainer(LM(), optax.adamw(1e-2), key=jax.random.key(0), mesh=MeshSpec(**spec),
                      layout=Layout(min_shard=0, tolerance=0.25), tracker=losses)
    state = trainer.fit(Dataset(train=token_batches, batch=16), steps=6, log_every=1)
    kernel = state.params["params"]["Dense_0"]["kernel"]
    out[name] = {"losses": losses.values("train/loss"), "spec": str(kernel.sharding.spec),
                 "shard": list(kernel.addressable_shards[0].data.shape)}
print("RESULT" + json.dumps(out))
"""

SPLITS = {
    "fsdp4_tensor2": {"fsdp": 4, "tensor": 2},
    "fsdp8": {"fsdp": 8},
    "data2_fsdp2_tensor2": {"fsdp": 2, "tensor": 2},
    "tensor2": {"tensor": 2},
    "expert2_fsdp4": {"expert": 2, "fsdp": 4},
}


def run(python_in_subprocess, splits, devices):

    stdout = python_in_subprocess(
        f"import sys; sys.argv = ['x', {json.dumps(json.dumps(splits))}]\n" + PROGRAM,
        devices=devices,
    )
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.slow
def test_sharded_training_matches_one_device(python_in_subprocess):
    single = run(python_in_subprocess, {"one": {}}, devices=1)["one"]["losses"]
    sharded = run(python_in_subprocess, SPLITS, devices=8)
    for name, result in sharded.items():
        assert result["losses"] == pytest.approx(single, rel=2e-5), name
    # The parameters really are split: fsdp on embed, tensor on mlp.
    assert sharded["fsdp4_tensor2"]["spec"] == "P('fsdp', 'tensor')"
    assert sharded["fsdp4_tensor2"]["shard"] == [4, 32]
    assert sharded["fsdp8"]["shard"] == [2, 64]


LAYOUT_CHECK = r"""
import jax, jax.numpy as jnp, optax
from flax import linen as nn
from dew import Trainer
from dew.objectives.base import Objective
from dew.training.placement.layout import Layout, LayoutError
from dew.training.placement.mesh import MeshSpec, build_mesh

class Odd(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(7, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "mlp")))(x)

class O(Objective):
    def init(self, key, variables=None):
        return Odd().init(key, jnp.zeros((1, 5)))

trainer = Trainer(O(), optax.sgd(0.1), key=jax.random.key(0), mesh=MeshSpec(fsdp=4, tensor=2),
                  layout=Layout(min_shard=0))
try:
    trainer.place()
except LayoutError as error:
    print("REFUSED", error)
"""


def test_a_layout_that_replicates_too_much_is_refused(python_in_subprocess):
    stdout = python_in_subprocess(LAYOUT_CHECK, devices=8)
    assert "REFUSED" in stdout and "tolerance 2.0%" in stdout and "kernel" in stdout


PARTITION = r"""
import jax
from dew.training.placement.mesh import MeshSpec, build_mesh, data_partition
print(data_partition(build_mesh(MeshSpec(fsdp=2, tensor=2))))
"""


def test_one_process_reads_the_whole_batch(python_in_subprocess):
    stdout = python_in_subprocess(PARTITION, devices=8)
    assert "DataPartition(share=0, shares=1, reader=0, readers=1)" in stdout
