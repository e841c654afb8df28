"""The language model's training step with its accuracy from ``argmax_hits`` against from ``argmax``.

    .venv/bin/python benchmarks/accuracy_bench.py [--rounds 12] [--steps 150]

Both steps are compiled by ``Trainer.compile`` for the key-concepts page's model
(64 wide, 2 layers, 4 heads, MLP 256, a 257-token vocabulary, batch 8 x 64
tokens) in one process, the second with ``jnp.argmax(logits, -1) == targets``
traced in place of ``argmax_hits``; then each round times ``--steps`` calls of
each, the order flipped every round, so the machine's drift hits both alike. It
prints each round's ratio (argmax_hits / argmax) and their minimum and median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dew.objectives.lm as lm
from dew import Trainer, models
from dew.cli.runs import positive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive, default=12)
    parser.add_argument("--steps", type=positive, default=150)
    args = parser.parse_args()
    model = models.build("causal_transformer", vocab_size=257, emb_features=64, num_layers=2, num_heads=4,
                         mlp_features=256, max_seq_len=128)
    batch = {"text": np.random.default_rng(0).integers(0, 256, size=(8, 65)).astype(np.int32)}
    hits = lm.argmax_hits
    steps = {}
    for name, accuracy in (("argmax", lambda logits, targets: jnp.argmax(logits, axis=-1) == targets),
                           ("argmax_hits", hits)):
        lm.argmax_hits = accuracy  # read when the loss is traced, inside compile
        trainer = Trainer(lm.LMObjective(model, seq_len=64), optax.adamw(1e-3), key=jax.random.key(0))
        state, _, _ = trainer.place()
        step = trainer.compile(state, jax.device_put(batch))
        state, metrics = step(state, jax.device_put(batch))
        jax.block_until_ready(metrics)
        steps[name] = [step, state]
    lm.argmax_hits = hits
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(args.rounds):
        for name in (("argmax", "argmax_hits") if round_ % 2 else ("argmax_hits", "argmax")):
            step, state = steps[name]
            started = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = step(state, jax.device_put(batch))
            jax.block_until_ready(metrics)
            steps[name][1] = state
            times[name].append(1000 * (time.perf_counter() - started) / args.steps)
    for name, values in times.items():
        print(f"{name:>12}: {min(values):6.2f} ms/step min, {statistics.median(values):6.2f} median")
    ratios = [new / old for new, old in zip(times["argmax_hits"], times["argmax"], strict=True)]
    print("argmax_hits / argmax by round: " + ", ".join(f"{r:.3f}" for r in ratios))
    print(f"argmax_hits / argmax: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
