"""Small data and models shared by the distillation, fine-tuning and JEPA tests."""

from __future__ import annotations

import numpy as np

from dew.data import Dataset
from dew.nn.backbones import CausalTransformer

VOCAB = 16
SEQ = 12


def teacher_model() -> CausalTransformer:
    return CausalTransformer(vocab_size=VOCAB, emb_features=32, num_layers=2, num_heads=2,
                             mlp_features=64, max_seq_len=SEQ)


def student_model(vocab: int = VOCAB) -> CausalTransformer:
    return CausalTransformer(vocab_size=vocab, emb_features=8, num_layers=1, num_heads=1,
                             mlp_features=16, max_seq_len=SEQ)


def markov_rows(index: int, rows: int = 16, length: int = SEQ + 1) -> np.ndarray:
    """Rows drawn from a fixed random Markov chain over VOCAB tokens (batch index seeds the draw)."""
    transitions = np.random.default_rng(1234).dirichlet(np.full(VOCAB, 0.3), size=VOCAB)
    rng = np.random.default_rng(index)
    out = np.empty((rows, length), np.int32)
    out[:, 0] = rng.integers(0, VOCAB, size=rows)
    for t in range(1, length):
        cumulative = transitions[out[:, t - 1]].cumsum(axis=1)
        out[:, t] = (rng.random((rows, 1)) < cumulative).argmax(axis=1)
    return out


class Counting:
    """An endless iterator of make(index) batches whose position is the index (resumable)."""

    def __init__(self, make):
        self.make, self.index = make, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.index += 1
        return self.make(self.index - 1)

    def get_state(self) -> bytes:
        return str(self.index).encode()

    def set_state(self, state: bytes) -> None:
        self.index = int(state)


def counting_dataset(make, rows: int) -> Dataset:
    return Dataset(train=lambda partition: Counting(make), batch=rows)


def markov_dataset(rows: int = 16) -> Dataset:
    return counting_dataset(lambda i: {"text": markov_rows(i, rows)}, rows)


# -- one small run of each objective, for the many-device and resume checks --------------------


def sft_rows(index: int, rows: int = 16) -> dict[str, np.ndarray]:
    """Markov rows packed as 2-3 documents each, the first third of every document a prompt."""
    text = markov_rows(index, rows)
    rng = np.random.default_rng(index + 99)
    segments = np.zeros_like(text)
    mask = np.zeros_like(text)
    for r in range(rows):
        cuts = sorted(rng.choice(np.arange(3, SEQ - 2), size=2, replace=False))
        bounds = [0, *cuts, SEQ + 1 - int(rng.integers(0, 2))]  # sometimes a padded tail
        for number, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), 1):
            segments[r, a:b] = number
            mask[r, a + (b - a) // 3:b] = 1
    return {"text": text, "segment_ids": segments, "loss_mask": mask}


def digit_images() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.images / 16.0).astype(np.float32)[..., None], data.target


def small_run(kind: str):
    """(objective, dataset) of a tiny run of kind: 'distillation', 'sft' or 'jepa'."""
    if kind == "distillation":
        from dew.objectives.distillation import DistillationObjective

        objective = DistillationObjective(student_model(), teacher_model(), SEQ, reverse=0.5, labels=0.2, hidden=0.5)
        return objective, markov_dataset()
    if kind == "sft":
        from dew.objectives.lm import LMObjective

        return LMObjective(teacher_model(), SEQ), counting_dataset(sft_rows, 16)
    if kind == "jepa":
        from dew.nn.vit import ViTEncoder
        from dew.objectives.jepa import JepaObjective

        images, _ = digit_images()
        encoder = ViTEncoder(image_size=8, patch=2, channels=1, emb_features=16, num_layers=1, num_heads=2,
                             mlp_features=32)
        objective = JepaObjective(encoder, blocks=2, predictor_features=16, predictor_layers=1,
                                  momentum_steps=10)
        return objective, counting_dataset(
            lambda i: {"image": images[np.random.default_rng(i).choice(len(images), 16, replace=False)]}, 16)
    raise ValueError(kind)
