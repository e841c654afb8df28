"""Trainer.fit against a hand-written donated jax.jit loop, in one run.

Time to first step and peak resident memory come from fresh interpreters,
one per side (so each compile and each peak is its own), first with no
compilation cache and then with JAX's persistent cache warmed by an earlier
run of the same program; steady-state ms per step comes from one interpreter
in which the two loops alternate (``--rounds``, in ABBA order), so the
machine's drift hits both alike.
Same model, batch and optimizer; the script prints each figure and the
ratios, the first step's as min and median over the repeats' pairs. The
default model is the key-concepts page's (64 wide, 2 layers, 4 heads, MLP
256, batch 8 x 64 tokens). Goals: steady state <= 1.02, first step <= 1.05,
memory <= 1.1, and a warm cache at most half the cold first step. The
machine may be shared: read the ratios, not the seconds.

    .venv/bin/python benchmarks/trainer_bench.py [--steps 30] [--width 384 --layers 4 --seq 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

from dew.cli.runs import positive

COMMON = """
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from dew import models
from dew.objectives.lm import LMObjective
cfg = json.loads(sys.argv[1])
if cfg.get("cache"):  # what prepare_process does for a recipe's trainer.compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", cfg["cache"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
model = models.build("causal_transformer", vocab_size=257, emb_features=cfg["width"],
                     num_layers=cfg["layers"], num_heads=cfg["heads"], mlp_features=4 * cfg["width"],
                     max_seq_len=2 * cfg["seq"])
objective = LMObjective(model, seq_len=cfg["seq"])
optimizer = optax.adamw(1e-3)
rng = np.random.default_rng(0)
batch = {"text": rng.integers(0, 256, size=(cfg["batch"], cfg["seq"] + 1)).astype(np.int32)}
baseline = rss_mb()
class Goodput:
    record = None
    def log(self, scalars, step): pass
    def artifact(self, value, step):
        if getattr(value, "type", "") == "goodput": self.record = value
    def close(self): pass
"""

TRAINER = COMMON + """
from dew import Trainer
from dew.data import Dataset
import itertools
tracker = Goodput()
trainer = Trainer(objective, optimizer, key=jax.random.key(0), tracker=tracker)
data = Dataset(train=lambda p: itertools.repeat(batch), batch=cfg["batch"])
import io, contextlib
with contextlib.redirect_stdout(io.StringIO()):
    state = trainer.fit(data, steps=cfg["steps"], log_every=cfg["steps"])
g = tracker.record
print(json.dumps({"first": g.first_step_seconds,
                  "step_ms": 1000 * (g.wall_seconds - g.first_step_seconds) / (cfg["steps"] - 1),
                  "peak_mb": rss_mb() - baseline}))
"""

HAND = COMMON + """
started = time.perf_counter()
def init():
    variables = jax.tree.map(lambda x: x, objective.init(jax.random.key(0)))
    from flax import linen as nn
    variables = nn.meta.unbox(variables)
    return variables, optimizer.init({"params": variables["params"]})
variables, opt_state = jax.jit(init)()
def loss_fn(p, batch):
    logits = model.apply(p, batch["text"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["text"][:, 1:]).mean()
def step(variables, opt_state, batch):
    p = {"params": variables["params"]}
    loss, grads = jax.value_and_grad(loss_fn)(p, batch)
    updates, opt_state = optimizer.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss
step = jax.jit(step, donate_argnums=(0, 1))
for i in range(cfg["steps"]):
    device_batch = jax.device_put(batch)
    variables, opt_state, loss = step(variables, opt_state, device_batch)
    if i == 0:
        jax.block_until_ready(loss)
        first = time.perf_counter() - started
jax.block_until_ready(loss)
wall = time.perf_counter() - started
print(json.dumps({"first": first, "step_ms": 1000 * (wall - first) / (cfg["steps"] - 1),
                  "peak_mb": rss_mb() - baseline}))
"""


STEADY = HAND.split("started = time.perf_counter()")[0] + """
import itertools, io, contextlib
from flax import linen as nn
from dew import Trainer
from dew.data import Dataset
def loss_fn(p, batch):
    logits = model.apply(p, batch["text"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["text"][:, 1:]).mean()
def hand_step(p, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch)
    updates, opt_state = optimizer.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss
hand_step = jax.jit(hand_step, donate_argnums=(0, 1))
variables = nn.meta.unbox(objective.init(jax.random.key(0)))
p = {"params": variables["params"]}
opt_state = optimizer.init(p)
p, opt_state, loss = hand_step(p, opt_state, jax.device_put(batch))
jax.block_until_ready(loss)
data = Dataset(train=lambda _: itertools.repeat(batch), batch=cfg["batch"])
out = {"hand": [], "trainer": []}
def hand_round():
    global p, opt_state
    started = time.perf_counter()
    for i in range(cfg["steps"]):
        p, opt_state, loss = hand_step(p, opt_state, jax.device_put(batch))
    jax.block_until_ready(loss)
    out["hand"].append(1000 * (time.perf_counter() - started) / cfg["steps"])
def trainer_round():
    tracker = Goodput()
    trainer = Trainer(objective, optimizer, key=jax.random.key(0), tracker=tracker)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(data, steps=cfg["steps"] + 1, log_every=cfg["steps"] + 1)
    g = tracker.record
    out["trainer"].append(1000 * (g.wall_seconds - g.first_step_seconds) / cfg["steps"])
for round in range(cfg["repeats"]):  # hand-trainer, trainer-hand, ...: drift lands on both alike
    for one in (hand_round, trainer_round) if round % 2 == 0 else (trainer_round, hand_round):
        one()
print(json.dumps(out))
"""


def measure(program: str, cfg: dict) -> dict:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(program), json.dumps(cfg)],
                            capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=30)
    parser.add_argument("--width", type=positive, default=64)
    parser.add_argument("--layers", type=positive, default=2)
    parser.add_argument("--heads", type=positive, default=4)
    parser.add_argument("--seq", type=positive, default=64)
    parser.add_argument("--batch", type=positive, default=8)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--steady-steps", type=positive, default=150,
                        help="steps per round of the steady-state comparison")
    parser.add_argument("--rounds", type=positive, default=10,
                        help="rounds of the steady-state comparison (each runs both loops, in ABBA order)")
    cfg = vars(parser.parse_args())
    if cfg["steps"] < 2:  # the steps after the first are timed
        parser.error(f"--steps must be at least 2 (the first compiles, the rest are timed), got {cfg['steps']}")
    params = cfg["layers"] * 12 * cfg["width"] ** 2
    print(f"model: {cfg['layers']} layers x width {cfg['width']} (~{params / 1e6:.1f}M params), "
          f"batch {cfg['batch']} x {cfg['seq']} tokens, adamw, {cfg['steps']} steps")
    rows = {"hand-written": [], "Trainer.fit": []}
    for _ in range(cfg["repeats"]):  # fresh processes: first step and peak memory
        rows["hand-written"].append(measure(HAND, cfg))
        rows["Trainer.fit"].append(measure(TRAINER, cfg))
    best = {name: {k: min(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items()}
    import tempfile

    warm: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as hand_cache, tempfile.TemporaryDirectory() as dew_cache:
        for name, program, cache in (("hand-written", HAND, hand_cache), ("Trainer.fit", TRAINER, dew_cache)):
            measure(program, {**cfg, "cache": cache})  # fills the cache
            warm[name] = min(measure(program, {**cfg, "cache": cache})["first"]
                             for _ in range(cfg["repeats"]))
    # Steady state: both loops alternate in one process, so drift hits them alike.
    steady = measure(STEADY, {**cfg, "steps": cfg["steady_steps"], "repeats": cfg["rounds"]})
    best["hand-written"]["step_ms"] = min(steady["hand"])
    best["Trainer.fit"]["step_ms"] = min(steady["trainer"])
    for name, b in best.items():
        print(f"{name:>13}: {b['step_ms']:8.1f} ms/step  first step {b['first']:6.2f} s  "
              f"peak +{b['peak_mb']:7.1f} MB")
    print("steady-state ms/step by round: hand " + ", ".join(f"{x:.1f}" for x in steady["hand"])
          + "; trainer " + ", ".join(f"{x:.1f}" for x in steady["trainer"]))
    firsts = [t["first"] / h["first"] for h, t in zip(rows["hand-written"], rows["Trainer.fit"], strict=True)]
    print("first step Trainer / hand-written by pair: " + ", ".join(f"{r:.3f}" for r in firsts)
          + f"; min {min(firsts):.3f}, median {statistics.median(firsts):.3f} (goal <= 1.05)")
    pairs = [t / h for h, t in zip(steady["hand"], steady["trainer"], strict=True)]
    # A loop run right after itself is often slower than one run after the other, so a round's
    # ratio leans with its order; over ABBA rounds the geometric mean cancels the lean.
    print("steady step Trainer / hand-written by round: " + ", ".join(f"{r:.3f}" for r in pairs)
          + f"; min {min(pairs):.3f}, median {statistics.median(pairs):.3f}, geometric mean "
          f"{statistics.geometric_mean(pairs):.3f} (goal <= 1.02)")
    h, t = best["hand-written"], best["Trainer.fit"]
    print(f"first step with a warm compilation cache: hand-written {warm['hand-written']:.2f} s, "
          f"Trainer.fit {warm['Trainer.fit']:.2f} s")
    print(f"ratio of bests (Trainer / hand-written): steady state {t['step_ms'] / h['step_ms']:.3f} "
          f"(goal <= 1.02), first step {t['first'] / h['first']:.3f} (goal <= 1.05), "
          f"warm first step {warm['Trainer.fit'] / warm['hand-written']:.3f}, "
          f"peak memory {t['peak_mb'] / h['peak_mb']:.3f} (target <= 1.1)")
    print(f"ratio (warm cache / cold) for Trainer.fit's first step: "
          f"{warm['Trainer.fit'] / t['first']:.3f} (target <= 0.5)")

if __name__ == "__main__":
    main()
