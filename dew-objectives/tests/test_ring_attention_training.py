"""Training with ring attention on the sequence axis gives the single-device losses: 8 fake CPU devices.

A tiny CausalTransformer trains for 8 steps under LMObjective on packed rows
(segment_ids), once on one device with the all-gather einsum attention, and
with attention="ring" on meshes that split its positions over 2 and 4
devices (the latter beside fsdp); every run logs the same losses.
"""

from __future__ import annotations

import json

import pytest

PROGRAM = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from flax import linen as nn
from dew import Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.testing.doubles import RecordingTracker
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec

jax.config.update("jax_default_matmul_precision", "highest")
SEQ, ROWS = 16, 8

def batches(partition):
    step = 0
    while True:
        rng = np.random.default_rng(step)
        text = rng.integers(0, 32, size=(ROWS, SEQ + 1)).astype(np.int32)
        # Two to four documents packed into each row, cut at random places.
        cuts = np.sort(rng.choice(np.arange(1, SEQ), size=(ROWS, 3)), axis=1)
        segments = 1 + (np.arange(SEQ + 1)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
        share = ROWS // partition.shares
        rows = slice(partition.share * share, (partition.share + 1) * share)
        yield {"text": text[rows], "segment_ids": segments[rows]}
        step += 1

out = {}
for name, (attention, spec) in json.loads(sys.argv[1]).items():
    model = CausalTransformer(vocab_size=32, emb_features=16, num_layers=2, num_heads=4, num_kv_heads=2,
                              mlp_features=32, max_seq_len=SEQ, position_embedding="rotary", attention=attention)
    scalars = RecordingTracker()
    trainer = Trainer(LMObjective(model, seq_len=SEQ), optax.adam(1e-2), key=jax.random.key(0),
                      mesh=MeshSpec(**spec), layout=Layout(min_shard=0, tolerance=0.25), tracker=scalars)
    trainer.fit(Dataset(train=batches, batch=ROWS), steps=8, log_every=1)
    out[name] = [float(next(v for k, v in r.items() if k.endswith("/loss"))) for _, r in scalars.rows]
print("RESULT" + json.dumps(out))
"""


def run(python_in_subprocess, runs: dict, devices: int) -> dict:
    stdout = python_in_subprocess(f"import sys; sys.argv = ['x', {json.dumps(json.dumps(runs))}]\n" + PROGRAM,
                                  devices=devices, timeout=600)
    return json.loads(next(x for x in stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])


@pytest.mark.slow
def test_ring_attention_on_the_sequence_axis_trains_to_the_single_device_losses(python_in_subprocess):
    single = run(python_in_subprocess, {"one": ["einsum", {}]}, devices=1)["one"]
    assert len(single) == 8 and single[0] > single[-1]  # it learns something to be held to
    sharded = run(python_in_subprocess, {"ring_sequence2": ["ring", {"sequence": 2}],
                                         "ring_sequence4_fsdp2": ["ring", {"sequence": 4, "fsdp": 2}]},
                  devices=8)
    for name, losses in sharded.items():
        assert losses == pytest.approx(single, rel=1e-5, abs=1e-6), name
