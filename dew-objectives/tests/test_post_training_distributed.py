"""Every objective of the GRPO family, the preference losses and the reward model trains on 8 fake
devices (data=2, fsdp=2, tensor=2) to the single-device numbers, and a run stopped by SIGTERM mid-rollout
resumes to the uninterrupted run's numbers and weights bit for bit.

Two interpreters hold every variant: one trains each on one device; the other trains each on the
8-device mesh, then again with a SIGTERM sent from inside the step's rollout (the reward's call, or for
DAPO a refill round's; the stream's for the pair objectives), then resumes that run from its checkpoint
with everything rebuilt: objective, rollout, stream and trainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from dew.testing.processes import run_until_lines, shared_compilation_cache

pytestmark = pytest.mark.slow

RL = ("dr_grpo", "dapo", "gspo", "gspo_token", "rloo", "cispo")
PAIRS = ("dpo_hinge", "dpo_robust", "dpo_bco_pair", "orpo", "cpo", "kto", "reward_model")
STEPS = 5

TRAIN = r'''
import hashlib, json, os, signal, sys
import jax, numpy as np, optax
from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.data.addition import Addition
from dew.models import build
from dew.training import MeshSpec, Preempted
from dew.objectives.dpo import DPOObjective
from dew.objectives.grpo_family import (CISPOObjective, DAPOObjective, DrGRPOObjective, GSPOObjective,
                                        RLOOObjective)
from dew.objectives.kto import KTOObjective
from dew.objectives.reference_free import CPOObjective, ORPOObjective
from dew.objectives.reward_model import RewardModelObjective

out, devices, names = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
STEPS = STEPS_VALUE
mesh = MeshSpec(fsdp=2, tensor=2) if devices == 8 else MeshSpec()  # data parallelism takes the other 2
model = build("causal_transformer", vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
              mlp_features=32, max_seq_len=16)
calls, stop = [0], {"reward": None, "batch": None}


def stop_here():
    print("stopping", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's signal, delivered inside the rollout


def reward(completions, context):
    calls[0] += 1
    if calls[0] == stop["reward"]:
        stop_here()
    return [float(len(c) > 0 and ord(c[0]) % 2 == 0) for c in completions]


RL = dict(reward=reward, max_new_tokens=3, temperature=1.0, stop_token=10)
OBJECTIVES = {
    "dr_grpo": lambda: DrGRPOObjective(model, group_size=4, **RL),
    "dapo": lambda: DAPOObjective(model, group_size=2, overlong_buffer=1, **RL),
    "gspo": lambda: GSPOObjective(model, group_size=4, clip_low=0.01, clip_high=0.01, **RL),
    "gspo_token": lambda: GSPOObjective(model, group_size=4, ratio="sequence_token", beta=0.04, **RL),
    "rloo": lambda: RLOOObjective(model, group_size=4, **RL),
    "cispo": lambda: CISPOObjective(model, group_size=4, **RL),
    "dpo_hinge": lambda: DPOObjective(model, 8, loss_type="hinge"),
    "dpo_robust": lambda: DPOObjective(model, 8, loss_type="robust", label_smoothing=0.1),
    "dpo_bco_pair": lambda: DPOObjective(model, 8, loss_type="bco_pair"),
    "orpo": lambda: ORPOObjective(model, 8),
    "cpo": lambda: CPOObjective(model, 8),
    "kto": lambda: KTOObjective(model, 8),
    "reward_model": lambda: RewardModelObjective(model, 8),
}
FORMS = {"kto": ("labelled", 8), "dapo": ("prompts", 8)}


class Stream:
    """The reader's stream, counting batches (a stop may be asked at one) and resumable as it is."""

    def __init__(self, inner):
        self.inner, self.index = inner, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.index += 1
        if self.index == stop["batch"]:
            stop_here()
        return next(self.inner)

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)

    def close(self):
        getattr(self.inner, "close", lambda: None)()


class Log:
    def __init__(self, name, tag):
        self.name, self.tag = name, tag

    def log(self, scalars, step):
        kept = {k: v for k, v in scalars.items() if "time" not in k and "throughput" not in k}
        with open(f"{out}/log.jsonl", "a") as handle:
            handle.write(json.dumps({"tag": self.tag, "name": self.name, "step": step, "scalars": kept}) + "\n")

    def artifact(self, value, step):
        pass


def train(name, tag, directory):
    objective = OBJECTIVES[name]()
    form, batch = FORMS.get(name, ("prompts", 4) if name in RL_NAMES else ("pairs", 8))
    inner = Addition(form=form, problems=64, max_operand=9).load(batch=batch, seed=0)
    data = Dataset(train=lambda partition: Stream(inner.train(partition)), records=inner.records, batch=batch)
    # The uninterrupted runs keep no checkpoints; the stopped one saves where it stops, and resumes there.
    checkpoints = Checkpoints(directory, keep=1) if tag == "stopped" else None
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), mesh=mesh, checkpoints=checkpoints,
                      tracker=Log(name, tag), rollout=objective.rollout())
    try:
        state = trainer.fit(data, steps=STEPS, log_every=1)
    except Preempted as stopped:
        print("preempted", name, stopped.step, flush=True)
        return None
    finally:
        if checkpoints is not None:
            checkpoints.close()
    leaves = jax.tree.leaves(jax.device_get(state.params))
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()


RL_NAMES = set("RL_LIST".split(","))
for name in names:
    calls[0], stop["reward"], stop["batch"] = 0, None, None
    digest = train(name, "whole", f"{out}/whole/{name}")
    print("digest", name, "whole", digest, flush=True)
    if devices == 1:
        continue
    if name in RL_NAMES:
        rounds = [0] * (STEPS + 1)
        for line in open(f"{out}/log.jsonl"):
            row = json.loads(line)
            if row["tag"] == "whole" and row["name"] == name:
                rounds[row["step"]] = int(row["scalars"].get("train/sampling_rounds", 1))
        # Inside step 3's rollout; for DAPO inside the second round of the first later step that refilled.
        at = next((s for s in range(3, STEPS) if rounds[s] > 1), None) if name == "dapo" else 3
        assert at is not None, f"no step of {name} refilled: {rounds}"
        calls[0], stop["reward"] = 0, sum(rounds[1:at]) + (2 if name == "dapo" else 1)
        print("stop", name, "step", at, "reward call", stop["reward"], flush=True)
    else:
        stop["batch"] = 3
    assert train(name, "stopped", f"{out}/stopped/{name}") is None, f"{name} was not stopped"
    calls[0], stop["reward"], stop["batch"] = 0, None, None
    digest = train(name, "stopped", f"{out}/stopped/{name}")
    print("digest", name, "stopped", digest, flush=True)
'''.replace("STEPS_VALUE", str(STEPS)).replace("RL_LIST", ",".join(RL))


def _table(path: Path, tag: str) -> dict[tuple[str, int, str], float]:
    table: dict[tuple[str, int, str], float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["tag"] != tag:
            continue
        for metric, value in row["scalars"].items():
            key = (row["name"], row["step"], metric)
            assert key not in table or table[key] == value, (key, table[key], value)
            table[key] = value
    return table


def _digests(stdout: str) -> dict[tuple[str, str], str]:
    return {(p[1], p[2]): p[3] for p in (line.split() for line in stdout.splitlines()) if p[:1] == ["digest"]}


@pytest.mark.timeout(3600)
def test_each_variant_matches_on_eight_devices_and_resumes_bitwise_mid_rollout(tmp_path: Path) -> None:
    names = ",".join(RL + PAIRS)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    single, mesh = tmp_path / "single", tmp_path / "mesh"
    single.mkdir(), mesh.mkdir()
    one = run_until_lines([sys.executable, str(script), str(single), "1", names], devices=1, timeout=2400)
    assert one.returncode == 0, one.stderr[-4000:]
    # The stopped and resumed runs load the programs the whole run compiled.
    eight = run_until_lines([sys.executable, str(script), str(mesh), "8", names], devices=8, timeout=2400,
                            compilation_cache=shared_compilation_cache(tmp_path / "xla-cache"))
    assert eight.returncode == 0, eight.stderr[-4000:]

    alone, sharded = _table(single / "log.jsonl", "whole"), _table(mesh / "log.jsonl", "whole")
    assert sorted({(n, s) for n, s, _ in alone}) == [(n, s) for n in sorted(RL + PAIRS) for s in range(1, STEPS + 1)]
    assert set(alone) == set(sharded)
    for (name, step, metric), value in alone.items():
        if metric.endswith("accuracy") and step == 1:
            # It counts rows on one side of a threshold; at step 1 the policy is its reference, so every
            # log-ratio is 0 up to rounding and the rows are tied.
            continue
        np.testing.assert_allclose(sharded[name, step, metric], value, rtol=2e-4, atol=1e-6,
                                   err_msg=str((name, step, metric)))

    # Stopped mid-rollout and resumed: every logged number and the final weights, bit for bit.
    assert eight.stdout.count("preempted ") == len(RL + PAIRS), eight.stdout[-3000:]
    assert _table(mesh / "log.jsonl", "stopped") == sharded
    digests = _digests(eight.stdout)
    for name in RL + PAIRS:
        assert digests[(name, "stopped")] == digests[(name, "whole")], name
    # DAPO's stop landed in a refill round, and its dynamic sampling dropped groups.
    assert any(sharded[("dapo", s, "train/dropped_groups")] > 0 for s in range(1, STEPS + 1))
    assert "stop dapo step" in eight.stdout
