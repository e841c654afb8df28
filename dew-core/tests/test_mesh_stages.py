"""Pipeline stages: a scanned stack split over the 'stage' axis gives the single-device losses.

Every run trains the same scanned CausalTransformer from the same key on the
same batches; the reference is one device running the stack as a plain scan.
"""

from __future__ import annotations

import json

import pytest

COMMON = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.testing.doubles import NextToken, RecordingTracker
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec

ROWS = 32

class LM(NextToken):  # the next-token cross entropy of a scanned decoder, dew.testing's double
    def __init__(self, layers=4):
        super().__init__(CausalTransformer(vocab_size=32, emb_features=16, num_layers=layers,
                                           num_heads=2, mlp_features=32, max_seq_len=8,
                                           position_embedding="rotary", mlp_activation="swiglu",
                                           scan_layers=True))

class Stream:
    def __init__(self, partition):
        self.partition, self.index = partition, 0
    def __iter__(self):
        return self
    def __next__(self):
        rows = np.random.default_rng(self.index).integers(0, 32, size=(ROWS, 9)).astype(np.int32)
        self.index += 1
        share = ROWS // self.partition.shares
        return {"text": rows[self.partition.share * share:(self.partition.share + 1) * share]}
    def get_state(self):
        return str(self.index).encode()
    def set_state(self, state):
        self.index = int(state.decode())

data = Dataset(train=Stream, batch=ROWS)


def train(spec, steps=10, checkpoints=None, layers=4):
    log = RecordingTracker()
    trainer = Trainer(LM(layers), optax.adamw(1e-2), key=jax.random.key(0), mesh=MeshSpec(**spec),
                      layout=Layout(min_shard=0, tolerance=1.0), tracker=log,
                      checkpoints=checkpoints)
    state = trainer.fit(data, steps=steps, log_every=1, checkpoint_every=5 if checkpoints else None)
    return trainer, state, log
"""

PROGRAM = COMMON + r"""
out = {}
for name, spec in json.loads(sys.argv[1]).items():
    trainer, state, log = train(spec)
    kernel = state.params["params"]["layers"]["mlp"]["wi"]
    out[name] = {"losses": log.values("train/loss"),
                 "bubble": [r.get("train/pipeline_bubble") for _, r in log.rows][-1],
                 "spec": str(kernel.sharding.spec), "sites": list(trainer.bank_sites),
                 "shard": list(kernel.addressable_shards[0].data.shape)}
print("RESULT" + json.dumps(out))
"""

SPLITS = {
    "stage2_micro4": {"stage": 2, "microbatches": 4},
    "stage2_fsdp2_micro8": {"stage": 2, "fsdp": 2, "microbatches": 8},
    "stage2_tensor2_micro4": {"stage": 2, "tensor": 2, "microbatches": 4},
    "stage2_fsdp2_tensor2_micro8": {"stage": 2, "fsdp": 2, "tensor": 2, "microbatches": 8},
}


# Eight fake devices share this machine's few cores: a device thread can wait long past
# XLA:CPU's 40 s collective deadline for its turn, which is load, not a hang.
PATIENT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def run(python_in_subprocess, program, argument, devices):
    flags = f"--xla_force_host_platform_device_count={devices} {PATIENT}"
    stdout = python_in_subprocess(
        f"import sys; sys.argv = ['x', {json.dumps(json.dumps(argument))}]\n" + program,
        devices=devices, env={"XLA_FLAGS": flags}, timeout=1200,
    )
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.slow
def test_pipeline_stages_match_one_device(python_in_subprocess):
    single = run(python_in_subprocess, PROGRAM, {"one": {}}, devices=1)["one"]
    assert single["sites"] == ["params/layers"] and len(single["losses"]) == 10
    assert single["bubble"] is None  # one stage reports no bubble
    piped = run(python_in_subprocess, PROGRAM, SPLITS, devices=8)
    for name, result in piped.items():
        assert result["losses"] == pytest.approx(single["losses"], abs=1e-5, rel=1e-5), name
    # GPipe idles (stages - 1) of (microbatches + stages - 1) iterations per stage.
    assert piped["stage2_micro4"]["bubble"] == pytest.approx(1 / 5)
    assert piped["stage2_fsdp2_micro8"]["bubble"] == pytest.approx(1 / 9)
    # The stacked layers really are split: stage on the layers axis, fsdp and tensor inside.
    assert piped["stage2_micro4"]["spec"].startswith("P('stage'")
    assert piped["stage2_micro4"]["shard"] == [2, 16, 32]
    assert piped["stage2_fsdp2_micro8"]["shard"] == [2, 8, 32]
    assert piped["stage2_fsdp2_tensor2_micro8"]["shard"] == [2, 8, 16]


# Resuming a checkpoint on another mesh or process count: test_checkpoint_meshes.py.


REFUSALS = COMMON + r"""
from dew.nn.backbones import CausalTransformer
from dew.nn.pipeline import MicrobatchError, StageDivisionError
from dew.training.placement.stages import NoStackError
try:
    Trainer(LM(layers=3), optax.sgd(0.1), key=jax.random.key(0), mesh=MeshSpec(stage=2)).place()
except StageDivisionError as error:
    print("LAYERS", error)
try:
    MeshSpec(stage=2, microbatches=3)
except MicrobatchError as error:
    print("MULTIPLE", error)
class Flat(LM):
    def __init__(self):
        super().__init__()
        self.model = self.model.clone(scan_layers=False)
try:
    Trainer(Flat(), optax.sgd(0.1), key=jax.random.key(0), mesh=MeshSpec(stage=2)).place()
except NoStackError as error:
    print("NOSTACK", error)
try:
    train({"stage": 2, "microbatches": 6}, steps=1)
except MicrobatchError as error:
    print("ROWS", error)
"""


def test_bad_pipeline_shapes_are_refused_naming_the_fix(python_in_subprocess):
    out = python_in_subprocess(REFUSALS, devices=2)
    lines = {line.split(" ", 1)[0]: line for line in out.splitlines()}
    assert "3 layers" in lines["LAYERS"] and "stage=2" in lines["LAYERS"]
    assert "microbatches (3)" in lines["MULTIPLE"] and "set it to" in lines["MULTIPLE"]
    assert "scan_layers=True" in lines["NOSTACK"]
    assert "32 rows" in lines["ROWS"] and "microbatches=6" in lines["ROWS"]
