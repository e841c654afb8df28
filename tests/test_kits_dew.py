"""dew's own objectives, models, trackers, readers and rollout pass the conformance kits of
dew.testing, exactly as a plugin's components would in the plugin's own suite."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.nn.backbones import CausalTransformer
from dew.nn.dit import DiT
from dew.objectives.base import EMASpec
from dew.testing import (
    DatasetReaderKit,
    EvaluationTaskKit,
    ModelKit,
    ObjectiveKit,
    RolloutKit,
    TrackerKit,
)
from dew.training import Trainer
from dew.training.placement.layout import Layout
from dew.training.placement.mesh import MeshSpec

VOCAB, LENGTH = 13, 8


def language_model(vocab: int = VOCAB, width: int = 16) -> CausalTransformer:
    return CausalTransformer(vocab_size=vocab, emb_features=width, num_layers=1, num_heads=2,
                             mlp_features=2 * width, max_seq_len=16)


def token_rows(rows: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(rows, length)).astype(np.int32)


# -- objectives ----------------------------------------------------------------------------------
class TestLanguageModelObjective(ObjectiveKit):
    def objective(self):
        from dew.objectives.lm import LMObjective

        return LMObjective(language_model(), LENGTH, ema=EMASpec(decay=0.9))

    def batch(self):
        return {"text": token_rows(4, LENGTH + 1)}

    # A child interpreter on 8 devices, and three fits with a checkpoint: the slow lane's.
    @pytest.mark.slow
    def test_gradients_on_many_devices_equal_one_device(self):
        super().test_gradients_on_many_devices_equal_one_device()

    @pytest.mark.slow
    def test_resumes_bitwise(self):
        super().test_resumes_bitwise()


@pytest.mark.slow
class TestDistillationObjective(ObjectiveKit):
    """A frozen teacher under params/teacher, and a hard-label term over masked positions."""

    def objective(self):
        from dew.objectives.distillation import DistillationObjective

        return DistillationObjective(language_model(width=8), language_model(width=16), LENGTH,
                                     forward=1.0, reverse=0.5, labels=0.3)

    def batch(self):
        mask = np.ones((4, LENGTH), np.float32)
        mask[0, :5] = 0  # the halves average over different numbers of positions
        return {"text": token_rows(4, LENGTH + 1, seed=1), "loss_mask": mask}


@pytest.mark.slow
class TestDPOObjective(ObjectiveKit):
    def objective(self):
        from dew.objectives.dpo import DPOObjective

        return DPOObjective(language_model(), LENGTH, beta=0.5)

    def batch(self):
        rng = np.random.default_rng(2)
        prompt = rng.integers(1, VOCAB, size=(4, 3))
        chosen = np.concatenate([prompt, rng.integers(1, VOCAB, size=(4, LENGTH - 3))], axis=1)
        rejected = np.concatenate([prompt, rng.integers(1, VOCAB, size=(4, LENGTH - 3))], axis=1)
        mask = np.zeros((4, LENGTH), np.int32)
        mask[:, 3:] = 1
        rejected_mask = mask.copy()
        rejected_mask[0, -2:] = 0
        return {"chosen": chosen.astype(np.int32), "rejected": rejected.astype(np.int32),
                "chosen_mask": mask, "rejected_mask": rejected_mask,
                "prompt_length": np.full((4,), 3, np.int32)}


@pytest.mark.slow
class TestGRPOObjective(ObjectiveKit):
    """Groups of 4 completions; the halves split between groups, as the rollout lays them out."""

    def objective(self):
        from dew.objectives.grpo import GRPOObjective

        return GRPOObjective(language_model(), group_size=4, beta=0.1)

    def batch(self):
        from dew.objectives.policy import token_logprobs

        tokens = token_rows(8, LENGTH + 2, seed=3)
        mask = np.zeros(tokens.shape, np.float32)
        for i in range(8):
            mask[i, 4:tokens.shape[1] - (i % 3)] = 1.0
        params = jax.jit(language_model().init)(jax.random.key(9), jnp.zeros((1, 1), jnp.int32))
        old = np.asarray(token_logprobs(language_model(), params, jnp.asarray(tokens))[0])
        return {"tokens": tokens, "mask": mask,
                "reward": np.asarray([1, 0, 0, 1, 0.5, 0, 1, 0], np.float32), "old_logp": old}


@pytest.mark.slow
class TestDiffusionObjective(ObjectiveKit):
    """Noise and levels come from the step's key: the microbatch check compares counts and the
    accumulated step against the microbatches differentiated by hand."""

    stochastic = True

    def objective(self):
        from dew.objectives.diffusion import DiffusionObjective

        return DiffusionObjective(tiny_dit(), condition_dropout=0.0)

    def batch(self):
        rng = np.random.default_rng(4)
        return {"image": rng.integers(0, 256, (4, 8, 8, 1)).astype(np.uint8),
                "label": np.arange(4, dtype=np.int32)}


# -- models --------------------------------------------------------------------------------------
def tiny_dit() -> DiT:
    return DiT(image_size=8, channels=1, patch_size=2, emb_features=32, num_layers=1, num_heads=2,
               mlp_features=64, num_classes=10)


@pytest.mark.slow
class TestCausalTransformerModel(ModelKit):
    def model(self):
        return CausalTransformer(vocab_size=64, emb_features=64, num_layers=2, num_heads=4,
                                 mlp_features=128, max_seq_len=16)

    def inputs(self):
        return (jnp.zeros((2, 16), jnp.int32),)


@pytest.mark.slow
class TestDiTModel(ModelKit):
    """On pure FSDP (a tensor axis: TestDiTModelOnTensorAxis)."""

    mesh = MeshSpec(fsdp=8)
    layout = Layout(min_shard=1024)  # the [6 x embed] modulation bias names no axis either

    def model(self):
        return DiT(image_size=8, channels=1, patch_size=2, emb_features=64, num_layers=1,
                   num_heads=4, mlp_features=128, num_classes=10)

    def inputs(self):
        return (jnp.zeros((2, 8, 8, 1)), jnp.zeros((2,)), jnp.zeros((2,), jnp.int32))


@pytest.mark.slow
class TestDiTModelOnTensorAxis(TestDiTModel):
    """fsdp x tensor. The adaLN modulation kernels [embed, 6 x embed] name their output axis, so
    a tensor axis splits them too (before, this layout kept 65.6% more than perfect sharding).
    What a tensor axis still leaves whole is the noise embedding's first kernel [256
    frequencies, embed], a fixed-size table: 0.04% of DiT-XL, but 19% of a one-block toy. With
    four blocks the toy is 6-7% over perfect, hence the tolerance."""

    mesh = MeshSpec(fsdp=4, tensor=2)
    layout = Layout(min_shard=1024, tolerance=0.1)

    def model(self):
        return DiT(image_size=8, channels=1, patch_size=2, emb_features=64, num_layers=4,
                   num_heads=4, mlp_features=128, num_classes=10)


# -- trackers ------------------------------------------------------------------------------------
class TestLocalTracker(TrackerKit):
    """Read back through dew's own journal reader (the one dew plot uses)."""

    def tracker(self, directory):
        from dew.tracking.local import LocalTracker

        return LocalTracker(directory)

    def read_back(self, directory):
        from dew.telemetry.render import read_scalars

        return {name: list(zip(steps.tolist(), values.tolist(), strict=True))
                for name, (steps, values) in read_scalars(Path(directory) / "scalars.jsonl").items()}


class TestTensorBoardTracker(TrackerKit):
    rtol = 1e-6  # TensorBoard stores float32: the kit's values are exact in float32

    def tracker(self, directory):
        pytest.importorskip("tensorboard")
        from dew.trackers.tensorboard import TensorBoardTracker

        return TensorBoardTracker(Path(directory) / "tb")

    def read_back(self, directory):
        from tensorboard.backend.event_processing import event_accumulator as ea

        reader = ea.EventAccumulator(str(Path(directory) / "tb"), size_guidance={ea.SCALARS: 0})
        reader.Reload()
        return {tag: [(e.step, e.value) for e in reader.Scalars(tag)]
                for tag in reader.Tags()["scalars"]}


@pytest.mark.slow
class TestMLflowTracker(TrackerKit):
    """A SQLite tracking store in the test's directory, read with MLflow's own client. MLflow's
    store clips an infinity to the largest float (docs/trackers.md)."""

    non_finite = "clipped"

    def tracker(self, directory):
        pytest.importorskip("mlflow")
        from dew.trackers.mlflow import MLflowTracker

        return MLflowTracker("dew-kit", "kit", uri=f"sqlite:///{Path(directory) / 'mlflow.db'}")

    def read_back(self, directory):
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{Path(directory) / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("dew-kit")
        (run,) = client.search_runs([experiment.experiment_id])
        return {name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
                for name in run.data.metrics}


class TestWandbTracker(TrackerKit):
    """Offline W&B, read from the run's .wandb datastore with W&B's own protobuf."""

    @pytest.fixture(autouse=True)
    def _offline(self, monkeypatch, tmp_path):
        wandb = pytest.importorskip("wandb")
        wandb.teardown()  # an earlier test's W&B setup would keep writing into its own WANDB_DIR
        monkeypatch.setenv("WANDB_DIR", str(tmp_path))
        monkeypatch.setenv("WANDB_SILENT", "true")
        monkeypatch.setenv("WANDB_API_KEY", "")
        monkeypatch.delenv("WANDB_MODE", raising=False)
        yield
        wandb.teardown()  # W&B keeps the first WANDB_DIR it read until its setup is torn down

    def tracker(self, directory):
        from dew.trackers.wandb import WandbTracker

        return WandbTracker("dew-kit", "kit", offline=True)

    def read_back(self, directory):
        import json

        from wandb_datastore import finished_records

        (datastore,) = (Path(directory) / "wandb").glob("offline-run-*/run-*.wandb")
        series: dict[str, list[tuple[int, float]]] = {}
        for record in finished_records(datastore):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            step = int(row.pop("_step"))
            for name, value in row.items():
                if not name.startswith("_"):
                    series.setdefault(name, []).append((step, float(json.loads(value))))
        return series


# -- dataset readers -----------------------------------------------------------------------------
class TestTokenWindowsReader(DatasetReaderKit):
    @pytest.fixture(autouse=True)
    def _text(self, tmp_path):
        text = " ".join(f"line {i} of the kit's text, with some words." for i in range(60))
        (tmp_path / "a.txt").write_text(text)
        self.files = str(tmp_path / "*.txt")

    def dataset(self):
        from dew.data.token_windows import TokenWindows

        return TokenWindows(files=self.files, length=15).load(batch=4, seed=3)


class TestDigitsReader(DatasetReaderKit):
    shares = (2, 4)

    def dataset(self):
        pytest.importorskip("sklearn")
        from dew.data.digits import Digits

        return Digits().load(batch=8, seed=1)


# -- rollouts ------------------------------------------------------------------------------------
@pytest.mark.slow
class TestGRPORollout(RolloutKit):
    """Completions stop at different lengths; the rollout pads them to one shape."""

    def _objective(self):
        from dew.objectives.grpo import GRPOObjective

        return GRPOObjective(language_model(), reward=lambda completions, context: [
            float(len(c)) for c in completions], group_size=2, max_new_tokens=4, stop_token=3)

    def rollout(self):
        return self._objective().rollout()

    def state(self):
        return Trainer(self._objective(), optax.sgd(0.0), key=jax.random.key(0)).initial_state()

    def batches(self):
        prompts = token_rows(2, 5, seed=5)
        return [{"prompt": prompts, "prompt_length": np.asarray([3, 5], np.int32)},
                {"prompt": token_rows(2, 5, seed=6), "prompt_length": np.asarray([5, 2], np.int32)}]


# -- evaluation tasks ----------------------------------------------------------------------------
class TestMultipleChoiceTaskKit(EvaluationTaskKit):
    """Byte-level choices scored by a tiny random model, in batches of 1, 3 and 16 rows."""

    @pytest.fixture(autouse=True)
    def _file(self, tmp_path):
        import json

        records = [{"context": "2 + 2 =", "choices": ["4", "5", "22"], "answer": 0},
                   {"context": "dew trains", "choices": ["jax models", "ducks"], "answer": 0}]
        self.file = tmp_path / "choices.jsonl"
        self.file.write_text("".join(json.dumps(r) + "\n" for r in records))

    def task(self, batch: int = 16):
        from dew.evaluations.multiple_choice import MultipleChoice

        return MultipleChoice(file=str(self.file), batch=batch)

    def subject(self):
        from dew.data import ByteTokenizer
        from dew.evaluations import Subject

        model = language_model(vocab=257)
        return Subject(model, _variables(model), ByteTokenizer())

    def rebatched(self, rows):
        return self.task(rows)


class TestPerplexityTaskKit(TestMultipleChoiceTaskKit):
    """Byte-level documents, one longer than the model's window, in batches of 1, 3 and 16 rows."""

    @pytest.fixture(autouse=True)
    def _file(self, tmp_path):
        import json

        records = [{"text": "dew trains jax models " * 3}, {"text": "2 + 2 = 4"}]
        self.file = tmp_path / "documents.jsonl"
        self.file.write_text("".join(json.dumps(r) + "\n" for r in records))

    def task(self, batch: int = 16):
        from dew.evaluations.perplexity import PerplexityTask

        return PerplexityTask(file=str(self.file), batch=batch)


@functools.cache
def _variables(model):
    return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def test_every_kit_is_applied_here():
    """Each kit has at least one of dew's components under it in this module."""
    kits = (ObjectiveKit, ModelKit, TrackerKit, DatasetReaderKit, RolloutKit, EvaluationTaskKit)
    applied = {kit: [c for c in globals().values()
                     if isinstance(c, type) and issubclass(c, kit) and c is not kit] for kit in kits}
    assert all(applied.values()), {k.__name__: v for k, v in applied.items()}


def test_the_kits_import_no_pytest_and_import_dew_imports_no_kit(python_in_subprocess):
    """A plugin's suite may run the kits under any runner; import dew stays light."""
    out = python_in_subprocess("""
        import sys
        import dew
        light = sorted(m for m in ("dew.testing", "jax") if m in sys.modules)
        import dew.testing
        print(light, sorted(m for m in ("pytest", "_pytest") if m in sys.modules))
    """)
    assert out.split("\n")[0] == "[] []"
