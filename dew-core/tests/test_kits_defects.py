"""Each conformance kit fails on a planted defect of its kind, and passes the same component
without it.

The components live in a generated test module (each healthy one beside its broken copies)
that a child pytest runs; its JUnit report says which kit test failed for which class.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

COMPONENTS = '''
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data.base import GLOBAL_POSITION, Dataset
from dew.objectives.base import Aux, EMASpec, Mean, Objective, under
from dew.testing import DatasetReaderKit, ModelKit, ObjectiveKit, RewardKit, RolloutKit, TrackerKit
from dew.training import Trainer


# -- objectives: a student regressing on a frozen teacher, over masked rows -------------------
class Regression(Objective):
    ema = EMASpec(decay=0.5, select=under("params/student"))
    frozen = staticmethod(under("params/teacher"))

    def init(self, key, variables=None):
        if variables is not None:
            return variables
        student, teacher = jax.random.split(key)
        x = jnp.zeros((1, 3))
        return {"params": {"student": nn.Dense(2).init(student, x)["params"],
                           "teacher": nn.Dense(2).init(teacher, x)["params"]}}

    def errors(self, variables, batch):
        params = variables["params"]
        target = nn.Dense(2).apply({"params": params["teacher"]}, batch["x"])
        guess = nn.Dense(2).apply({"params": params["student"]}, batch["x"])
        return ((guess - target) ** 2).sum(-1), batch["mask"]

    def loss(self, variables, batch, step):
        errors, mask = self.errors(variables, batch)
        return Mean(jnp.sum(errors * mask), jnp.sum(mask)), Aux()


class MeanOfMicrobatch(Regression):
    """Defect: returns the microbatch's mean with a count of 1."""

    def loss(self, variables, batch, step):
        errors, mask = self.errors(variables, batch)
        return Mean(jnp.sum(errors * mask) / jnp.sum(mask), jnp.asarray(1.0)), Aux()


class EMAOfNothing(Regression):
    """Defect: the EMA filter names a subtree that does not exist."""

    ema = EMASpec(decay=0.5, select=under("params/studnet"))


class FrozenNothing(Regression):
    """Defect: the frozen filter misspells the teacher, so the teacher trains."""

    frozen = staticmethod(under("params/teachr"))


class Untraceable(Regression):
    """Defect: reads a value on the host, so the loss does not compile."""

    def loss(self, variables, batch, step):
        errors, mask = self.errors(variables, batch)
        count = float(jnp.sum(mask))
        return Mean(jnp.sum(errors * mask), jnp.asarray(count)), Aux()


def rows():
    rng = np.random.default_rng(0)
    mask = np.ones((4,), np.float32)
    mask[0] = 0.0  # the two halves count 1 and 2 rows
    return {"x": rng.normal(size=(4, 3)).astype(np.float32), "mask": mask}


class ObjectiveCase(ObjectiveKit):
    component = Regression

    def objective(self):
        return self.component()

    def batch(self):
        return rows()


class TestObjectiveHealthy(ObjectiveCase):
    component = Regression


class TestObjectiveMeanOfMicrobatch(ObjectiveCase):
    component = MeanOfMicrobatch


class TestObjectiveEMAOfNothing(ObjectiveCase):
    component = EMAOfNothing


class TestObjectiveFrozenNothing(ObjectiveCase):
    component = FrozenNothing


class TestObjectiveUntraceable(ObjectiveCase):
    component = Untraceable


# -- models ---------------------------------------------------------------------------------------
def named(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    width: int = 64
    names: tuple = ("embed", "mlp")
    unnamed_scale: bool = False

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.width, kernel_init=named(self.names),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (self.names[1],)))(x)
        if self.unnamed_scale:
            y = y * self.param("scale", nn.initializers.ones, (self.width,))[None, :]
        return y


class ModelCase(ModelKit):
    inputs_width = 64
    fields = {}

    def model(self):
        return Block(**self.fields)

    def inputs(self):
        return (jnp.zeros((2, self.inputs_width)),)


class TestModelHealthy(ModelCase):
    pass


class TestModelUnnamedParameter(ModelCase):
    fields = {"unnamed_scale": True}


class TestModelMisspelledAxis(ModelCase):
    fields = {"names": ("embed", "mpl")}


class TestModelIndivisible(ModelCase):
    inputs_width = 63
    fields = {"width": 65}


# -- trackers -------------------------------------------------------------------------------------
class Lines:
    """Scalars as JSON lines, non-finite values spelled as strings (json's own reader reads them)."""

    def __init__(self, directory):
        self.path = directory / "scalars.jsonl"
        self.closed = 0

    def log(self, scalars, step):
        row = {"step": step, **{k: v if np.isfinite(v) else repr(float(v)) for k, v in scalars.items()}}
        with self.path.open("a") as file:
            file.write(json.dumps(row) + "\\n")

    def artifact(self, value, step):
        pass

    def close(self):
        self.closed += 1


class CrashesOnNaN(Lines):
    def log(self, scalars, step):
        if not all(np.isfinite(v) for v in scalars.values()):
            raise ValueError("cannot write a non-finite value")
        super().log(scalars, step)


class FailsOnSecondClose(Lines):
    def close(self):
        super().close()
        if self.closed > 1:
            raise RuntimeError("the tracker is already closed")


class KeyedByStep(Lines):
    """Keeps a step's last call only, written at close: a run's validation and training scalars of
    one step come in two calls, and one was lost."""

    def __init__(self, directory):
        super().__init__(directory)
        self.rows = {}

    def log(self, scalars, step):
        self.rows[step] = scalars

    def close(self):
        if not self.closed:
            for step, scalars in sorted(self.rows.items()):
                Lines.log(self, scalars, step)
        super().close()


class TrackerCase(TrackerKit):
    component = Lines

    def tracker(self, directory):
        return self.component(directory)

    def read_back(self, directory):
        series = {}
        path = directory / "scalars.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            step = row.pop("step")
            for name, value in row.items():
                series.setdefault(name, []).append((step, float(value)))
        return series


class TestTrackerHealthy(TrackerCase):
    component = Lines


class TestTrackerCrashesOnNaN(TrackerCase):
    component = CrashesOnNaN


class TestTrackerFailsOnSecondClose(TrackerCase):
    component = FailsOnSecondClose


class TestTrackerKeyedByStep(TrackerCase):
    component = KeyedByStep


# -- rewards --------------------------------------------------------------------------------------
def length_reward(completions, context):
    return [float(len(c)) for c in completions]


def nan_for_empty(completions, context):
    """Deterministic, but NaN for an empty completion: only the finiteness check may fail (the
    repeat check compared NaN with NaN and called the reward random)."""
    return [float("nan") if not c else 1.0 for c in completions]


class TestRewardHealthy(RewardKit):
    def reward(self):
        return length_reward


class TestRewardNanForEmpty(RewardKit):
    def reward(self):
        return nan_for_empty


class TestRewardColumn(RewardKit):  # the right scores as a column (n, 1): the trainer refuses that shape
    def reward(self):
        return lambda completions, context: [[float(len(c))] for c in completions]


class TestRewardText(RewardKit):  # numbers written as text: the trainer had parsed them silently
    def reward(self):
        return lambda completions, context: [str(len(c)) for c in completions]


# -- dataset readers ------------------------------------------------------------------------------
class Records:
    """Global batch g holds records [g*B, (g+1)*B); share s of S reads its rows of each."""

    def __init__(self, batch, partition):
        self.batch, self.partition, self.records = batch, partition, 0

    def __iter__(self):
        return self

    def __next__(self):
        rows = self.batch // self.partition.shares
        first = self.records + self.partition.share * rows
        self.records += self.batch
        return {"x": np.arange(first, first + rows, dtype=np.int64)[:, None] * np.ones((1, 2), np.int64)}

    def get_state(self):
        return GLOBAL_POSITION + json.dumps({"records": self.records}).encode()

    def set_state(self, state):
        self.records = json.loads(state[len(GLOBAL_POSITION):])["records"]


class ForgetsPosition(Records):
    def set_state(self, state):
        pass


class SharePosition(Records):
    """A position that only counts this share's batches: no other process count can read it."""

    def get_state(self):
        return json.dumps({"batches": self.records // self.batch}).encode()

    def set_state(self, state):
        self.records = json.loads(state)["batches"] * self.batch


class ReaderCase(DatasetReaderKit):
    component = Records

    def dataset(self):
        return Dataset(train=lambda partition: self.component(8, partition), batch=8)


class TestReaderHealthy(ReaderCase):
    component = Records


class TestReaderForgetsPosition(ReaderCase):
    component = ForgetsPosition


class TestReaderSharePosition(ReaderCase):
    component = SharePosition


# -- rollouts -------------------------------------------------------------------------------------
class Padded:
    """Appends a random number of tokens to each prompt, padded to the longest possible; its
    state is a counter of calls that shifts the tokens it appends."""

    most = 4

    def __init__(self):
        self.count = 0

    def get_state(self):
        return str(self.count).encode()

    def set_state(self, state):
        self.count = int(state)

    def __call__(self, state, batch, key):
        added = np.asarray(jax.random.randint(key, (len(batch["prompt"]),), 1, self.most + 1))
        width = self.width(added)
        tokens = np.zeros((len(added), batch["prompt"].shape[1] + width), np.int32)
        tokens[:, :batch["prompt"].shape[1]] = batch["prompt"]
        tokens[:, batch["prompt"].shape[1]:] = self.count
        self.count += 1
        return {"tokens": tokens, "added": added.astype(np.int32)}

    def width(self, added):
        return self.most


class TrimsToLongest(Padded):
    def width(self, added):
        return int(added.max())


class RolloutCase(RolloutKit):
    component = Padded
    calls = 6

    def rollout(self):
        return self.component()

    def state(self):
        return Trainer(Regression(), optax.sgd(0.0), key=jax.random.key(0)).initial_state()

    def batches(self):
        return [{"prompt": np.full((3, 2), i, np.int32)} for i in range(3)]


class TestRolloutHealthy(RolloutCase):
    component = Padded


class TestRolloutTrimsToLongest(RolloutCase):
    component = TrimsToLongest
'''

# What each planted defect must fail, and nothing else; the healthy classes fail nothing.
EXPECTED_FAILURES = {
    # Its halves count 1 and 2 rows: their means averaged are not the batch's mean.
    "TestObjectiveMeanOfMicrobatch": {"test_mean_totals_add_up_over_microbatches",
                                      "test_accumulated_step_equals_one_large_step"},
    "TestObjectiveEMAOfNothing": {"test_ema_selects_leaves_that_exist"},
    "TestObjectiveFrozenNothing": {"test_frozen_leaves_get_no_optimizer_state_and_do_not_move"},
    # Every test that compiles the loss (alone, in the trainer's step, on eight devices, resumed) fails.
    "TestObjectiveUntraceable": {"test_loss_compiles_and_matches_eager",
                                 "test_accumulated_step_equals_one_large_step",
                                 "test_frozen_leaves_get_no_optimizer_state_and_do_not_move",
                                 "test_gradients_on_many_devices_equal_one_device",
                                 "test_resumes_bitwise"},
    "TestModelUnnamedParameter": {"test_every_parameter_declares_logical_axes"},
    "TestModelMisspelledAxis": {"test_logical_axes_are_named_in_the_layout_rules",
                                "test_layout_check_passes_on_fake_devices"},
    "TestModelIndivisible": {"test_layout_check_passes_on_fake_devices"},
    "TestTrackerCrashesOnNaN": {"test_non_finite_values_are_logged"},
    "TestTrackerFailsOnSecondClose": {"test_close_twice_is_safe", "test_close_without_logging_is_safe"},
    "TestTrackerKeyedByStep": {"test_one_step_logged_twice_keeps_both"},
    "TestRewardNanForEmpty": {"test_one_finite_value_per_completion"},
    "TestRewardColumn": {"test_one_finite_value_per_completion", "test_the_same_inputs_score_the_same"},
    "TestRewardText": {"test_one_finite_value_per_completion", "test_the_same_inputs_score_the_same"},
    "TestReaderForgetsPosition": {"test_saved_position_resumes_the_stream",
                                  "test_position_resumes_at_another_process_count"},
    "TestReaderSharePosition": {"test_position_resumes_at_another_process_count"},
    "TestRolloutTrimsToLongest": {"test_shapes_are_the_same_at_every_call"},
}
HEALTHY = ["TestObjectiveHealthy", "TestModelHealthy", "TestTrackerHealthy", "TestReaderHealthy",
           "TestRolloutHealthy", "TestRewardHealthy"]


def run_generated(tmp_path: Path) -> dict[str, dict[str, str]]:
    """Run the generated module under a child pytest; outcome of every test by class and name."""
    module = tmp_path / "kit_cases.py"
    module.write_text(COMPONENTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\npython_files = kit_cases.py\n")
    report = tmp_path / "report.xml"
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(module), "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", f"--rootdir={tmp_path}", "-c", str(tmp_path / "pytest.ini")],
        capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=900)
    assert report.exists(), result.stdout[-4000:] + result.stderr[-4000:]
    outcomes: dict[str, dict[str, str]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcomes.setdefault(case.get("classname").split(".")[-1], {})[case.get("name")] = kind
    return outcomes


def test_each_kit_fails_on_its_planted_defect_and_passes_without_it(tmp_path):
    outcomes = run_generated(tmp_path)
    assert set(outcomes) == set(EXPECTED_FAILURES) | set(HEALTHY), sorted(outcomes)
    for healthy in HEALTHY:
        assert set(outcomes[healthy].values()) == {"passed"}, (healthy, outcomes[healthy])
    failed = {broken: {name for name, kind in outcomes[broken].items() if kind in ("failure", "error")}
              for broken in EXPECTED_FAILURES}
    assert failed == EXPECTED_FAILURES
    for broken in EXPECTED_FAILURES:
        # The same kit tests ran for the healthy twin, so a defect is what made them fail.
        twin = next(h for h in HEALTHY if broken.startswith(h.replace("Healthy", "")))
        assert set(outcomes[broken]) == set(outcomes[twin]), broken
