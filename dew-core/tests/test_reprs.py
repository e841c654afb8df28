"""What a notebook shows when it prints a state or a model: one line per variable tree, not every array."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import optax

from dew.nn.backbones import CausalTransformer
from dew.pretrained import Pretrained
from dew.training.state import TrainState

MODEL = CausalTransformer(vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          mlp_features=64, max_seq_len=16, position_embedding="rotary",
                          mlp_activation="swiglu")


def _variables():
    return MODEL.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def _counted(text: str, field: str) -> tuple[int, int]:
    """The array and value counts the repr shows for field."""
    found = re.search(rf"{field}=<(\d+) arrays?, ([\d,]+) values?", text)
    assert found, f"{field} is not summarized in {text!r}"
    return int(found.group(1)), int(found.group(2).replace(",", ""))


def _state(variables, step: int) -> TrainState:
    return TrainState(params=variables, opt_state=optax.adam(1e-3).init(variables),
                      key=jax.random.key_data(jax.random.key(0)), step=jnp.asarray(step),
                      microstep=jnp.asarray(step + 1), updates=jnp.asarray(step - 1))


def test_a_train_state_prints_its_counters_and_counts_its_trees():
    variables = _variables()
    state = _state(variables, 7)
    text = repr(state)
    leaves = jax.tree_util.tree_leaves(variables)
    assert _counted(text, "params") == (len(leaves), sum(math.prod(leaf.shape) for leaf in leaves))
    optimizer = jax.tree_util.tree_leaves(state.opt_state)
    assert _counted(text, "opt_state") == (len(optimizer), sum(leaf.size for leaf in optimizer))
    assert "step=7," in text and "microstep=8," in text and "updates=6," in text
    assert len(text) < 400, text


def test_a_state_printed_while_traced_or_after_donation_is_summarized_not_read():
    state = _state(_variables(), 3)
    shown = []
    jax.jit(lambda s: shown.append(repr(s)) or s.step)(state)  # traced: its counters have no value yet
    assert _counted(shown[0], "step") == (1, 1)
    donated = jax.jit(lambda s: s.replace(step=s.step + 1), donate_argnums=0)
    donated(state)
    assert state.step.is_deleted()
    assert _counted(repr(state), "step") == (1, 1)


def test_a_pretrained_model_prints_its_model_and_a_line_for_its_variables():
    variables = _variables()
    text = repr(Pretrained(MODEL, variables))
    leaves = jax.tree_util.tree_leaves(variables)
    assert _counted(text, "variables") == (len(leaves), sum(leaf.size for leaf in leaves))
    assert "vocab_size = 64" in text  # the model itself is shown whole
    assert "Array(" not in text and len(text) < 2000, text
