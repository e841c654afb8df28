"""What DPO's frozen reference policy costs in memory: one copy of the policy's bytes.

Two fresh interpreters train the same causal transformer with adam through
Trainer.fit on the same token pairs: one with DPO against precomputed
reference log-probabilities (no reference held), one with DPO holding the
frozen reference (a copy of the policy made at init). Each reports the
bytes its TrainState holds, the compiled step's peak (XLA's memory
analysis: arguments and outputs less the donated aliases, plus
temporaries) and the process's peak resident memory. The differences are
printed in units of the policy's bytes (target 1.0: an optimizer state or
EMA copy of the reference would show as 2 or more). On a CPU the process
peak is the rougher figure.

    .venv/bin/python benchmarks/dpo_bench.py [--width 512] [--layers 4]
"""

from __future__ import annotations

import argparse

from reference_memory import STEP_MB, report, run

from dew.cli.runs import positive

PROGRAM = """
import contextlib, io, itertools, json, resource, sys
import jax, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.models import build
from dew.objectives.dpo import DPOObjective
cfg = json.loads(sys.argv[1])
model = build("causal_transformer", vocab_size=256, emb_features=cfg["width"], num_layers=cfg["layers"],
              num_heads=8, mlp_features=4 * cfg["width"], max_seq_len=64)
rows, length = 4, 32
rng = np.random.default_rng(0)
prompt = rng.integers(0, 256, size=(rows, 8))
pair = lambda: np.concatenate([prompt, rng.integers(0, 256, size=(rows, length - 8))], 1).astype(np.int32)
mask = np.zeros((rows, length), np.int32); mask[:, 8:] = 1
batch = {"chosen": pair(), "rejected": pair(), "chosen_mask": mask, "rejected_mask": mask,
         "prompt_length": np.full((rows,), 8, np.int32)}
if not cfg["reference"]:
    batch["chosen_reference_logp"] = np.zeros((rows,), np.float32)
    batch["rejected_reference_logp"] = np.zeros((rows,), np.float32)
objective = DPOObjective(model, length, reference="frozen" if cfg["reference"] else "precomputed")
rss_mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
data = Dataset(train=lambda p: itertools.repeat(batch), batch=rows)
trainer = Trainer(objective, optax.adam(1e-4), key=jax.random.key(0))
baseline = rss_mb()
with contextlib.redirect_stdout(io.StringIO()):
    state = trainer.fit(data, steps=3, log_every=3)
""" + STEP_MB + """
size = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree)) / 2**20
print(json.dumps({"peak_mb": rss_mb() - baseline, "step_mb": step_mb, "state_mb": size(state),
                  "policy_mb": size(state.params["params"])}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=positive, default=512)
    parser.add_argument("--layers", type=positive, default=4)
    cfg = vars(parser.parse_args())
    alone = run(PROGRAM, {**cfg, "reference": False})
    held = run(PROGRAM, {**cfg, "reference": True})
    model = alone["policy_mb"]
    print(f"policy: causal transformer, {cfg['layers']} layers of width {cfg['width']}, "
          f"{model:.1f} MB of parameters, adam")
    report({"precomputed reference": alone, "frozen reference held": held}, model, "the reference")


if __name__ == "__main__":
    main()
