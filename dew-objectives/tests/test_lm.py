"""LMObjective, ByteTokenizer and the key-concepts program run as written."""

from __future__ import annotations

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import ByteTokenizer
from dew.data.tokenizers import UnknownTokenError
from dew.nn.backbones import CausalTransformer
from dew.objectives.base import Mean, MeanMetric, Step
from dew.objectives.lm import (
    BatchShapeError,
    LMObjective,
    MissingBatchKeyError,
    Perplexity,
    argmax_hits,
)
from dew.registry import objectives
from dew.telemetry.artifacts import Artifact
from dew.testing.processes import run_python

MODEL = CausalTransformer(vocab_size=257, emb_features=16, num_layers=1, num_heads=2,
                          mlp_features=32, max_seq_len=16)
STEP = Step(step=jnp.int32(0), microstep=jnp.int32(0), updates=jnp.int32(0),
            key=jax.random.key(0))


@pytest.fixture(scope="module")
def variables():
    return nn.meta.unbox(jax.jit(LMObjective(MODEL, seq_len=8).init)(jax.random.key(0)))


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return {"text": rng.integers(0, 257, size=(3, 9)).astype(np.int32)}


def test_argmax_hits_is_numpy_argmax_equality_with_ties_to_the_first_index():
    # Logits of three values over 11 entries tie in nearly every row; half the targets are a
    # row's first largest, a quarter its last largest (a tie that is not argmax's), the rest random.
    rng = np.random.default_rng(0)
    logits = rng.integers(0, 3, size=(40, 16, 11)).astype(np.float32)
    first = np.argmax(logits, -1)
    last = 10 - np.argmax(logits[..., ::-1], -1)
    pick = rng.random((40, 16))
    targets = np.where(pick < 0.5, first, np.where(pick < 0.75, last, rng.integers(0, 11, (40, 16))))
    got = np.asarray(jax.jit(argmax_hits)(jnp.asarray(logits), jnp.asarray(targets, jnp.int32)))
    np.testing.assert_array_equal(got, first == targets)
    assert got.sum() > 300 and (~got & (last == targets)).sum() > 100  # both kinds of tie were asked


@pytest.mark.slow
def test_loss_and_accuracy_match_a_hand_computation(variables, batch):
    objective = LMObjective(MODEL, seq_len=8)
    loss, aux = jax.jit(objective.loss)(variables, batch, STEP)
    logits = MODEL.apply(variables, batch["text"][:, :8])
    targets = batch["text"][:, 1:]
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    np.testing.assert_allclose(loss.value, expected, rtol=1e-6)
    assert float(loss.count) == 24
    accuracy = aux.metrics["accuracy"]
    np.testing.assert_allclose(accuracy.value, np.mean(np.argmax(logits, -1) == targets))
    # Gradients flow through the Mean's total, as the trainer takes them.
    grads = jax.grad(lambda v: objective.loss(v, batch, STEP)[0].total)(variables)
    assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))


def test_init_returns_partitioned_variables_for_seq_len_windows():
    objective = LMObjective(MODEL, seq_len=8)
    abstract = jax.eval_shape(objective.init, jax.random.key(0))
    specs = nn.get_partition_spec(abstract)
    assert specs["params"]["embed"]["embedding"] == jax.sharding.PartitionSpec("vocab", "embed")
    assert objective.required_keys() == ("text",)
    given = {"params": {"w": jnp.ones(2)}}
    assert objective.init(jax.random.key(0), given) is given


@pytest.mark.slow
def test_evaluate_and_perplexity(variables, batch):
    objective = LMObjective(MODEL, seq_len=8)
    outputs = objective.evaluate(variables, batch, STEP)
    assert set(outputs) == {"loss", "accuracy"}
    assert all(isinstance(v, Mean) for v in outputs.values())
    host = jax.tree_util.tree_map(np.asarray, outputs)
    perplexity = Perplexity()
    accumulator = perplexity.update(perplexity.update(perplexity.empty(), host), host)
    np.testing.assert_allclose(perplexity.result(accumulator),
                               math.exp(float(outputs["loss"].value)), rtol=1e-5)
    mean = MeanMetric("loss")
    assert mean.result(mean.update(mean.empty(), host)) == pytest.approx(
        float(outputs["loss"].value), rel=1e-6)
    assert [m.name for m in objective.metrics()] == ["loss", "accuracy", "perplexity"]


def test_bad_batches_name_the_key_and_both_shapes(variables):
    objective = LMObjective(MODEL, seq_len=8)
    with pytest.raises(MissingBatchKeyError, match=r"'text'.*\['tokens'\]"):
        objective.loss(variables, {"tokens": np.zeros((2, 9), np.int32)}, STEP)
    with pytest.raises(BatchShapeError, match=r"shape \(2, 8\).*\('batch', 9\)"):
        objective.loss(variables, {"text": np.zeros((2, 8), np.int32)}, STEP)
    with pytest.raises(BatchShapeError, match="float32"):
        objective.loss(variables, {"text": np.zeros((2, 9), np.float32)}, STEP)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        LMObjective(MODEL, seq_len=32)


def test_preview_continues_the_prompt(variables):
    tokenizer = ByteTokenizer()
    assert LMObjective(MODEL, seq_len=8).preview(variables, jax.random.key(0)) is None
    objective = LMObjective(MODEL, seq_len=8, tokenizer=tokenizer, prompt="dew",
                            preview_tokens=100)
    artifact = objective.preview(variables, jax.random.key(0))
    assert isinstance(artifact, Artifact) and artifact.kind == "text"
    assert artifact.data.startswith("dew")


def test_preview_of_a_vocabulary_padded_past_the_tokenizer_spells_every_token():
    # A model with more rows than the byte tokenizer has ids: the end-of-run sample drew ids the
    # tokenizer cannot spell and failed as the run finished. It draws from the tokenizer's ids.
    padded = CausalTransformer(vocab_size=300, emb_features=16, num_layers=1, num_heads=2, mlp_features=32,
                               max_seq_len=64)
    objective = LMObjective(padded, seq_len=8, tokenizer=ByteTokenizer(), prompt="dew", preview_tokens=60)
    params = nn.meta.unbox(jax.jit(objective.init)(jax.random.key(0)))
    head = params["params"]["head"]
    params["params"]["head"] = head.at[:, 257:].set(head[:, 257:] * 50)  # the padded rows dominate
    logits = padded.apply(params, jnp.asarray([list(b"dew")]))[0, -1]
    assert int(jnp.argmax(logits)) >= 257  # left alone, the likeliest next id has no byte
    artifact = objective.preview(params, jax.random.key(0))
    assert artifact is not None and artifact.data.startswith("dew") and len(artifact.data) > 3


def test_registered_as_lm():
    assert objectives.load("lm") is LMObjective


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "dew trains jax models — été ☃\n"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(np.asarray(tokenizer.encode(text, add_eos=True))) == text
    assert tokenizer.vocab_size == 257 and tokenizer.eos_id == 256
    assert tokenizer.decode([0xE2, 0x98]) == "\ufffd"  # half a character is replaced
    with pytest.raises(UnknownTokenError, match="300"):
        tokenizer.decode([65, 300])


KEY_CONCEPTS = '''
import itertools

import jax
import numpy as np
import optax

from dew import Dataset, Trainer, models
from dew.data import ByteTokenizer
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling, generate

tokenizer = ByteTokenizer()
text = tokenizer.encode("dew trains jax models. " * 3)
batch = {"text": np.tile(np.asarray(text[:65], np.int32), (8, 1))}
data = Dataset(train=lambda partition: itertools.repeat(batch),
               val=None, records=8, batch=8)

model = models.build(
    "causal_transformer", vocab_size=tokenizer.vocab_size,
    emb_features=64, num_layers=2, num_heads=4,
    mlp_features=256, max_seq_len=128)
objective = LMObjective(model, seq_len=64)
trainer = Trainer(objective, optax.adamw(3e-3),
                  key=jax.random.key(0))
state = trainer.fit(data, steps=100, log_every=25)

prompt = [tokenizer.encode("dew")]
out = generate(model, state.params, prompt, max_new_tokens=40,
               key=jax.random.key(1),
               sampling=Sampling(temperature=0))
print(tokenizer.decode(out.tokens[0]))
'''


@pytest.mark.slow
def test_key_concepts_program_runs_as_written(tmp_path):
    result = run_python(KEY_CONCEPTS, devices=1, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    losses = [float(m.group(1)) for m in map(re.compile(r"step \d+: loss ([0-9.e+-]+)").search,
                                             lines) if m]
    assert len(losses) == 4, result.stdout
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.1, losses
    assert lines[-1].startswith("dew trains jax models. dew trains"), lines[-1]


def test_a_negative_preview_length_is_refused():
    """preview_tokens=-1 trained and previewed the prompt alone, as 0 does, without a word."""
    with pytest.raises(ValueError, match=r"LMObjective.preview_tokens must be at least 0"):
        LMObjective(MODEL, 8, preview_tokens=-1)


def test_token_ids_outside_the_vocabulary_are_refused_before_the_first_step():
    import itertools

    from dew import Trainer, models
    from dew.data import Dataset
    from dew.objectives.lm import LMObjective, TokenRangeError

    model = models.build("causal_transformer", vocab_size=10, emb_features=8, num_layers=1,
                         num_heads=2, mlp_features=8, max_seq_len=8)
    objective = LMObjective(model, seq_len=4)
    batch = {"text": np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 12]], np.int32)}
    trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(TokenRangeError, match=r"step 0 holds token id 12, outside the model's vocabulary of 10 ids"):
        trainer.fit(Dataset(train=lambda p: itertools.repeat(batch), batch=2), steps=2)
