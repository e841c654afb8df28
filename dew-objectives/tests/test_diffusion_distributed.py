"""Every diffusion objective trains on 8 fake devices (fsdp=4, tensor=2) to the single-device
losses, and a run stopped by SIGTERM resumes to the uninterrupted run's losses bit for bit.

One interpreter trains the four objectives in turn, so each run pays one start-up."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from dew.testing.processes import run_until_lines, shared_compilation_cache

OBJECTIVES = ("image", "video", "masked", "block")
STEPS = 6

TRAIN = r'''
import json, sys
import jax, numpy as np, optax
from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.training import MeshSpec
from dew.nn.dit import DiT, VideoDiT
from dew.nn.token_denoiser import TokenDenoiser
from dew.objectives.diffusion import DiffusionObjective
from dew.objectives.masked_diffusion import MaskedDiffusionObjective
from dew.objectives.block_diffusion import BlockDiffusionObjective

directory, losses, devices = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokens = TokenDenoiser(vocab_size=11, emb_features=16, num_layers=1, num_heads=2,
                       mlp_features=32, max_seq_len=8)
OBJECTIVES = {
    "image": DiffusionObjective(DiT(image_size=8, channels=1, patch_size=2, emb_features=16,
                                    num_layers=1, num_heads=2, mlp_features=32, num_classes=4)),
    "video": DiffusionObjective(VideoDiT(frames=2, image_size=8, channels=1, patch_size=4,
                                         emb_features=16, num_layers=1, num_heads=2,
                                         mlp_features=32), schedule="flow"),
    "masked": MaskedDiffusionObjective(tokens, seq_len=8),
    "block": BlockDiffusionObjective(tokens, seq_len=8, block_size=2),
}


def batch_of(name, index):
    rng = np.random.default_rng(index)
    if name == "image":
        return {"image": rng.integers(0, 256, (8, 8, 8, 1)).astype(np.uint8),
                "label": rng.integers(0, 4, 8).astype(np.int32)}
    if name == "video":
        return {"video": rng.integers(0, 256, (8, 2, 8, 8, 1)).astype(np.uint8)}
    return {"text": rng.integers(0, 11, (8, 9)).astype(np.int32)}


class Batches:
    def __init__(self, name):
        self.name, self.index = name, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.index += 1
        print("batch", self.name, self.index, flush=True)
        return batch_of(self.name, self.index)

    def get_state(self):
        return str(self.index).encode()

    def set_state(self, state):
        self.index = int(state.decode())


class Losses:
    def __init__(self, name):
        self.name = name

    def log(self, scalars, step):
        with open(losses, "a") as handle:
            loss = scalars.get("train/loss", scalars.get("loss"))
            handle.write(json.dumps({"objective": self.name, "step": step, "loss": loss}) + "\n")

    def artifact(self, value, step):
        pass


mesh = MeshSpec(fsdp=4, tensor=2) if devices == 8 else MeshSpec()
for name in sys.argv[4].split(","):
    data = Dataset(train=lambda partition, name=name: Batches(name), val=None, records=None, batch=8)
    checkpoints = Checkpoints(f"{directory}/{name}", keep=2)
    trainer = Trainer(OBJECTIVES[name], optax.adam(1e-3), key=jax.random.key(0), mesh=mesh,
                      checkpoints=checkpoints, tracker=Losses(name))
    trainer.fit(data, steps=STEPS, log_every=1, checkpoint_every=2)
    checkpoints.close()
    print("finished", name, flush=True)
'''.replace("STEPS", str(STEPS))


def _run(tmp_path: Path, name: str, devices: int, stop_at: set[str] = frozenset()) -> tuple[int, str, str]:
    # The children share one compilation cache: the five stopped-and-resumed one-device runs load
    # the programs the uninterrupted one-device run compiled instead of compiling them again.
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    finished = run_until_lines(
        [sys.executable, str(script), str(tmp_path / name), str(tmp_path / f"{name}.jsonl"), str(devices),
         ",".join(OBJECTIVES)],
        signal_at=sorted(stop_at), devices=devices, timeout=900, compilation_cache=shared_compilation_cache(tmp_path / "xla-cache"))
    return finished.returncode, finished.stdout, finished.stderr


def _losses(path: Path) -> dict[tuple[str, int], float]:
    table: dict[tuple[str, int], float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        key = (row["objective"], row["step"])
        assert key not in table or table[key] == row["loss"], (key, table[key], row["loss"])
        table[key] = row["loss"]
    return table


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_eight_devices_match_one_and_a_stopped_run_resumes_bitwise(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, "single", 1)
    assert code == 0, err[-4000:]
    single = _losses(tmp_path / "single.jsonl")
    code, out, err = _run(tmp_path, "mesh", 8)
    assert code == 0, err[-4000:]
    mesh = _losses(tmp_path / "mesh.jsonl")
    assert sorted(mesh) == sorted(single) == [(n, s) for n in sorted(OBJECTIVES)
                                               for s in range(1, STEPS + 1)]
    for key in single:
        np.testing.assert_allclose(mesh[key], single[key], rtol=2e-4, err_msg=str(key))

    # Stopped by SIGTERM inside each objective's run in turn, then resumed to the end (one
    # device, against the uninterrupted one-device run).
    stops = {f"batch {name} 3" for name in OBJECTIVES}
    runs = 0
    while True:
        code, out, err = _run(tmp_path, "stopped", 1, stops)
        runs += 1
        if code == 0 or runs > len(OBJECTIVES):
            break
        assert code == 143, err[-4000:]
        stops = {stop for stop in stops if stop not in out}
    assert code == 0 and runs == len(OBJECTIVES) + 1, (runs, err[-4000:])
    assert _losses(tmp_path / "stopped.jsonl") == single  # every loss, bit for bit
