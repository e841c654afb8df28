"""Which mesh axes split a batch's rows: data, fsdp and expert; not tensor. On 8 fake CPU devices.

The spec says two things. build_mesh: "Parameters shard over 'fsdp',
'expert' and 'tensor', batches over the first four with their sequence
dimension on 'sequence'"; data_partition: "A batch's rows split over the
batch axes and no others (BATCH_SPEC): the sequence axis splits positions,
the tensor axis widths". dew keeps the second: the devices of one tensor
group compute different widths of the same rows, so they must hold the same
rows. This test shows what a fourth batch axis (tensor) would break: a
tensor-parallel run whose global batch has fewer rows than its devices,
which three axes train (to the numbers of a hand-written single-device
loop) and four cannot even place. It also runs the undeclared-leaf
heuristic end to end: the model's kernel names no axes and is split over
tensor and fsdp.
"""

from __future__ import annotations

import json

import pytest

PROGRAM = r"""
import json

import pytest
import jax, jax.numpy as jnp, numpy as np, optax
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P
from dew import Trainer
from dew.data import Dataset
from dew.objectives.base import Aux, Mean, Objective
from dew.testing.doubles import RecordingTracker
from dew.training.placement.mesh import BATCH_AXES, MeshSpec, batch_shardings, build_mesh

class Net(nn.Module):  # a kernel with no logical axes: the layout's heuristic places it
    @nn.compact
    def __call__(self, x):
        return nn.Dense(256, use_bias=False)(x)

class Fit(Objective):
    def init(self, key, variables=None):
        return Net().init(key, jnp.zeros((1, 256)))
    def loss(self, variables, batch, step):
        errors = (jnp.tanh(Net().apply(variables, batch["x"])) - batch["y"]) ** 2
        return Mean(errors.sum(), jnp.asarray(errors.size, jnp.float32)), Aux()

def batch(step):
    rng = np.random.default_rng(step)
    return {"x": rng.normal(size=(2, 256)).astype(np.float32),
            "y": rng.uniform(-0.5, 0.5, size=(2, 256)).astype(np.float32)}

def train(partition):
    step = 0
    while True:
        yield batch(step)
        step += 1

spec = MeshSpec(fsdp=2, tensor=4)  # 8 devices, data=1: rows split 2 ways, widths 4 ways
losses = RecordingTracker()
trainer = Trainer(Fit(), optax.adam(1e-2), key=jax.random.key(0), mesh=spec, tracker=losses)
start, _, _ = trainer.place()
first = jax.device_get(start.params)
state = trainer.fit(Dataset(train=train, batch=2), steps=3, log_every=1)
kernel = state.params["params"]["Dense_0"]["kernel"]

# The same three steps by hand, on one device: plain jax.grad and optax.
def loss(params, b):
    errors = (jnp.tanh(Net().apply(params, b["x"])) - b["y"]) ** 2
    return errors.sum() / errors.size
optimizer, params = optax.adam(1e-2), first
opt_state, reference = optimizer.init(params), []
for step in range(3):
    value, grads = jax.value_and_grad(loss)(params, batch(step))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params, reference = optax.apply_updates(params, updates), reference + [float(value)]

mesh = trainer.device_mesh
rows = batch_shardings(mesh, batch(0))["x"].spec
long = build_mesh(MeshSpec(fsdp=2, sequence=2, tensor=2))
positions = batch_shardings(long, {"text": np.zeros((4, 8), np.int32)})["text"].spec
try:  # the batch as four batch axes would place it
    jax.device_put(batch(0)["x"], NamedSharding(mesh, P((*BATCH_AXES, "tensor"))))
    four = "placed"
except ValueError as error:
    four = str(error)
print("RESULT" + json.dumps({
    "losses": losses.values("train/loss"), "reference": reference, "kernel": str(kernel.sharding.spec),
    "shard": list(kernel.addressable_shards[0].data.shape), "rows": str(rows),
    "positions": str(positions), "four": four}))
"""


@pytest.mark.slow
def test_batch_rows_split_over_three_axes_and_a_fourth_would_refuse_tensor_parallel_batches(
        python_in_subprocess):
    out = python_in_subprocess(PROGRAM, devices=8)
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[6:])
    # Three batch axes: two rows train on 8 devices, as one device trains them.
    assert len(result["losses"]) == 3
    for got, want in zip(result["losses"], result["reference"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (result["losses"], result["reference"])
    assert result["rows"] == "P(('data', 'fsdp', 'expert'),)"
    assert result["positions"] == "P(('data', 'fsdp', 'expert'), 'sequence')"
    # The undeclared kernel: the largest axis (tensor=4) on one dimension, fsdp on the other.
    assert result["kernel"] == "P('tensor', 'fsdp')" and result["shard"] == [64, 128]
    # A fourth batch axis (tensor) asks 2 rows to split 8 ways, which no placement can.
    assert result["four"] != "placed" and "partitioned 8 times, but the dimension size is 2" in result["four"], result["four"]
