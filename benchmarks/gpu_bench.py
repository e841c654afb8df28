"""MFU on one accelerator: a ~1B dense decoder, a Qwen3-0.6B and a Qwen3-MoE-shaped model, bf16.

For each model, Trainer.fit and a hand-written donated jax.jit loop train
the same model (bf16 compute over float32 parameters, AdamW) on the same
batch. Attention goes through jax.nn.dot_product_attention ("cudnn" on an NVIDIA GPU,
"xla" elsewhere) and every layer may be rematerialized with one of
REMAT_POLICIES. For each model the script prints step time, tokens per
second per chip and MFU (the model's FLOPs per step over the chip's peak bf16
FLOP/s) for each side, the ratio of Trainer.fit's step time to the
hand-written loop's (measured in the same process), and Trainer.fit's step
split into compute (the hand-written loop's step: the same program with no
host work around it), data (the Goodput record's wait for batches) and host
(the rest: the loop's own Python).

The models (``--models``, all three by default):

- ``dense-1b``: 18 layers x 2048 wide, SwiGLU 5632, vocab 32000 (~1.1B parameters);
- ``qwen3-0.6b``: ``models.build("qwen3", preset="0.6b")`` as published;
- ``qwen3-moe``: ``models.build("qwen3_moe", preset="30b-a3b")``'s layer (128
  experts of width 768, 8 per token) with ``--moe-layers`` of them (4 by
  default, so the parameters and AdamW's moments fit one chip).

FLOPs per token follow the usual count for training (forward + backward =
3x forward): 6 x (weights a token passes through: matmuls, the output head,
for MoE the router and its experts_per_token experts; the embedding lookup
excluded) + 6 x layers x sequence x attention width for causal attention
(half of the full T x T score matrix is needed). The weights are counted by
the model itself (CausalTransformer.flops_per_token).

On a machine without an accelerator the script says so and exits 0;
``--smoke`` runs every model at a tiny size on the CPU instead, in seconds.

    .venv/bin/python benchmarks/gpu_bench.py                      # all three, on the GPU
    .venv/bin/python benchmarks/gpu_bench.py --models dense-1b --remat full --batch 32
    .venv/bin/python benchmarks/gpu_bench.py --smoke              # tiny models on the CPU
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

from dew.cli.runs import amount, positive
from dew.telemetry.hardware import peak_flops  # dense bf16 datasheet peaks, matched as whole words

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

MODELS = ("dense-1b", "qwen3-0.6b", "qwen3-moe")


@dataclass(frozen=True)
class Preset:
    """A family preset the benchmark trains: which, at what size, on what batch."""

    family: str
    preset: str
    seq: int
    batch: int
    fields: tuple[tuple[str, int], ...] = ()  # CausalTransformer fields over the preset


PRESETS = {
    "qwen3-0.6b": Preset("qwen3", "0.6b", seq=2048, batch=16),
    "qwen3-moe": Preset("qwen3_moe", "30b-a3b", seq=2048, batch=8, fields=(("num_layers", 4),)),
}
SMOKE_PRESETS = {
    "qwen3-0.6b": Preset("qwen3", "tiny", seq=32, batch=4),
    "qwen3-moe": Preset("qwen3_moe", "tiny", seq=32, batch=4),
}


def causal_flops_per_token(model, seq: int) -> float:
    """Training FLOPs per token of a CausalTransformer, counted as Shape.flops_per_token counts:
    6 per weight a token passes through (the model's own count) + 6 x layers x seq x attention
    width (causal: half the scores)."""
    width = model.num_heads * model.head_width
    attention_full = 12 * model.num_layers * width * seq  # flops_per_token counts the full square
    weights = (model.flops_per_token(seq) - attention_full) / 6
    return 6 * weights + 6 * model.num_layers * seq * width


def build(shape: Shape, attention: str, remat: str):
    import jax.numpy as jnp

    from dew import models

    return models.build(
        "causal_transformer", vocab_size=shape.vocab, emb_features=shape.width,
        num_layers=shape.layers, num_heads=shape.heads, mlp_features=shape.mlp,
        max_seq_len=shape.seq, position_embedding="rotary", mlp_activation="swiglu",
        dtype=jnp.bfloat16, param_dtype=jnp.float32, attention=attention, remat=remat,
    )


def build_preset(preset: Preset, attention: str, remat: str, fields: dict | None = None):
    """A family preset as the benchmark trains it: bf16 compute, float32 parameters."""
    import jax.numpy as jnp

    from dew import models

    return models.build(preset.family, preset=preset.preset, max_seq_len=preset.seq,
                        dtype=jnp.bfloat16, param_dtype=jnp.float32, attention=attention,
                        remat=remat, **{**dict(preset.fields), **(fields or {})})


def hand_loop(model, optimizer, batch, steps: int) -> dict:
    """The same training in a donated jax.jit step: ms per step after a compiled first step."""
    import jax
    import optax
    from flax import linen as nn

    tokens = batch["text"]

    def init():
        params = nn.meta.unbox(model.init(jax.random.key(0), tokens[:, :-1]))["params"]
        return params, optimizer.init(params)

    options = {"mutable": ["moe"]} if getattr(model, "experts", 0) else {}  # routing statistics

    def loss_fn(params, tokens):
        out = model.apply({"params": params}, tokens[:, :-1], **options)
        logits = out[0] if options else out
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
            "first_step_s": g.first_step_seconds, "last_loss": tracker.loss,
            "data_s": g.data_seconds / (steps + 1)}


def summary(name: str, step_s: float, tokens: int, flops_per_token: float, peak: float | None,
            chips: int = 1) -> str:
    mfu = (f"{100 * flops_per_token * tokens / step_s / (peak * chips):.1f}%"
           if peak else "n/a (no peak for this device; pass --peak-flops)")
    return (f"{name:<16} step {1000 * step_s:9.2f} ms   {tokens / step_s / chips:12,.0f} tokens/s "
            f"per chip   MFU {mfu}")


def split(fit: dict, hand: dict) -> dict:
    """Trainer.fit's step as compute (the hand-written loop's step), data and host (the rest)."""
    data = min(fit["data_s"], fit["step_s"])
    compute = min(hand["step_s"], fit["step_s"] - data)  # a noisy hand-written run can be slower
    return {"compute_s": compute, "data_s": data, "host_s": fit["step_s"] - compute - data}


def bench(name: str, model, tokens_shape: tuple[int, int, int], flops_per_token: float,
          args, peak: float | None, attention: str, remat: str, steps: int) -> dict:
    """Both loops on one model; prints its lines and returns its RESULT."""
    import jax
    import numpy as np
    import optax

    batch_rows, seq, vocab = tokens_shape
    began = time.perf_counter()
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    rng = np.random.default_rng(0)
    batch = {"text": rng.integers(0, vocab, (batch_rows, seq + 1)).astype(np.int32)}
    chips = 1  # one device trains: the figures are per chip
    tokens = batch_rows * seq
    print(f"== {name}")
    hand = hand_loop(model, optimizer, batch, steps)
    print(f"model: {hand['parameters']:,} parameters, {model.num_layers} layers x "
          f"{model.emb_features} wide, {model.num_heads} heads"
          + (f", {model.experts} experts ({model.experts_per_token} per token)"
             if model.experts else f", MLP {model.mlp_features}")
          + f", vocab {model.vocab_size}; bf16 compute, float32 parameters; attention={attention}, "
          f"remat={remat}")
    print(f"batch: {batch_rows} x {seq} tokens; {flops_per_token / 1e9:.4g} GFLOP per token; "
          f"{steps} timed steps")
    print(summary("hand-written jit", hand["step_s"], tokens, flops_per_token, peak, chips))
    result = {"model": name, "device": jax.devices()[0].device_kind, "attention": attention,
              "remat": remat, "parameters": hand["parameters"], "tokens_per_step": tokens,
              "flops_per_token": flops_per_token, "peak_flops": peak, "hand": hand}
    if not args.skip_trainer:
        gc.collect()
        fit = trainer_fit(model, optimizer, batch, steps, seq)
        print(summary("Trainer.fit", fit["step_s"], tokens, flops_per_token, peak, chips))
        print(f"ratio Trainer.fit / hand-written step time: {fit['step_s'] / hand['step_s']:.3f}")
        parts = split(fit, hand)
        print("Trainer.fit step split: " + ", ".join(
            f"{part[:-2]} {1000 * seconds:.2f} ms ({100 * seconds / fit['step_s']:.1f}%)"
            for part, seconds in parts.items()))
        result["trainer"] = fit
        result["split"] = parts
    result["seconds"] = time.perf_counter() - began
    print(f"({name}: {result['seconds']:.0f} s end to end)")
    print("RESULT " + json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny models for a few steps: checks the script on a CPU in seconds")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                        help="which models to train (default all three)")
    parser.add_argument("--steps", type=positive, default=None, help="timed steps (default 20; smoke 3)")
    for name in ("vocab", "width", "layers", "heads", "mlp", "seq", "batch"):
        parser.add_argument(f"--{name}", type=positive, default=None,
                            help=f"dense-1b's model/batch size (default {getattr(ONE_B, name)})")
    parser.add_argument("--moe-layers", type=positive, default=None,
                        help="layers of the Qwen3-MoE-shaped model (default 4; smoke: the tiny preset's)")
    parser.add_argument("--remat", choices=REMAT_CHOICES, default=None,
                        help="per-layer rematerialization (default dots_saveable; smoke none)")
    parser.add_argument("--attention", choices=("cudnn", "xla", "einsum"), default=None,
                        help="attention implementation (default cudnn on an NVIDIA GPU, xla elsewhere)")
    parser.add_argument("--peak-flops", type=amount, default=None,
                        help="the chip's peak bf16 FLOP/s, for a device the table lacks")
    parser.add_argument("--skip-trainer", action="store_true", help="only the hand-written loop")
    args = parser.parse_args()

    import jax

    device = jax.devices()[0]
    if device.platform == "cpu" and not args.smoke:
        print(f"gpu_bench: no accelerator here (JAX sees {jax.device_count()} CPU device(s)); "
              "nothing to measure. Run it on a machine with a GPU, or pass --smoke to check the "
              "script on this CPU at a tiny size.")
        return

    began = time.perf_counter()
    base = SMOKE if args.smoke else ONE_B
    steps = args.steps or (3 if args.smoke else 20)
    # cuDNN is NVIDIA's: an AMD GPU (ROCm) is a "gpu" platform too, without it.
    attention = args.attention or ("cudnn" if "nvidia" in device.device_kind.lower() else "xla")
    remat = args.remat or ("none" if args.smoke else "dots_saveable")
    peak = args.peak_flops or peak_flops(device.device_kind)
    peak_text = f"{peak / 1e12:.0f} TFLOP/s bf16" if peak else "unknown peak"
    print(f"device: {device.device_kind} ({device.platform}), {peak_text}")

    for name in args.models:
        if name == "dense-1b":
            shape = Shape(**{k: getattr(args, k) or v for k, v in asdict(base).items()})
            model = build(shape, attention, remat)
            bench(name, model, (shape.batch, shape.seq, shape.vocab), shape.flops_per_token(),
                  args, peak, attention, remat, steps)
        else:
            preset = (SMOKE_PRESETS if args.smoke else PRESETS)[name]
            fields = {"num_layers": args.moe_layers} if name == "qwen3-moe" and args.moe_layers else {}
            model = build_preset(preset, attention, remat, fields)
            bench(name, model, (preset.batch, preset.seq, model.vocab_size),
                  causal_flops_per_token(model, preset.seq), args, peak, attention, remat, steps)
        del model
        gc.collect()
        jax.clear_caches()  # the next model's programs and buffers only
    print(f"all models: {time.perf_counter() - began:.0f} s end to end")


if __name__ == "__main__":
    main()
