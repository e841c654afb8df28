"""A DiT diffusion step through Trainer.fit against a hand-written donated jax.jit loop.

Same model (a class-conditional DiT), batch, optimizer (adamw) and EMA
(decay 0.999) on both sides; the hand-written loop noises the batch on the
cosine schedule, predicts eps and applies the update and the average itself.

Two figures, both medians, because a shared machine's load moves single
rounds by more than the difference measured:

- the compiled step alone: the Trainer's executable (``Trainer.compile``,
  the transaction ``fit`` runs: finiteness check, metrics, EMA, condition
  dropout, the label check) and the hand-written one, called alternately
  one step each, so drift hits both alike; the median of the per-pair
  ratios;
- the whole loop: ``Trainer.fit`` (feed, dispatch, metrics read-back)
  against the hand-written loop, alternating rounds of steps; the median
  round of each.

Target: ratio <= 1.05.

    .venv/bin/python benchmarks/diffusion_bench.py [--steps 20] [--width 128] [--repeats 5] [--pairs 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

import numpy as np

from dew.cli.runs import positive

PROGRAM = """
import contextlib, io, itertools, json, math, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from flax import linen as nn
from dew import Trainer, models
from dew.data import Dataset
from dew.objectives.base import EMASpec
from dew.objectives.diffusion import DiffusionObjective
cfg = json.loads(sys.argv[1])
model = models.build("dit", image_size=cfg["size"], channels=3, patch_size=2,
                     emb_features=cfg["width"], num_layers=cfg["layers"], num_heads=4,
                     mlp_features=4 * cfg["width"], num_classes=10)
objective = DiffusionObjective(model, condition_dropout=0.1, ema=EMASpec(0.999))
optimizer = optax.adamw(1e-4)
rng = np.random.default_rng(0)
batch = {"image": rng.integers(0, 256, (cfg["batch"], cfg["size"], cfg["size"], 3)).astype(np.uint8),
         "label": rng.integers(0, 10, cfg["batch"]).astype(np.int32)}

def alpha_sigma(t):
    s = 0.008
    alpha = jnp.cos(0.5 * math.pi * (t + s) / (1 + s)) / math.cos(0.5 * math.pi * s / (1 + s))
    alpha = jnp.clip(alpha, 1e-3, 1.0)
    return alpha, jnp.sqrt(1 - alpha ** 2)

def loss_fn(p, batch, key):
    t_key, e_key, d_key = jax.random.split(key, 3)
    x0 = batch["image"].astype(jnp.float32) / 127.5 - 1
    t = jax.random.uniform(t_key, (x0.shape[0],), minval=1e-3, maxval=1.0)
    a, s = (v[:, None, None, None] for v in alpha_sigma(t))
    eps = jax.random.normal(e_key, x0.shape)
    labels = jnp.where(jax.random.bernoulli(d_key, 0.1, batch["label"].shape),
                       10, batch["label"])
    x = (a * x0 + s * eps) * jax.lax.rsqrt(a * a * 0.25 + s * s)
    return jnp.mean((model.apply(p, x, t, labels) - eps) ** 2)

def hand_step(p, ema, opt_state, batch, key):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch, key)
    updates, opt_state = optimizer.update(grads, opt_state, p)
    p = optax.apply_updates(p, updates)
    ema = jax.tree.map(lambda e, q: 0.999 * e + 0.001 * q, ema, p)
    return p, ema, opt_state, loss

hand_step = jax.jit(hand_step, donate_argnums=(0, 1, 2))
p = {"params": nn.meta.unbox(objective.init(jax.random.key(0)))["params"]}
ema = jax.tree.map(jnp.copy, p)
opt_state = optimizer.init(p)
key = jax.random.key(1)
p, ema, opt_state, loss = hand_step(p, ema, opt_state, jax.device_put(batch), key)
jax.block_until_ready(loss)

class Goodput:
    record = None
    def log(self, scalars, step): pass
    def artifact(self, value, step):
        if getattr(value, "type", "") == "goodput": self.record = value
    def close(self): pass

# The compiled step alone: the Trainer's executable against the hand-written one, one step each in turn.
trainer = Trainer(objective, optimizer, key=jax.random.key(0))
state, _, _ = trainer.place()
placed = jax.device_put(batch)
compiled = trainer.compile(state, placed)
state, metrics = compiled(state, placed)
jax.block_until_ready(metrics)
pairs = []
for i in range(cfg["pairs"]):
    started = time.perf_counter()
    state, metrics = compiled(state, placed)
    jax.block_until_ready(metrics)
    mine = time.perf_counter() - started
    started = time.perf_counter()
    p, ema, opt_state, loss = hand_step(p, ema, opt_state, placed, jax.random.fold_in(key, i))
    jax.block_until_ready(loss)
    pairs.append((1000 * mine, 1000 * (time.perf_counter() - started)))
del state, compiled, trainer

data = Dataset(train=lambda _: itertools.repeat(batch), batch=cfg["batch"])
out = {"hand": [], "trainer": [], "pairs": pairs}
for _ in range(cfg["repeats"]):
    started = time.perf_counter()
    for i in range(cfg["steps"]):
        p, ema, opt_state, loss = hand_step(p, ema, opt_state, jax.device_put(batch),
                                            jax.random.fold_in(key, i))
    jax.block_until_ready(loss)
    out["hand"].append(1000 * (time.perf_counter() - started) / cfg["steps"])
    tracker = Goodput()
    trainer = Trainer(objective, optimizer, key=jax.random.key(0), tracker=tracker)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(data, steps=cfg["steps"] + 1, log_every=cfg["steps"] + 1)
    g = tracker.record
    out["trainer"].append(1000 * (g.wall_seconds - g.first_step_seconds) / cfg["steps"])
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=20)
    parser.add_argument("--width", type=positive, default=128)
    parser.add_argument("--layers", type=positive, default=4)
    parser.add_argument("--size", type=positive, default=16)
    parser.add_argument("--batch", type=positive, default=32)
    parser.add_argument("--repeats", type=positive, default=5)
    parser.add_argument("--pairs", type=positive, default=30)
    cfg = vars(parser.parse_args())
    print(f"DiT: {cfg['layers']} layers x width {cfg['width']}, {cfg['batch']} images of "
          f"{cfg['size']}x{cfg['size']}x3 (patch 2), adamw + EMA, {cfg['steps']} steps a round")
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(PROGRAM), json.dumps(cfg)],
                            capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    steady = json.loads(result.stdout.strip().splitlines()[-1])
    mine, theirs = (np.asarray(x) for x in zip(*steady["pairs"], strict=True))
    step_ratio = float(np.median(mine / theirs))
    print(f"compiled step alone, {len(mine)} alternating pairs: Trainer {np.median(mine):.1f} ms, "
          f"hand-written {np.median(theirs):.1f} ms (medians); median ratio {step_ratio:.3f}")
    hand, trainer = float(np.median(steady["hand"])), float(np.median(steady["trainer"]))
    print("whole loop, ms/step by round: hand " + ", ".join(f"{x:.1f}" for x in steady["hand"])
          + "; trainer " + ", ".join(f"{x:.1f}" for x in steady["trainer"]))
    print(f"whole loop, median round: hand-written {hand:.1f} ms/step  Trainer.fit {trainer:.1f} ms/step")
    print(f"ratio (Trainer / hand-written): step {step_ratio:.3f}, loop {trainer / hand:.3f} "
          "(target <= 1.05)")


if __name__ == "__main__":
    main()
