"""Pipeline schedules beyond GPipe: 1F1B and interleaved 1F1B train to the single-device losses.

The timetables are checked against the dependencies a schedule must keep (computed here from the
microbatch and chunk numbers, not from the timetable's own formulas); the trained runs against one
device running the stack as a plain scan, on 8 fake CPU devices, with documents packed into rows so
the segment ids travel through the stages with the activations.
"""

from __future__ import annotations

import json

import pytest

from dew.nn.pipeline import PipelineSchedule
from dew.nn.timetable import timetable
from dew.training.placement.mesh import MeshSpec

GRID = [(stages, micro, repeats) for stages in (1, 2, 3, 4) for micro in (stages, 2 * stages, 3 * stages)
        for repeats in (1, 2, 3)]


def test_every_timetable_keeps_its_dependencies_and_stash_slots():
    for stages, micro, repeats in GRID:
        _check_timetable(stages, micro, repeats)


def _check_timetable(stages: int, micro: int, repeats: int) -> None:
    table = timetable(stages, micro, repeats)
    chunks = stages * repeats
    forward, backward = {}, {}
    for t in range(table.rounds):
        for d in range(stages):
            for who, mb, lap in ((forward, table.forward_microbatch, table.forward_lap),
                                 (backward, table.backward_microbatch, table.backward_lap)):
                if mb[t, d] >= 0:
                    key = (int(mb[t, d]), int(lap[t, d]) * stages + d)  # chunk k runs on device k % stages
                    assert key not in who
                    who[key] = t
    every = {(m, k) for m in range(micro) for k in range(chunks)}
    assert set(forward) == every and set(backward) == every
    for m in range(micro):
        for k in range(1, chunks):
            # A chunk's input is the previous chunk's output of the round before (the ring shift).
            assert forward[m, k] == forward[m, k - 1] + 1
            assert backward[m, k - 1] == backward[m, k] + 1
        assert backward[m, chunks - 1] == forward[m, chunks - 1]  # the loss sits between them
    # What a stash slot holds is read back by the matching backward, never overwritten before.
    for d in range(stages):
        holds: dict[int, tuple[int, int]] = {}
        for t in range(table.rounds):
            if table.forward_microbatch[t, d] >= 0:
                slot = int(table.forward_slot[t, d])
                assert slot < table.slots and slot not in holds
                holds[slot] = (int(table.forward_microbatch[t, d]), int(table.forward_lap[t, d]))
            if table.backward_microbatch[t, d] >= 0:
                slot = int(table.backward_slot[t, d])
                assert holds.pop(slot) == (int(table.backward_microbatch[t, d]), int(table.backward_lap[t, d]))
        assert not holds
    assert table.bubble == pytest.approx((stages - 1) / (repeats * micro + stages - 1))
    if repeats == 1:  # 1F1B: the first stage has the longest round trip, 2 * (stages - 1) + 1 rounds
        assert table.slots == min(micro, 2 * stages - 1)
    schedule = PipelineSchedule(stages, micro, kind="1f1b" if stages > 1 or repeats > 1 else "gpipe",
                                repeats=repeats if stages > 1 else 1)
    assert schedule.bubble == pytest.approx(table.bubble if stages > 1 else 0.0)


def test_a_schedule_is_named_and_fits_its_field():
    assert MeshSpec(stage=2, schedule="1f1b", circular_repeats=2).circular_repeats == 2
    with pytest.raises(ValueError, match="'pipedream'.*'gpipe', '1f1b'"):
        MeshSpec(stage=2, schedule="pipedream")
    with pytest.raises(ValueError, match="circular_repeats=2 interleaves a 1F1B schedule"):
        MeshSpec(stage=2, circular_repeats=2)
    with pytest.raises(ValueError, match="circular_repeats must be a positive integer"):
        MeshSpec(stage=2, schedule="1f1b", circular_repeats=0)
    # Without stages they change nothing (microbatches=7 of a 32-row batch trained as without it):
    # refused, saying what splits a step without a pipeline.
    for given, said in (({"microbatches": 7}, "microbatches=7 runs"), ({"schedule": "1f1b"}, "schedule='1f1b' runs"),
                        ({"microbatches": 4, "schedule": "1f1b"}, "microbatches=4, schedule='1f1b' run ")):
        with pytest.raises(ValueError, match=f"MeshSpec {said}.*stage=1 has none.*trainer.accumulation"):
            MeshSpec(**given)
    # GPipe keeps every iteration's activations: microbatches + stages - 1 of them at 4 x 8.
    assert PipelineSchedule(4, 8).held == 11 and PipelineSchedule(4, 8, kind="1f1b").held == 7


PROGRAM = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.nn.pipeline import StackSessionError, StageDivisionError
from dew.objectives.base import Aux, Mean, Objective
from dew.testing.doubles import RecordingTracker
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec

ROWS, SEQ = 16, 8

class LM(Objective):
    def __init__(self, experts=0):
        self.model = CausalTransformer(vocab_size=32, emb_features=16, num_layers=8, num_heads=2,
                                       mlp_features=32, max_seq_len=SEQ, position_embedding="rotary",
                                       mlp_activation="swiglu", experts=experts, scan_layers=True)
    def init(self, key, variables=None):
        return variables if variables is not None else self.model.init(key, jnp.zeros((1, SEQ), jnp.int32))
    def loss(self, variables, batch, step):
        segments = batch["segments"][:, :-1]
        mutable = {"mutable": ["moe"]} if self.model.experts else {}
        logits = self.model.apply(variables, batch["text"][:, :-1], segment_ids=segments, **mutable)
        logits = logits[0] if mutable else logits
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["text"][:, 1:])
        return Mean(ce.sum(), jnp.asarray(ce.size, jnp.float32)), Aux()

def stream(partition):
    index = 0
    while True:
        rng = np.random.default_rng(index)
        rows = rng.integers(0, 32, size=(ROWS, SEQ + 1)).astype(np.int32)
        segments = np.sort(rng.integers(1, 4, size=(ROWS, SEQ + 1)), axis=1).astype(np.int32)
        share = ROWS // partition.shares
        part = slice(partition.share * share, (partition.share + 1) * share)
        yield {"text": rows[part], "segments": segments[part]}
        index += 1

def train(spec, objective=None):
    log = RecordingTracker()
    trainer = Trainer(objective or LM(), optax.adamw(1e-2), key=jax.random.key(0), mesh=MeshSpec(**spec),
                      layout=Layout(min_shard=0, tolerance=1.0), tracker=log)
    trainer.fit(Dataset(train=stream, batch=ROWS), steps=2, log_every=1)
    return [row for _, row in log.rows]

out = {}
for name, spec in json.loads(sys.argv[1]).items():
    rows = train(spec)
    out[name] = {"losses": [r["train/loss"] for r in rows], "bubble": rows[-1].get("train/pipeline_bubble")}
if len(jax.devices()) > 1:
    try:
        train({"stage": 2, "microbatches": 4, "schedule": "1f1b"}, LM(experts=2))
    except StackSessionError as error:
        out["moe"] = str(error)
    try:
        train({"stage": 4, "microbatches": 4, "schedule": "1f1b", "circular_repeats": 3})
    except StageDivisionError as error:
        out["layers"] = str(error)
print("RESULT" + json.dumps(out))
"""

# Every schedule at 2 and 4 stages with 4 and 8 microbatches (GPipe's other three in test_mesh_stages).
SCHEDULES = {
    "gpipe_stage4_micro4": {"stage": 4, "microbatches": 4},
    "gpipe_stage4_micro8": {"stage": 4, "microbatches": 8},
    "1f1b_stage2_micro4": {"stage": 2, "microbatches": 4, "schedule": "1f1b"},
    "1f1b_stage2_fsdp2_micro8": {"stage": 2, "fsdp": 2, "microbatches": 8, "schedule": "1f1b"},
    "1f1b_stage4_micro4": {"stage": 4, "microbatches": 4, "schedule": "1f1b"},
    "1f1b_stage4_micro8": {"stage": 4, "microbatches": 8, "schedule": "1f1b"},
    "interleaved_stage2_micro4": {"stage": 2, "microbatches": 4, "schedule": "1f1b", "circular_repeats": 2},
    "interleaved_stage2_micro8": {"stage": 2, "microbatches": 8, "schedule": "1f1b", "circular_repeats": 2},
    "interleaved_stage4_micro4": {"stage": 4, "microbatches": 4, "schedule": "1f1b", "circular_repeats": 2},
    "interleaved_stage4_micro8": {"stage": 4, "microbatches": 8, "schedule": "1f1b", "circular_repeats": 2},
}
PATIENT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def _run(python_in_subprocess, meshes: dict, devices: int) -> dict:
    stdout = python_in_subprocess(
        f"import sys; sys.argv = ['x', {json.dumps(json.dumps(meshes))}]\n" + PROGRAM, devices=devices,
        env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {PATIENT}"}, timeout=1200)
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.slow
def test_every_schedule_trains_to_the_single_device_losses(python_in_subprocess):
    single = _run(python_in_subprocess, {"one": {}}, devices=1)["one"]
    piped = _run(python_in_subprocess, SCHEDULES, devices=8)
    for name in SCHEDULES:
        assert piped[name]["losses"] == pytest.approx(single["losses"], abs=1e-5, rel=1e-5), name
        spec = MeshSpec(**SCHEDULES[name])
        repeats, stages = spec.circular_repeats, spec.stage
        assert piped[name]["bubble"] == pytest.approx((stages - 1) / (repeats * spec.microbatches + stages - 1))
    assert "collections ['moe'] mutable" in piped["moe"] and "schedule='gpipe'" in piped["moe"]
    assert "8 layers" in piped["layers"] and "circular_repeats=3" in piped["layers"]
