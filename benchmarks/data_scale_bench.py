"""Data at real scale: on-the-fly tokenization and packing, the data wait of a step, host memory.

Prints, for the Python standard library's source as JSONL documents (every
machine has it) and a byte-level BPE tokenizer trained here with the
``tokenizers`` library:

1. tokenize: the tokenizer alone over every document (``encode_batch`` in
   chunks: the rate no reader can beat), TokenWindows (tokenize everything
   first), and HFText's one-time count of tokens per block;
2. stream: HFText's endless stream, tokenizing and packing as it goes, in
   tokens per second of packed windows delivered, with 0 and 2 Grain worker
   processes (min and median over timed chunks), and as a ratio of the
   tokenizer's own rate;
3. wait: the tiny-lm recipe's model and step (Trainer + LMObjective) fed by
   that stream, with the share of wall time the loop spent waiting for data
   (the trainer's own Goodput record; goal <= 1%): the stream started before
   the state is placed (the trainer's order) against the old order (opened
   after placement), alternated ``--rounds`` times, min and median;
4. memory: a Parquet corpus of ``--parquet-mb`` megabytes of text (20 by
   default; 2048 for the 2 GB run) generated into a temporary folder, indexed
   and streamed by a fresh process whose peak resident memory is printed,
   beside a process that only imports the same modules (goal <= 500 MB).

Run: .venv/bin/python benchmarks/data_scale_bench.py [--quick] [--parquet-mb 2048] [--skip-wait]
     [--only-wait] [--wait-steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dew.cli.runs import positive

VOCAB = 8192


def corpus(folder: Path, limit: int | None) -> tuple[Path, list[str]]:
    """The stdlib's .py files as one JSONL file of documents."""
    from dew.data.sources import stdlib_corpus

    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_corpus(limit_files=limit)]
    texts = [t for t in texts if t]
    path = folder / "stdlib.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    return path, texts


def train_tokenizer(folder: Path, texts: list[str]) -> Path:
    """A byte-level BPE of VOCAB ids trained on the first 4 MB of the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    sample, size = [], 0
    for text in texts:
        sample.append(text)
        size += len(text)
        if size > 4 << 20:
            break
    tokenizer.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def tokenize(files: Path, texts: list[str], tokenizer_path: Path, length: int) -> float:
    """Print the tokenizer's own rate, TokenWindows' and HFText's index pass; return the first."""
    from dew.data.hf_text import HFText
    from dew.data.hf_tokenizer import HFTokenizer
    from dew.data.token_windows import TokenWindows

    tokenizer = HFTokenizer.from_file(tokenizer_path)
    began = time.perf_counter()
    tokens = sum(len(ids) + 1 for i in range(0, len(texts), 256) for ids in tokenizer.encode_batch(texts[i:i + 256]))
    raw = tokens / (time.perf_counter() - began)
    print(f"tokenize  {len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} M characters, {tokens / 1e6:.2f} M "
          f"tokens: the tokenizer alone {raw / 1e6:.2f} M tokens/s (encode_batch of 256)")
    began = time.perf_counter()
    windows = TokenWindows(files=str(files), length=length, tokenizer=str(tokenizer_path)).windows()
    seconds = time.perf_counter() - began
    print(f"          TokenWindows (all ahead): {windows.size / seconds / 1e6:.2f} M tokens/s "
          f"({windows.size / seconds / raw:.2f} x the tokenizer)")
    for workers in (0, 2):
        began = time.perf_counter()
        counts = HFText(files=str(files), tokenizer=str(tokenizer_path), index_workers=workers).token_counts()
        seconds = time.perf_counter() - began
        print(f"          HFText's count per block, {workers} workers: {counts.sum() / seconds / 1e6:.2f} M tokens/s "
              f"({counts.sum() / seconds / raw:.2f} x the tokenizer; {len(counts)} blocks)")
    return raw


def stream(files: Path, tokenizer_path: Path, *, length: int, batch: int, workers: int, steps: int,
           raw: float) -> None:
    from dew.data.base import DataPartition
    from dew.data.hf_text import HFText

    data = HFText(files=str(files), length=length, tokenizer=str(tokenizer_path)).load(
        batch=batch, seed=0, workers=workers)
    iterator = data.train(DataPartition())
    next(iterator)  # start-up (worker spawn) is not the steady rate
    chunk = max(1, steps // 5)
    rates = []
    for _ in range(5):
        began = time.perf_counter()
        tokens = sum(next(iterator)["text"].size for _ in range(chunk))
        rates.append(tokens / (time.perf_counter() - began))
    iterator.close()
    print(f"stream    HFText, windows of {length + 1}, batch {batch}, workers {workers}: min "
          f"{min(rates) / 1e6:.2f}, median {statistics.median(rates) / 1e6:.2f} M tokens/s "
          f"({statistics.median(rates) / raw:.2f} x the tokenizer alone)")


class _Records:
    """A tracker that keeps the typed records (Goodput) the trainer reports."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def log(self, scalars: dict[str, float], step: int) -> None:
        pass

    def artifact(self, value: Any, step: int) -> None:
        self.records.append(value)

    def close(self) -> None:
        pass


class _Timed:
    """Wraps a stream; records how long each next() takes (the first, start-up, apart)."""

    def __init__(self, stream: Any, seconds: list[float]) -> None:
        self.stream, self.seconds = stream, seconds

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        began = time.perf_counter()
        try:
            return next(self.stream)
        finally:
            self.seconds.append(time.perf_counter() - began)

    def get_state(self) -> bytes:
        return self.stream.get_state()

    def set_state(self, state: bytes) -> None:
        self.stream.set_state(state)

    def close(self) -> None:
        self.stream.close()


def wait(files: Path, tokenizer_path: Path, *, steps: int, workers: int, overlap: bool) -> tuple[float, float, float]:
    """The tiny-lm recipe's model and step, fed by HFText; the data wait as a share of wall time.

    overlap False is the old order (the stream opened once the state is
    placed). Returns the Goodput share of the wall spent waiting for data,
    the share after the first step, and the first next()'s own seconds.
    """
    import jax

    from dew import Dataset, Trainer, models
    from dew.data.hf_text import HFText
    from dew.objectives.lm import LMObjective
    from dew.recipes.config import RunConfig
    from dew.recipes.run import run_optimizer
    from dew.telemetry.records import Goodput

    recipe = RunConfig.load("tiny-lm")
    seq_len = recipe.objective.fields["seq_len"]
    reader = HFText(files=str(files), length=seq_len, tokenizer=str(tokenizer_path))
    loaded = reader.load(batch=recipe.data.batch, seed=0, workers=workers)
    seconds: list[float] = []
    data = Dataset(train=lambda partition: _Timed(loaded.train(partition), seconds), val=None,
                   records=loaded.records, batch=loaded.batch)
    fields = {**recipe.model.fields, "vocab_size": reader.text_tokenizer().vocab_size}
    model = models.build(recipe.model.name, **fields)
    tracker = _Records()
    trainer = Trainer(LMObjective(model, seq_len=seq_len), run_optimizer(recipe, steps), key=jax.random.key(0),
                      tracker=tracker)
    trainer._overlap_start = overlap
    trainer.fit(data, steps=steps, log_every=max(1, steps // 4))
    goodput = next(r for r in tracker.records if isinstance(r, Goodput))
    steady = goodput.wall_seconds - goodput.first_step_seconds
    later = sum(seconds[1:])
    return goodput.data_seconds / goodput.wall_seconds, later / max(steady, 1e-9), seconds[0]


def waits(files: Path, tokenizer_path: Path, *, steps: int, workers: int, rounds: int) -> None:
    """wait() with the stream started before placement (after) and after it (before), alternated."""
    arms: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for _ in range(rounds):
        for overlap in (False, True):
            arms[overlap].append(wait(files, tokenizer_path, steps=steps, workers=workers, overlap=overlap))
    for overlap, name in ((False, "opened after placement (before)"), (True, "started before placement (after)")):
        shares = [100 * share for share, _, _ in arms[overlap]]
        later = [100 * rest for _, rest, _ in arms[overlap]]
        first = [seconds for _, _, seconds in arms[overlap]]
        print(f"wait      tiny-lm, {steps} steps, workers {workers}, stream {name}: data wait min "
              f"{min(shares):.2f}%, median {statistics.median(shares):.2f}% of the wall (Goodput; goal <= 1%); "
              f"after the first step median {statistics.median(later):.2f}%; the first next() itself median "
              f"{statistics.median(first):.2f} s")
    ratios = [a[0] / max(b[0], 1e-9) for a, b in zip(arms[False], arms[True], strict=True)]
    print(f"          before / after, per round: min {min(ratios):.1f}x, median {statistics.median(ratios):.1f}x")


def write_parquet(folder: Path, megabytes: int) -> Path:
    """megabytes of distinct text as Parquet: documents of random words, row groups of ~16 MB."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    words = np.asarray("the of and to in is it that for you was with on as have be at one this by from data "
                       "model dew jax tokens windows packed stream corpus memory parquet grain shard".split())
    path = folder / "corpus.parquet"
    written = 0
    with pq.ParquetWriter(path, pa.schema([("id", pa.int64()), ("text", pa.string())]),
                          compression="zstd") as writer:
        first = 0
        while written < megabytes << 20:
            lengths = rng.integers(50, 1500, size=4096)
            picks = rng.integers(0, len(words), size=int(lengths.sum()))
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            texts = [" ".join(words[picks[a:b]]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            written += sum(map(len, texts))
            writer.write_table(pa.table({"id": np.arange(first, first + len(texts)), "text": texts}))
            first += len(texts)
    return path


CHILD = """
import resource, sys, time
from absl import flags
flags.FLAGS(sys.argv[:1])
from dew.data.base import DataPartition
from dew.data.hf_text import HFText
mode, files, tokenizer, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mode == "stream":
    began = time.perf_counter()
    data = HFText(files=files, length=1023, tokenizer=tokenizer, index_workers=2).load(batch=16)
    indexed = time.perf_counter() - began
    stream = data.train(DataPartition())
    began = time.perf_counter()
    tokens = sum(next(stream)["text"].size for _ in range(steps))
    print(f"INDEX {indexed:.1f} STREAM {tokens / (time.perf_counter() - began):.0f} WINDOWS {len(data.train.source)}")
status = open("/proc/self/status").read()  # VmHWM: this process's own peak (ru_maxrss counts the parent's)
peak = int(status.split("VmHWM:")[1].split()[0]) / 1024
workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(f"PEAK {peak:.0f} WORKERS {workers:.0f}")
"""


def memory(folder: Path, tokenizer_path: Path, megabytes: int, steps: int) -> None:
    began = time.perf_counter()
    path = write_parquet(folder, megabytes)
    print(f"memory    wrote {megabytes} MB of text as {path.stat().st_size / 1e6:.0f} MB of Parquet "
          f"({time.perf_counter() - began:.0f} s)")
    out = {}
    for mode in ("import", "stream"):
        run = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(tokenizer_path), str(steps)],
                             capture_output=True, text=True, timeout=7200)
        if run.returncode != 0:
            raise RuntimeError(run.stderr[-3000:])
        out[mode] = dict(zip(*[iter(run.stdout.split()[-10 if mode == "stream" else -4:])] * 2, strict=True))
    streamed = out["stream"]
    print(f"          index pass (2 workers) {float(streamed['INDEX']):.0f} s; {steps} batches of 16 x 1024 at "
          f"{float(streamed['STREAM']) / 1e6:.2f} M tokens/s over {streamed['WINDOWS']} windows")
    print(f"          peak resident memory: {streamed['PEAK']} MB streaming, {out['import']['PEAK']} MB for the "
          f"imports alone (goal <= 500 MB); the index workers at most {streamed['WORKERS']} MB each "
          f"(ru_maxrss, which starts from the parent's size when they were spawned)")


def main() -> None:
    from absl import flags

    flags.FLAGS(sys.argv[:1])  # Grain's worker processes read absl flags
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer documents and steps")
    parser.add_argument("--parquet-mb", type=positive, default=20, help="megabytes of text in the Parquet corpus")
    waiting = parser.add_mutually_exclusive_group()
    waiting.add_argument("--skip-wait", action="store_true", help="skip the training run")
    waiting.add_argument("--only-wait", action="store_true", help="only the training runs (part 3)")
    parser.add_argument("--wait-steps", type=positive, default=20, help="steps of each training run")
    parser.add_argument("--rounds", type=positive, default=3, help="alternations of the two stream orders")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        files, texts = corpus(folder, 150 if args.quick else 1200)
        tokenizer_path = train_tokenizer(folder, texts)
        if not args.only_wait:
            raw = tokenize(files, texts, tokenizer_path, 1023)
            for workers in (0, 2):
                stream(files, tokenizer_path, length=1023, batch=16, workers=workers,
                       steps=20 if args.quick else 100, raw=raw)
        if not args.skip_wait:
            for workers in (0, 2):
                waits(files, tokenizer_path, steps=args.wait_steps, workers=workers,
                      rounds=args.rounds)
        if args.only_wait:
            return
        memory(folder, tokenizer_path, args.parquet_mb, 20 if args.quick else 200)



if __name__ == "__main__":
    main()
