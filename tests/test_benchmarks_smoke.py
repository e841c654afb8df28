"""The GPU benchmark's CPU smoke mode runs end to end, and its FLOP count matches the model; every
benchmark refuses a count that measures nothing at its command line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "benchmarks" / "gpu_bench.py"


@pytest.mark.slow  # two compiles of each of two models, in a fresh interpreter
def test_gpu_benchmark_smoke_mode_trains_both_loops_and_prints_the_figures():
    run = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--remat", "dots_saveable", "--peak-flops", "1e12",
         "--models", "dense-1b", "qwen3-moe"],
        capture_output=True, text=True, timeout=500,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    assert [r["model"] for r in results] == ["dense-1b", "qwen3-moe"]
    result, moe = results
    assert result["attention"] == "xla" and result["remat"] == "dots_saveable"
    for side in ("hand-written jit", "Trainer.fit"):
        line = next(line for line in lines if line.startswith(side))
        assert "tokens/s" in line and "MFU" in line and "n/a" not in line
    assert any(line.startswith("ratio Trainer.fit / hand-written") for line in lines)
    # Both loops learn the repeated batch: the loss falls from about log(vocab).
    hand, fit = result["hand"], result["trainer"]
    assert abs(hand["first_loss"] - math.log(128)) < 0.5
    assert hand["last_loss"] < hand["first_loss"] and fit["last_loss"] < hand["first_loss"]
    assert hand["step_s"] > 0 and fit["step_s"] > 0
    # The FLOP count's parameters: every parameter is in a matmul except the embedding
    # table and the norms' scales (2 per layer and the final one), counted from the model.
    width, vocab, layers = 64, 128, 2
    in_matmuls = result["flops_per_token"] - 6 * layers * 32 * width
    assert in_matmuls / 6 == result["parameters"] - vocab * width - (2 * layers + 1) * width
    mfu = result["flops_per_token"] * result["tokens_per_step"] / fit["step_s"] / 1e12
    assert f"MFU {100 * mfu:.1f}%" in next(line for line in lines if line.startswith("Trainer"))
    # The step split adds up to Trainer.fit's step, compute being the hand-written step.
    for each in results:
        parts = each["split"]
        assert sum(parts.values()) == pytest.approx(each["trainer"]["step_s"])
        assert min(parts.values()) >= 0 and parts["compute_s"] <= each["hand"]["step_s"]
    # The Qwen3-MoE tiny preset (64 wide, 3 layers, layer 1 dense, 8 experts of 32, 3 per token,
    # 4 heads and 2 KV heads of 16, vocab 512, untied head) counted by hand: a token passes
    # through q/k/v/o, the router and 3 experts (the dense layer's 3 matrices), then the head.
    attention = 2 * 64 * 64 + 2 * 64 * 2 * 16
    weights = 3 * attention + 2 * (3 * 3 * 64 * 32 + 64 * 8) + 3 * 64 * 128 + 64 * 512
    assert moe["flops_per_token"] == 6 * weights + 6 * 3 * 32 * 64
    assert moe["hand"]["last_loss"] < moe["hand"]["first_loss"]
    assert abs(moe["hand"]["first_loss"] - math.log(512)) < 1.0  # near uniform at the start


def test_gpu_benchmark_without_an_accelerator_says_so_and_exits_cleanly():
    run = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no accelerator here" in run.stdout and "RESULT" not in run.stdout


def test_peak_table_matches_device_kinds():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import gpu_bench
    finally:
        sys.path.remove(str(BENCH.parent))
    assert gpu_bench.peak_flops("NVIDIA H200") == 989e12
    assert gpu_bench.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_bench.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_bench.peak_flops("cpu") is None
    # Whole words: an L40 is no L4, an H100 NVL no SXM H100 (its own table matched by substring).
    assert gpu_bench.peak_flops("NVIDIA L40") == 181e12 and gpu_bench.peak_flops("NVIDIA H100 NVL") == 835e12
    # the default model is the size the benchmark is named for
    params = gpu_bench.ONE_B.matmul_parameters() + gpu_bench.ONE_B.vocab * gpu_bench.ONE_B.width
    assert 0.9e9 < params < 1.2e9


@pytest.mark.slow  # writes a small checkpoint and loads it in three fresh interpreters
def test_pretrained_load_benchmark_smoke_mode_prints_its_ratios():
    bench = Path(__file__).parent.parent / "benchmarks" / "pretrained_load_bench.py"
    run = subprocess.run([sys.executable, str(bench), "--smoke"], capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])
    assert result["bytes"] > 4 * 2**20
    for key in ("wall_ratio", "dew_peak_ratio", "scanned_wall_ratio", "scanned_peak_ratio",
                "safetensors_peak_ratio"):
        assert len(result[key]) == 1 and 0 < result[key][0] < 100
    for name in ("wall(dew) / wall(safetensors)", "peak(dew) / checkpoint size",
                 "wall(dew-scanned) / wall(safetensors)", "peak(dew-scanned) / checkpoint size"):
        assert any(line.startswith(name) and "min" in line and "median" in line for line in lines)


REFUSED = [
    # A count of 0 ended in a traceback (min() of nothing, a division by zero) or, clamped or read as
    # the default, printed figures of another setting or NaN with status 0.
    ("ledger_bench.py", ["--steps", "0"], "argument --steps: 0 is not at least 1"),
    ("diffusion_bench.py", ["--repeats", "0"], "argument --repeats: 0 is not at least 1"),
    ("gpu_bench.py", ["--smoke", "--width", "0"], "argument --width: 0 is not at least 1"),
    ("checkpoint_bench.py", ["--megabytes", "-1"], "argument --megabytes: -1 is not a finite number above 0"),
    ("ring_attention_bench.py", ["--sequences", "0"], "argument --sequences: 0 is not at least 1"),
    ("trackers_bench.py", ["--repeats", "0"], "argument --repeats: 0 is not at least 1"),
    # Accepted, then a ZeroDivisionError in the child (a lone step has no timed steps after it), a
    # StageDivisionError's traceback, and nothing measured at all with status 0.
    ("trainer_bench.py", ["--steps", "1"], "--steps must be at least 2"),
    ("pipeline_bench.py", ["--layers", "3"], "--layers 3 does not split into the 4 pipeline stages"),
    ("data_scale_bench.py", ["--only-wait", "--skip-wait"], "not allowed with argument"),
]


@pytest.mark.parametrize("script, argv, said", REFUSED, ids=[f"{s} {' '.join(a)}" for s, a, _ in REFUSED])
def test_a_benchmark_refuses_a_setting_that_measures_nothing(script, argv, said, tmp_path):
    run = subprocess.run([sys.executable, str(BENCH.parent / script), *argv], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 2 and said in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # refused before anything was written
