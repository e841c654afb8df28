"""What LoRA saves: optimizer-state bytes of the adapters alone, against full fine-tuning.

The same causal transformer trains a few steps with AdamW through
Trainer.fit twice in this process: every weight trained (full fine-tuning),
then with rank-r adapters on the attention and MLP weights and the base
frozen (``adapters_only``). Printed: the bytes of the TrainState's
parameters and optimizer state, the adapters' own bytes, the ratio of the
two optimizer states (target: the adapters' share of the model, far below
1).

    .venv/bin/python benchmarks/lora_bench.py [--width 256] [--layers 4] [--rank 8]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

from dew import Trainer, models
from dew.data import Dataset
from dew.objectives.lm import LMObjective
from dew.training import trees
from dew.training.lora import Lora, adapters_only, apply_lora, is_adapter

SEQ, ROWS, VOCAB = 64, 8, 256


def nbytes(tree) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


def data() -> Dataset:
    def batches():
        rng = np.random.default_rng(0)
        while True:
            yield {"text": rng.integers(0, VOCAB, (ROWS, SEQ + 1)).astype(np.int32)}

    return Dataset(train=lambda partition: batches(), batch=ROWS)


def run(objective, steps: int):
    """The TrainState after steps of AdamW on objective."""
    state = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0)).fit(data(), steps=steps, log_every=steps)
    return jax.device_get(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model = models.build("causal_transformer", vocab_size=VOCAB, emb_features=args.width,
                         num_layers=args.layers, num_heads=4, mlp_features=4 * args.width, max_seq_len=SEQ)
    full = run(LMObjective(model=model, seq_len=SEQ), args.steps)
    lora_model = apply_lora(model, Lora(rank=args.rank, targets=("attention", "mlp")))
    lora = run(adapters_only(LMObjective(model=lora_model, seq_len=SEQ)), args.steps)
    adapters = trees.select(lora.params, is_adapter)
    print(f"model: {args.layers} layers of width {args.width}, rank {args.rank} adapters on attention and MLP")
    for name, state in (("full fine-tuning", full), ("LoRA", lora)):
        print(f"  {name:>16}: params {nbytes(state.params) / 2**20:8.2f} MB, "
              f"optimizer state {nbytes(state.opt_state) / 2**20:8.3f} MB")
    print(f"  adapters alone: {nbytes(adapters) / 2**20:.3f} MB "
          f"({nbytes(adapters) / nbytes(full.params):.4f} of the model)")
    print(f"optimizer state, LoRA / full: {nbytes(lora.opt_state) / nbytes(full.opt_state):.4f}; "
          f"LoRA optimizer state / (2 x adapters): {nbytes(lora.opt_state) / (2 * nbytes(adapters)):.3f}")


if __name__ == "__main__":
    main()
