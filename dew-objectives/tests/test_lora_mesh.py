"""LoRA and QLoRA on 8 fake devices (fsdp=4, tensor=2) give the single-device losses."""

from __future__ import annotations

import json

import numpy as np
import pytest

PROGRAM = """
import json
import jax, numpy as np, optax
import jax.numpy as jnp
from dew import Trainer, models
from dew.data import Dataset
from dew.objectives.lm import LMObjective
from dew.training.placement.layout import Layout
from dew.adapters.lora import Lora, adapters_only, apply_lora
from dew.training.placement.mesh import MeshSpec

class Losses:
    def __init__(self): self.values = []
    def log(self, scalars, step): self.values.append(float(scalars.get("train/loss", scalars.get("loss"))))
    def artifact(self, value, step): pass
    def close(self): pass

def batches():
    index = 0
    while True:
        yield {{"text": np.random.default_rng(index).integers(0, 64, (8, 17)).astype(np.int32)}}
        index += 1

model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                     mlp_features=64, max_seq_len=16, position_embedding="rotary", mlp_activation="swiglu")
base = model.init(jax.random.key(1), jnp.zeros((1, 16), jnp.int32))
losses = Losses()
wrapped = apply_lora(model, Lora(rank=4, alpha=8.0, targets=("attention", "mlp"), base={base!r}))
trainer = Trainer(adapters_only(LMObjective(model=wrapped, seq_len=16)), optax.adam(1e-2), key=jax.random.key(0),
                  mesh=MeshSpec(**{mesh!r}), layout=Layout(min_shard=0, tolerance=0.25), tracker=losses,
                  initializer=base)
state = trainer.fit(Dataset(train=lambda partition: batches(), batch=8), steps=4, log_every=1)
sharded = [x for x in jax.tree.leaves(state.params) if not x.sharding.is_fully_replicated]
print("RESULT" + json.dumps({{"losses": losses.values, "sharded": len(sharded)}}))
"""


def result(stdout: str) -> dict:
    return json.loads(stdout.split("RESULT", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("base", ["float32", "int8"])
def test_eight_devices_give_the_single_device_losses(base, python_in_subprocess):
    single = result(python_in_subprocess(PROGRAM.format(base=base, mesh={}), devices=1, timeout=600))
    many = result(python_in_subprocess(PROGRAM.format(base=base, mesh={"fsdp": 4, "tensor": 2}),
                                       devices=8, timeout=600))
    print(base, single["losses"], many["losses"], many["sharded"], "leaves sharded")
    assert len(single["losses"]) == 4 and np.all(np.isfinite(single["losses"]))
    np.testing.assert_allclose(many["losses"], single["losses"], rtol=1e-4)
    assert many["sharded"] > 0  # the weights really are split over the mesh
