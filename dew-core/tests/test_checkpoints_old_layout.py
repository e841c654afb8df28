"""A checkpoint written by the trainer before the engine was recomposed (issue 31) still resumes.

The data under data/window_checkpoint was written by that trainer
(data/make_window_checkpoint.py): two microbatches per update, a dynamic
loss scale and an EMA, saved after three steps with one microbatch in the
accumulation window. Resuming it must continue the run as that trainer
did (expected.json, which it recorded) and as a hand-written optax loop
computes from the restored state.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

DATA = Path(__file__).parent / "data"


def _maker():
    spec = importlib.util.spec_from_file_location("make_window_checkpoint", DATA / "make_window_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaves(tree) -> dict[str, np.ndarray]:
    return {"/".join(str(p.key) for p in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


@pytest.mark.slow
def test_a_checkpoint_of_the_old_layout_resumes_half_way_through_its_window(tmp_path: Path) -> None:
    maker = _maker()
    shutil.copytree(DATA / "window_checkpoint" / "run", tmp_path / "run")
    expected = json.loads((DATA / "window_checkpoint" / "expected.json").read_text())

    restored, _, _ = maker.trainer(tmp_path / "run").place()
    assert (int(restored.step), int(restored.microstep), int(restored.updates)) == (3, 3, 1)
    assert int(restored.window.filled) == 1  # saved halfway through the window

    # What the trainer must compute from there, by hand: the stream restarts (it has no position),
    # so steps 4, 5, 6 read batches 0, 1, 2; step 4 completes the window, 5 and 6 fill the next.
    objective, adam = maker.Line(), optax.adam(0.05)
    feed = maker.batches(None)
    params, opt_state, ema = (jax.device_get(x) for x in (restored.params, restored.opt_state, restored.ema))
    window = jax.device_get((restored.window.grads, restored.window.count))

    def total(p, batch):
        loss, _ = objective.loss(p, batch, None)
        return loss.total, loss.count

    for _ in range(2):
        grads, count = window
        for _ in range(2 if window[1] == 0 else 1):
            batch = next(feed)
            g, n = jax.grad(total, has_aux=True)(params, batch)
            grads, count = jax.tree.map(jnp.add, grads, g), count + float(n)
        mean = jax.tree.map(lambda g, c=count: g / c, grads)
        updates, opt_state = adam.update(mean, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, ema, params)
        window = (jax.tree.map(jnp.zeros_like, grads), 0.0)

    run = maker.trainer(tmp_path / "run")
    with pytest.warns(UserWarning, match="holds no data position"):
        final = run.fit(maker.DATA, steps=6)
    run.checkpoints.close()
    assert (int(final.step), int(final.microstep), int(final.updates)) == (6, 6, 3)
    # the trainer that wrote the checkpoint computed these very numbers
    for name, values in expected["params"].items():
        np.testing.assert_array_equal(_leaves(final.params)[name], np.asarray(values, np.float32))
    for name, values in expected["ema"].items():
        np.testing.assert_array_equal(_leaves(final.ema)[name], np.asarray(values, np.float32))
    assert float(final.scaler.scale) == expected["loss_scale"]
    # and the hand-written loop agrees (the scaled loss differs from it only in rounding)
    for mine, theirs in ((final.params, params), (final.ema, ema)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     jax.device_get(mine), theirs)


def test_an_ema_saved_in_bfloat16_is_read_widened_and_moves_on(tmp_path: Path) -> None:
    """A bfloat16 run's EMA was kept in bfloat16 until dew kept it in float32 (in bfloat16 an
    average at decay 0.999 never moved); a checkpoint written before was refused on resume, every
    EMA leaf 'saved as bfloat16, the state has float32'. data/narrow_ema_checkpoint was written by
    that dew (data/make_narrow_ema_checkpoint.py)."""
    spec = importlib.util.spec_from_file_location("make_narrow_ema_checkpoint", DATA / "make_narrow_ema_checkpoint.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    shutil.copytree(DATA / "narrow_ema_checkpoint" / "run", tmp_path / "run")
    expected = json.loads((DATA / "narrow_ema_checkpoint" / "expected.json").read_text())

    restored, _, _ = maker.trainer(tmp_path / "run").place()
    assert int(restored.step) == expected["step"] == 3
    for tree, dtype, saved in ((restored.ema, jnp.float32, expected["ema"]),
                               (restored.params, jnp.bfloat16, expected["params"])):
        for name, values in saved.items():
            leaf = _leaves(tree)[name]
            assert leaf.dtype == dtype, name
            np.testing.assert_array_equal(leaf.astype(np.float32), np.asarray(values, np.float32))

    # From there, by hand: adam on the bfloat16 weights, the average in float32 of the weights widened
    # (within a bfloat16 step: the trainer averages the loss in another order).
    objective, adam = maker.Line(), optax.adam(0.05)
    params, opt_state, ema = (jax.device_get(x) for x in (restored.params, restored.opt_state, restored.ema))
    feed = maker.batches(None)
    for _ in range(3):
        batch = next(feed)
        grads = jax.grad(lambda p, b=batch: objective.loss(p, b, None)[0].total / 4)(params)
        updates, opt_state = adam.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p.astype(jnp.float32), ema, params)

    run = maker.trainer(tmp_path / "run")
    with pytest.warns(UserWarning, match="holds no data position"):  # batches restart: 0, 1, 2 again
        final = run.fit(maker.DATA, steps=6)
    run.checkpoints.close()
    assert int(final.step) == 6
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(final.ema))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-2, atol=1e-3), jax.device_get(final.params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3), jax.device_get(final.ema), ema)
    assert not np.array_equal(_leaves(final.ema)["params/kernel"], np.asarray(expected["ema"]["params/kernel"]))
