"""What LoRA and QLoRA save: optimizer-state bytes of the adapters alone, base bytes quantized.

The same causal transformer trains a few steps with AdamW through
Trainer.fit in this process: every weight trained (full fine-tuning), then
with rank-r adapters on the attention and MLP weights and the base frozen
(``adapters_only``), the base held as stored (LoRA) and quantized to int8
and nf4 (QLoRA). Printed: the bytes of the TrainState's parameters and
optimizer state, the adapters' own bytes, the ratio of each optimizer state
to full fine-tuning's (target: the adapters' share of the model, far below
1) and of each parameter tree to full fine-tuning's (QLoRA: near a quarter,
the adapted weights' codes taking one byte each).

    .venv/bin/python benchmarks/lora_bench.py [--width 256] [--layers 4] [--rank 8]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

from dew import Trainer, models
from dew.adapters.lora import Lora, adapters_only, apply_lora, is_adapter
from dew.cli.runs import positive
from dew.data import Dataset
from dew.objectives.lm import LMObjective
from dew.training import trees

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
    parser.add_argument("--width", type=positive, default=256)
    parser.add_argument("--layers", type=positive, default=4)
    parser.add_argument("--rank", type=positive, default=8)
    parser.add_argument("--steps", type=positive, default=3)
    args = parser.parse_args()
    model = models.build("causal_transformer", vocab_size=VOCAB, emb_features=args.width,
                         num_layers=args.layers, num_heads=4, mlp_features=4 * args.width, max_seq_len=SEQ)
    full = run(LMObjective(model=model, seq_len=SEQ), args.steps)
    print(f"model: {args.layers} layers of width {args.width}, rank {args.rank} adapters on attention and MLP")
    print(f"  {'full fine-tuning':>16}: params {nbytes(full.params) / 2**20:8.2f} MB, "
          f"optimizer state {nbytes(full.opt_state) / 2**20:8.3f} MB")
    for base in ("float32", "int8", "nf4"):
        lora_model = apply_lora(model, Lora(rank=args.rank, targets=("attention", "mlp"), base=base))
        lora = run(adapters_only(LMObjective(model=lora_model, seq_len=SEQ)), args.steps)
        adapters = trees.select(lora.params, is_adapter)
        name = "LoRA" if base == "float32" else f"QLoRA {base}"
        print(f"  {name:>16}: params {nbytes(lora.params) / 2**20:8.2f} MB, "
              f"optimizer state {nbytes(lora.opt_state) / 2**20:8.3f} MB "
              f"(adapters {nbytes(adapters) / 2**20:.3f} MB, {nbytes(adapters) / nbytes(full.params):.4f} "
              "of the model)")
        print(f"    {name}: optimizer state / full {nbytes(lora.opt_state) / nbytes(full.opt_state):.4f}; "
              f"params / full {nbytes(lora.params) / nbytes(full.params):.4f}; "
              f"optimizer state / (2 x adapters) {nbytes(lora.opt_state) / (2 * nbytes(adapters)):.3f}")


if __name__ == "__main__":
    main()
