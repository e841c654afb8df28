"""Loading a published checkpoint: Pretrained.load against safetensors' own loader on the same files.

Run: .venv/bin/python benchmarks/pretrained_load_bench.py [--megabytes 1100] [--repeats 3] [--smoke]

Writes a Qwen 3-shaped checkpoint of random float32 weights (at least a
gigabyte by default, in two shards with an index, as transformers writes
them), then, alternating which goes first, loads it in fresh interpreters:

  * safetensors: ``safetensors.numpy.load_file`` of every shard (every tensor
    whole in host memory, nothing converted): the floor;
  * dew: ``Pretrained.load`` (config read, family picked, every tensor
    converted to dew's layout and placed on the device, the CPU here);
  * dew-scanned: ``Pretrained.load(scan_layers=True)``, each layer's tensor
    copied into its slot of the stacked weight the scanned model holds.

Printed per load: wall time and peak host memory above the interpreter's
own before loading; then, as ratios within this run, min and median:

  * wall(dew) / wall(safetensors)          (goal <= 1.5), and dew-scanned's
  * peak(dew) / checkpoint size            (goal <= 1.3), and dew-scanned's
  * peak(safetensors) / checkpoint size    (for reference)

``--smoke`` writes an 8 MB checkpoint and loads it once each (what the test
suite runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

from dew.cli.runs import amount, positive

RESULT = "RESULT "

# The peak is this process's own (VmHWM, reset when the child's program starts): ru_maxrss keeps the
# parent's high-water mark across exec, so a child of a parent that had written the checkpoint
# measured the parent's memory, not its load's.
_PROBE = """
import json, resource, sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
def high_water():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
{imports}
before = rss()
start = time.perf_counter()
{load}
wall = time.perf_counter() - start
print("RESULT " + json.dumps({{"wall": wall, "peak": high_water() - before}}))
"""

LOADERS = {
    "safetensors": ("import safetensors.numpy, pathlib",
                    "tensors = {}\n"
                    "for f in sorted(pathlib.Path(sys.argv[1]).glob('*.safetensors')):\n"
                    "    tensors.update(safetensors.numpy.load_file(str(f)))"),
    # JAX's backend started and the family's modules imported, as in any program that loads weights.
    "dew": ("import jax\nfrom dew.pretrained import Pretrained\nimport dew.families.qwen3\njax.devices()",
            "loaded = Pretrained.load(sys.argv[1])\njax.block_until_ready(loaded.variables)"),
    "dew-scanned": ("import jax\nfrom dew.pretrained import Pretrained\nimport dew.families.qwen3\njax.devices()",
                    "loaded = Pretrained.load(sys.argv[1], scan_layers=True)\n"
                    "jax.block_until_ready(loaded.variables)"),
}


def write_checkpoint(directory: Path, megabytes: float) -> int:
    """A Qwen 3-shaped float32 checkpoint of about megabytes, in two shards; its size in bytes."""
    from safetensors.numpy import save_file

    from dew.families import family

    hidden, inter, vocab, heads, kv, width = 1024, 3072, 32000, 16, 8, 64
    per_layer = 4 * (hidden * heads * width * 2 + hidden * kv * width * 2 + 3 * hidden * inter)
    layers = max(1, int((megabytes * 2**20 - 8 * vocab * hidden) // per_layer))
    if megabytes < 64:  # the smoke size: a smaller vocabulary and width
        hidden, inter, vocab, heads, kv, width, layers = 128, 384, 2048, 4, 2, 32, max(
            1, int((megabytes * 2**20 - 8 * 2048 * 128) // (4 * (128 * 4 * 32 * 2 + 128 * 2 * 32 * 2
                                                                 + 3 * 128 * 384))))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": width,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": False, "dtype": "float32"}
    model = family("qwen3").model(config)
    table = family("qwen3").table(model)
    rng = np.random.default_rng(0)
    names = list(table)
    half = len(names) // 2
    weight_map, total = {}, 0
    for number, chunk in enumerate((names[:half], names[half:]), start=1):
        file = f"model-{number:05d}-of-00002.safetensors"
        tensors = {name: rng.standard_normal(table[name].hf_shape, dtype=np.float32) * 0.02
                   for name in chunk}
        total += sum(t.nbytes for t in tensors.values())
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in chunk})
        del tensors
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return total


def measure(kind: str, directory: Path) -> dict[str, float]:
    imports, load = LOADERS[kind]
    code = _PROBE.format(imports=imports, load=textwrap.indent(load, ""))
    done = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=amount, default=1100.0)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--smoke", action="store_true", help="an 8 MB checkpoint, loaded once each")
    args = parser.parse_args(argv)
    megabytes, repeats = (8.0, 1) if args.smoke else (args.megabytes, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        size = write_checkpoint(directory, megabytes)
        print(f"checkpoint: {size / 2**20:.0f} MiB of float32 weights in 2 shards")
        walls, dew_peaks, st_peaks, scanned_walls, scanned_peaks = [], [], [], [], []
        for repeat in range(repeats):
            order = ("safetensors", "dew", "dew-scanned")
            order = order if repeat % 2 == 0 else order[::-1]
            got = {kind: measure(kind, directory) for kind in order}
            for kind in order:
                print(f"  {kind:11s} wall {got[kind]['wall']:.3f}s  peak {got[kind]['peak'] / 2**20:.0f} MiB")
            walls.append(got["dew"]["wall"] / got["safetensors"]["wall"])
            dew_peaks.append(got["dew"]["peak"] / size)
            st_peaks.append(got["safetensors"]["peak"] / size)
            scanned_walls.append(got["dew-scanned"]["wall"] / got["safetensors"]["wall"])
            scanned_peaks.append(got["dew-scanned"]["peak"] / size)

    def line(name: str, values: list[float], goal: str) -> str:
        return f"{name:38s} min {min(values):.2f}  median {statistics.median(values):.2f}  {goal}"

    print(line("wall(dew) / wall(safetensors)", walls, "(goal <= 1.5)"))
    print(line("peak(dew) / checkpoint size", dew_peaks, "(goal <= 1.3)"))
    print(line("wall(dew-scanned) / wall(safetensors)", scanned_walls, "(goal <= 1.5)"))
    print(line("peak(dew-scanned) / checkpoint size", scanned_peaks, "(goal <= 1.3)"))
    print(line("peak(safetensors) / checkpoint size", st_peaks, "(reference)"))
    print(RESULT + json.dumps({"bytes": size, "wall_ratio": walls, "dew_peak_ratio": dew_peaks,
                               "scanned_wall_ratio": scanned_walls, "scanned_peak_ratio": scanned_peaks,
                               "safetensors_peak_ratio": st_peaks}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
