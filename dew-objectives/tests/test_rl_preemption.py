"""A PPO run stopped by SIGTERM in the middle of a rollout resumes to the bit, its rollout included.

The rollout serves one sample for two epochs of two minibatches (four
steps), so the run is stopped inside a sample: what the remaining steps
train on exists only in the rollout's saved state. The resumed run must log
the losses and end with the parameters of an uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dew.provenance.ledger import audit, read_ledger
from dew.testing.processes import run_until_lines, shared_compilation_cache

pytestmark = pytest.mark.slow

TRAIN = r'''
import hashlib, json, sys, time
import jax, numpy as np, optax
from dew import Checkpoints, Trainer
from dew.data.addition import Addition
from dew.models import build
from dew.objectives.ppo import PPOObjective

from dew.training.runtime import PreemptionNotice

directory, losses, hold_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
calls = [0]

def reward(completions, context):
    calls[0] += 1
    print("reward", calls[0], flush=True)
    if calls[0] == hold_at:  # the scorer the test signals stays until the signal has arrived
        deadline = time.monotonic() + 120
        while not PreemptionNotice.received() and time.monotonic() < deadline:
            time.sleep(0.01)
    return [float(c.strip() == "5") for c in completions]

class Losses:
    def log(self, scalars, step):
        with open(losses, "a") as handle:
            kept = {k: v for k, v in scalars.items() if "time" not in k and "throughput" not in k}
            handle.write(json.dumps({"step": step, "scalars": kept}) + "\n")
    def artifact(self, value, step):
        pass

model = build("causal_transformer", vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
              mlp_features=32, max_seq_len=16)
objective = PPOObjective(model, reward=reward, max_new_tokens=3, epochs=2, minibatches=2, stop_token=10,
                         kl_horizon=50.0)
data = Addition(form="prompts", problems=64, max_operand=9).load(batch=8, seed=0)
checkpoints = Checkpoints(directory, keep=2)
trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), checkpoints=checkpoints,
                  tracker=Losses(), rollout=objective.rollout())
state = trainer.fit(data, steps=10, log_every=1, checkpoint_every=100)
checkpoints.wait()
digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(state.params)))
print("finished", int(state.step), digest.hexdigest(), flush=True)
'''


def _train(tmp_path: Path, name: str, cache: Path, trigger: str | None = None) -> tuple[int, str, str]:
    # cache: the three runs of one test share their compiled programs (the stopped and the
    # resumed run load what the uninterrupted one compiled).
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    hold_at = trigger.split()[-1] if trigger is not None else "0"  # "reward 2": hold the second call
    done = run_until_lines([sys.executable, str(script), str(tmp_path / name), str(tmp_path / f"{name}.jsonl"),
                            hold_at],
                           signal_at=[trigger] if trigger is not None else [], timeout=300,
                           compilation_cache=cache)
    return done.returncode, done.stdout, done.stderr


def _losses(path: Path) -> dict[tuple[int, str], float]:
    table: dict[tuple[int, str], float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for name, value in row["scalars"].items():
            key = (row["step"], name)
            assert key not in table or table[key] == value, (key, table[key], value)
            table[key] = value
    return table


def test_a_run_stopped_mid_rollout_resumes_bitwise(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    whole.mkdir()
    cache = shared_compilation_cache(tmp_path / "xla-cache")
    code, out, err = _train(whole, "run", cache)
    assert code == 0, err[-4000:]
    expected = [line for line in out.splitlines() if line.startswith("finished")]
    assert expected and expected[0].startswith("finished 10")
    assert out.count("reward ") == 3  # steps 1, 5 and 9 sample; the others reuse a sample
    # Only the steps that sample draw prompts from the stream: the serving steps drew a batch each that
    # no rollout read (3 of every 4 prompts thrown away), and the data ledger called them consumed.
    ledger = read_ledger(whole / "run")
    assert [(s.step, s.first, s.end) for s in ledger.steps] == [(1, 0, 8), (5, 8, 16), (9, 16, 24)]
    # The run trained 10 steps, though its last to read records was 9: dew audit counted 9.
    alone = audit(ledger)
    assert alone.exact and (ledger.last, alone.steps, alone.compared, alone.records) == (10, 10, 10, 24)

    # Stopped while the second sample is being scored (step 5): the first sample's state is
    # behind it and the second's is not yet served.
    code, out, err = _train(tmp_path, "run", cache, trigger="reward 2")
    assert code == 143, err[-4000:]
    stopped = [line for line in err.splitlines() if line.startswith("dew: preempted at step")]
    step = int(stopped[0].split()[4].rstrip(";"))
    assert 5 <= step < 10
    code, out, err = _train(tmp_path, "run", cache)
    assert code == 0, err[-4000:]
    assert [line for line in out.splitlines() if line.startswith("finished")] == expected
    assert _losses(tmp_path / "run.jsonl") == _losses(whole / "run.jsonl")
    resumed = audit(read_ledger(tmp_path / "run"), ledger)
    assert resumed.exact and resumed.compared == 10
