"""A ~1B-parameter decoder in bf16 on one accelerator: Trainer.fit against a hand-written jit loop.

Both sides train the same CausalTransformer (rotary positions, SwiGLU, bf16
compute over float32 parameters, AdamW) on the same batch. Attention goes
through jax.nn.dot_product_attention ("cudnn" on GPU, "xla" elsewhere) and
every layer may be rematerialized with one of REMAT_POLICIES. The script prints
step time, tokens per second and MFU (the model's FLOPs per step over the
chip's peak bf16 FLOP/s) for each side, and the ratio of Trainer.fit's step
time to the hand-written loop's, measured in the same process.

FLOPs per token follow the usual count for training (forward + backward =
3x forward): 6 x (parameters in matmuls, output head included, embedding
lookup excluded) + 6 x layers x sequence x heads x head width for causal
attention (half of the full T x T score matrix is needed).

    .venv/bin/python benchmarks/gpu_bench.py                      # the 1B model, on the GPU
    .venv/bin/python benchmarks/gpu_bench.py --remat full --batch 32
    .venv/bin/python benchmarks/gpu_bench.py --smoke              # a tiny model on the CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass

# Peak dense bf16 FLOP/s by device kind (jax's device_kind, lower-cased; the
# first matching entry wins, so more specific names come first). Vendor
# datasheet figures without sparsity.
PEAK_BF16_FLOPS = (
    ("h100 pcie", 756e12),
    ("h200", 989e12),
    ("h100", 989e12),
    ("h800", 989e12),
    ("gh200", 989e12),
    ("b200", 2250e12),
    ("a100", 312e12),
    ("a800", 312e12),
    ("l40s", 362e12),
    ("l4", 121e12),
    ("tpu v6", 918e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v5", 459e12),
    ("tpu v4", 275e12),
)

REMAT_CHOICES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


@dataclass(frozen=True)
class Shape:
    """The model and batch the benchmark trains."""

    vocab: int
    width: int
    layers: int
    heads: int
    mlp: int
    seq: int
    batch: int

    def matmul_parameters(self) -> int:
        """Parameters that take part in a matmul per token (the embedding lookup does not)."""
        attention = 4 * self.width * self.width
        mlp = 3 * self.width * self.mlp  # SwiGLU: gate, up, down
        return self.layers * (attention + mlp) + self.width * self.vocab

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N for the matmuls plus causal attention's scores."""
        return 6 * self.matmul_parameters() + 6 * self.layers * self.seq * self.width


ONE_B = Shape(vocab=32_000, width=2048, layers=18, heads=16, mlp=5632, seq=2048, batch=16)
SMOKE = Shape(vocab=128, width=64, layers=2, heads=4, mlp=128, seq=32, batch=4)


def peak_flops(device_kind: str) -> float | None:
    """The table's peak bf16 FLOP/s for a device kind, or None when it is not listed."""
    kind = device_kind.lower()
    return next((peak for name, peak in PEAK_BF16_FLOPS if name in kind), None)


def build(shape: Shape, attention: str, remat: str):
    import jax.numpy as jnp

    from dew import models

    return models.build(
        "causal_transformer", vocab_size=shape.vocab, emb_features=shape.width,
        num_layers=shape.layers, num_heads=shape.heads, mlp_features=shape.mlp,
        max_seq_len=shape.seq, position_embedding="rotary", mlp_activation="swiglu",
        dtype=jnp.bfloat16, param_dtype=jnp.float32, attention=attention, remat=remat,
    )


def hand_loop(model, optimizer, batch, steps: int) -> dict:
    """The same training in a donated jax.jit step: ms per step after a compiled first step."""
    import jax
    import optax
    from flax import linen as nn

    tokens = batch["text"]

    def init():
        params = nn.meta.unbox(model.init(jax.random.key(0), tokens[:, :-1]))["params"]
        return params, optimizer.init(params)

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state = jax.jit(init)()
    count = sum(x.size for x in jax.tree.leaves(params))
    step = jax.jit(step, donate_argnums=(0, 1))
    device_tokens = jax.device_put(tokens)
    params, opt_state, loss = step(params, opt_state, device_tokens)
    first_loss = float(loss)
    started = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, device_tokens)
    last_loss = float(loss)  # waits for the last step
    seconds = (time.perf_counter() - started) / steps
    return {"step_s": seconds, "parameters": count, "first_loss": first_loss,
            "last_loss": last_loss}


class _Catch:
    """A tracker that keeps the Goodput record and the last logged loss."""

    goodput = None
    loss = math.nan

    def log(self, scalars, step):
        for name, value in scalars.items():
            if name.split("/")[-1] == "loss":
                self.loss = float(value)

    def artifact(self, value, step):
        if getattr(value, "type", "") == "goodput":
            self.goodput = value

    def close(self):
        pass


def trainer_fit(model, optimizer, batch, steps: int, seq: int) -> dict:
    """Trainer.fit for 1 + steps steps: ms per step after the first, from its Goodput record."""
    import jax

    from dew import Trainer
    from dew.data import Dataset
    from dew.objectives.lm import LMObjective

    tracker = _Catch()
    trainer = Trainer(LMObjective(model, seq_len=seq), optimizer, key=jax.random.key(0),
                      tracker=tracker)
    data = Dataset(train=lambda _: itertools.repeat(batch), batch=len(batch["text"]))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(data, steps=steps + 1, log_every=steps + 1)
    g = tracker.goodput
    return {"step_s": (g.wall_seconds - g.first_step_seconds) / steps,
            "first_step_s": g.first_step_seconds, "last_loss": tracker.loss}


def summary(name: str, step_s: float, shape: Shape, peak: float | None) -> str:
    tokens = shape.batch * shape.seq
    mfu = (f"{100 * shape.flops_per_token() * tokens / step_s / peak:.1f}%"
           if peak else "n/a (no peak for this device; pass --peak-flops)")
    return (f"{name:<16} step {1000 * step_s:9.2f} ms   {tokens / step_s:12,.0f} tokens/s   "
            f"MFU {mfu}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model for a few steps: checks the script on a CPU in seconds")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; smoke 3)")
    for name in ("vocab", "width", "layers", "heads", "mlp", "seq", "batch"):
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"model/batch size (default {getattr(ONE_B, name)})")
    parser.add_argument("--remat", choices=REMAT_CHOICES, default=None,
                        help="per-layer rematerialization (default dots_saveable; smoke none)")
    parser.add_argument("--attention", choices=("cudnn", "xla", "einsum"), default=None,
                        help="attention implementation (default cudnn on GPU, xla elsewhere)")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="the chip's peak bf16 FLOP/s, for a device the table lacks")
    parser.add_argument("--skip-trainer", action="store_true", help="only the hand-written loop")
    args = parser.parse_args()

    import jax
    import numpy as np
    import optax

    base = SMOKE if args.smoke else ONE_B
    shape = Shape(**{k: getattr(args, k) or v for k, v in asdict(base).items()})
    steps = args.steps or (3 if args.smoke else 20)
    device = jax.devices()[0]
    attention = args.attention or ("cudnn" if device.platform == "gpu" else "xla")
    remat = args.remat or ("none" if args.smoke else "dots_saveable")
    peak = args.peak_flops or peak_flops(device.device_kind)

    model = build(shape, attention, remat)
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    rng = np.random.default_rng(0)
    batch = {"text": rng.integers(0, shape.vocab, (shape.batch, shape.seq + 1)).astype(np.int32)}

    peak_text = f"{peak / 1e12:.0f} TFLOP/s bf16" if peak else "unknown peak"
    print(f"device: {device.device_kind} ({device.platform}), {peak_text}")
    hand = hand_loop(model, optimizer, batch, steps)
    print(f"model: {hand['parameters']:,} parameters, {shape.layers} layers x "
          f"{shape.width} wide, {shape.heads} heads, SwiGLU {shape.mlp}, vocab {shape.vocab}; "
          f"bf16 compute, float32 parameters; attention={attention}, remat={remat}")
    print(f"batch: {shape.batch} x {shape.seq} tokens; "
          f"{shape.flops_per_token() / 1e9:.4g} GFLOP per token; {steps} timed steps")
    print(summary("hand-written jit", hand["step_s"], shape, peak))
    result = {"device": device.device_kind, "attention": attention, "remat": remat,
              "parameters": hand["parameters"], "tokens_per_step": shape.batch * shape.seq,
              "flops_per_token": shape.flops_per_token(), "peak_flops": peak,
              "hand": hand}
    if not args.skip_trainer:
        gc.collect()
        fit = trainer_fit(model, optimizer, batch, steps, shape.seq)
        print(summary("Trainer.fit", fit["step_s"], shape, peak))
        print(f"ratio Trainer.fit / hand-written step time: {fit['step_s'] / hand['step_s']:.3f}")
        result["trainer"] = fit
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
