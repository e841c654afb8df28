"""Small, real components for tests: objectives, their data, a recording tracker.

They are the smallest things a fit accepts, for tests of what the trainer
does (logging, checkpoints, hooks, preemption) rather than of what a model
learns. Every test in dew that needs "some objective" or "a tracker that
remembers" uses these, and a plugin's own tests may too.

>>> recorder = RecordingTracker()
>>> recorder.log({"train/loss": 0.5}, step=2)
>>> recorder.series("train/loss")
[(2, 0.5)]
>>> sorted(regression_batch(0))
['x', 'y']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from dew.data.base import DataPartition, Dataset, close_if_closable
from dew.objectives.base import Aux, Batch, EMASpec, Mean, Objective, Step, Variables

if TYPE_CHECKING:
    from dew.objectives.base import Batch, Step, Variables
    from dew.tracking.protocol import Reported

__all__ = [
    "MLP",
    "Linear",
    "NextToken",
    "RecordingTracker",
    "Regression",
    "RegressionStream",
    "TokenMLP",
    "WatchedStream",
    "regression_batch",
    "regression_dataset",
    "token_batches",
]

FEATURES = 4


class MLP(nn.Module):
    """Four features to one output through a tanh layer; both kernels name their logical axes."""

    hidden: int = 16

    @nn.compact
    def __call__(self, x_bf: jnp.ndarray) -> jnp.ndarray:
        dense = nn.initializers.lecun_normal()
        h_bh = nn.Dense(self.hidden, kernel_init=nn.with_logical_partitioning(dense, ("embed", "mlp")))(x_bf)
        return nn.Dense(1, kernel_init=nn.with_logical_partitioning(dense, ("mlp", "embed")))(nn.tanh(h_bh))


class Regression(Objective):
    """Mean squared error of an MLP on batches {"x": [B, 4], "y": [B, 1]}.

    A batch may carry "poison" ([B], any row > 0 makes the loss infinite) to
    test non-finite steps; ``traces`` counts how often the loss was traced.
    """

    def __init__(self, ema: EMASpec | None = None, hidden: int = 16) -> None:
        self.model = MLP(hidden)
        self.ema = ema
        self.traces = 0

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        if variables is not None:
            return variables
        return self.model.init(key, jnp.zeros((1, FEATURES)))

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        self.traces += 1
        errors_b1 = (self.model.apply(variables, batch["x"]) - batch["y"]) ** 2
        scale = jnp.where(batch["poison"][0] > 0, jnp.inf, 1.0) if "poison" in batch else 1.0
        count = jnp.asarray(errors_b1.size, jnp.float32)
        absolute = Mean(jnp.sum(jnp.sqrt(errors_b1)), count)
        return Mean(jnp.sum(errors_b1) * scale, count), Aux(metrics={"abs": absolute})

    def required_keys(self) -> tuple[str, ...]:
        return ("x", "y")


class Linear(Objective):
    """Squared error of one Dense layer from x to y, on batches {"x": [B, inputs], "y": [B, outputs]}.

    The smallest objective with a parameter per feature; ``traces`` counts
    how often the loss was traced (a test of compilation counts reads it).
    """

    def __init__(self, inputs: int = FEATURES, outputs: int = 1, ema: EMASpec | None = None) -> None:
        self.model = nn.Dense(outputs)
        self.inputs = inputs
        self.ema = ema
        self.traces = 0

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        return variables if variables is not None else self.model.init(key, jnp.zeros((1, self.inputs)))

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        self.traces += 1
        errors = (self.model.apply(variables, batch["x"]) - batch["y"]) ** 2
        return Mean(jnp.sum(errors), jnp.asarray(errors.size, jnp.float32)), Aux()

    def required_keys(self) -> tuple[str, ...]:
        return ("x", "y")


class NextToken(Objective):
    """The mean next-token cross entropy of a causal model, on batches {"text": int [B, seq_len + 1]}.

    model is any module mapping token ids [B, T] to logits [B, T, vocab]
    (dew.nn's CausalTransformer, say); init draws it for windows of seq_len
    tokens unless starting weights are given.
    """

    def __init__(self, model: nn.Module, seq_len: int = 8) -> None:
        self.model = model
        self.seq_len = seq_len

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        if variables is not None:
            return variables
        return self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        logits = self.model.apply(variables, batch["text"][:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["text"][:, 1:])
        return Mean(ce.sum(), jnp.asarray(ce.size, jnp.float32)), Aux()


class TokenMLP(nn.Module):
    """Token ids [B, T] to logits [B, T, vocab]: an embedding, one residual MLP and the embedding
    again as the head. Every weight names its logical axes (vocab, embed, mlp), so a mesh's rules
    shard it on every axis a language model uses; ``NextToken(TokenMLP())`` is the smallest
    language model a sharded fit takes."""

    vocab: int = 32
    features: int = 16
    hidden: int = 64

    @nn.compact
    def __call__(self, tokens_bt: jnp.ndarray) -> jnp.ndarray:
        dense = nn.initializers.lecun_normal()
        emb = nn.Embed(self.vocab, self.features, embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(0.02), ("vocab", "embed")))
        x_btf = emb(tokens_bt)
        h_bth = nn.Dense(self.hidden, kernel_init=nn.with_logical_partitioning(dense, ("embed", "mlp")))(x_btf)
        x_btf = x_btf + nn.Dense(self.features, kernel_init=nn.with_logical_partitioning(dense, ("mlp", "embed")))(
            nn.gelu(h_bth))
        return emb.attend(x_btf)


def token_batches(partition: DataPartition, rows: int = 16, length: int = 9,
                  vocab: int = 32) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches {"text": int32 [rows / shares, length]} of uniform token ids: batch n is
    drawn from seed n, and each share of the data partition takes its own slice of its rows.

    >>> from dew.data.base import DataPartition
    >>> first = next(token_batches(DataPartition(share=1, shares=2)))["text"]
    >>> first.shape, first.dtype.name
    ((8, 9), 'int32')
    """
    step = 0
    while True:
        drawn = np.random.default_rng(step).integers(0, vocab, size=(rows, length)).astype(np.int32)
        share = rows // partition.shares
        yield {"text": drawn[partition.share * share:(partition.share + 1) * share]}
        step += 1


def regression_batch(index: int, rows: int = 8) -> dict[str, np.ndarray]:
    """Batch number index: normal features and the target x · (1, 2, 3, 4) + 1."""
    rng = np.random.default_rng(index)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    weights = np.arange(1, FEATURES + 1, dtype=np.float32)[:, None]
    return {"x": x, "y": (x @ weights + 1).astype(np.float32)}


class RegressionStream:
    """An endless, resumable iterator of regression batches (its state is the next index)."""

    def __init__(self, make: Callable[[int], dict[str, np.ndarray]] = regression_batch) -> None:
        self.index, self.make = 0, make

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        self.index += 1
        return self.make(self.index - 1)

    def get_state(self) -> bytes:
        return str(self.index).encode()

    def set_state(self, state: bytes) -> None:
        self.index = int(state)


class WatchedStream:
    """A stream that shows each batch it yields to watch first (a test's record of what a fit
    read); its position and close pass through to the stream it wraps."""

    def __init__(self, stream: Iterator[Batch], watch: Callable[[Batch], object]) -> None:
        self.stream, self.watch = stream, watch

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = next(self.stream)
        self.watch(batch)
        return batch

    def get_state(self) -> bytes:
        return self.stream.get_state()  # type: ignore[attr-defined]  # a resumable stream is wrapped

    def set_state(self, state: bytes) -> None:
        self.stream.set_state(state)  # type: ignore[attr-defined]

    def close(self) -> None:
        close_if_closable(self.stream)


def regression_dataset(rows: int = 8, val: Callable[[DataPartition], Any] | None = None) -> Dataset:
    """A Dataset of endless regression batches of rows rows (every process reads the same)."""
    return Dataset(
        train=lambda partition: RegressionStream(lambda i: regression_batch(i, rows)),
        val=val,
        records=None,
        batch=rows,
    )


class RecordingTracker:
    """A tracker that keeps every report in memory, in the order it arrived."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.artifacts: list[tuple[int, Reported]] = []
        self.closed = 0

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.rows.append((step, {name: float(value) for name, value in scalars.items()}))

    def artifact(self, value: Reported, step: int) -> None:
        self.artifacts.append((step, value))

    def close(self) -> None:
        self.closed += 1

    def series(self, name: str) -> list[tuple[int, float]]:
        """(step, value) of one scalar, for every row that holds it."""
        return [(step, row[name]) for step, row in self.rows if name in row]

    def values(self, name: str) -> list[float]:
        """The values of one scalar, in the order they were logged."""
        return [value for _, value in self.series(name)]
