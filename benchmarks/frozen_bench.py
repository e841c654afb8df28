"""What a frozen reference as large as the trained model costs in memory: one copy of its bytes.

Two fresh interpreters train the same MLP with adam through Trainer.fit; the
second also holds a frozen reference, a copy of the trained model made at
init (as DPO's reference policy is), that the loss reads. Each reports the bytes its
TrainState holds, the compiled step's peak (XLA's memory analysis: arguments
and outputs less the donated aliases, plus temporaries) and the process's
peak resident memory. The script prints the differences in units of one
model's bytes (target: 1.0, one copy; an optimizer state, window or EMA copy
of the reference would show as 2 or more). On a CPU the process peak is a
rougher figure: it includes the initializer's temporaries and what the
allocator keeps after freeing.

    .venv/bin/python benchmarks/frozen_bench.py [--width 1024] [--layers 4]
"""

from __future__ import annotations

import argparse

from reference_memory import STEP_MB, report, run

from dew.cli.runs import positive

PROGRAM = """
import itertools, io, contextlib, json, resource, sys
import jax, jax.numpy as jnp, numpy as np, optax
from flax import linen as nn
from dew import Trainer
from dew.data import Dataset
from dew.objectives.base import Aux, EMASpec, Mean, Objective, under
cfg = json.loads(sys.argv[1])

class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(cfg["layers"]):
            x = nn.tanh(nn.Dense(cfg["width"], name=f"dense_{i}")(x))
        return x

class Pair(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Stack(name="policy")(x), (Stack(name="reference")(x) if cfg["reference"] else None)

class Objective_(Objective):
    frozen = staticmethod(under("params/reference"))
    def __init__(self):
        self.model = Pair()
    def init(self, key, variables=None):
        # As DPO's is, the reference starts as a copy of the policy.
        variables = Stack().init(key, jnp.zeros((1, cfg["width"])))["params"]
        params = {"policy": variables}
        if cfg["reference"]:
            params["reference"] = jax.tree.map(jnp.copy, variables)
        return {"params": params}
    def loss(self, variables, batch, step):
        out, ref = self.model.apply(variables, batch["x"])
        target = ref if ref is not None else batch["x"]
        errors = (out - jax.lax.stop_gradient(target)) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size, jnp.float32)), Aux()

def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
batch = {"x": np.random.default_rng(0).normal(size=(8, cfg["width"])).astype(np.float32)}
data = Dataset(train=lambda p: itertools.repeat(batch), batch=8)
trainer = Trainer(Objective_(), optax.adam(1e-4), key=jax.random.key(0))
baseline = rss_mb()
with contextlib.redirect_stdout(io.StringIO()):
    state = trainer.fit(data, steps=3, log_every=3)
""" + STEP_MB + """
size = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
state_mb = size(state) / 2**20
print(json.dumps({"peak_mb": rss_mb() - baseline, "step_mb": step_mb, "state_mb": size(state) / 2**20,
                  "policy_mb": size(state.params["params"]["policy"]) / 2**20}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=positive, default=1024)
    parser.add_argument("--layers", type=positive, default=4)
    cfg = vars(parser.parse_args())
    alone = run(PROGRAM, {**cfg, "reference": False})
    both = run(PROGRAM, {**cfg, "reference": True})
    model = alone["policy_mb"]
    print(f"model: {cfg['layers']} dense layers of {cfg['width']}x{cfg['width']}, "
          f"{model:.1f} MB of parameters, adam")
    report({"trained alone": alone, "with a frozen reference": both}, model, "the reference")


if __name__ == "__main__":
    main()
