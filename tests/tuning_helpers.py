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
