"""The flow-grpo-digits recipe raises the brightness of the digits the digits-diffusion run draws.

Both stages run from their shipped recipes through dew.recipes.run.train
(the path of `dew train`) in one temporary directory, so flow-grpo-digits'
``init: run: runs/digits-diffusion`` finds the first stage's checkpoint.
The reward is read back from the local tracker's scalars; the reference the
run keeps is checked to be the starting weights, unchanged.
"""

from __future__ import annotations

import contextlib
import io
import json

import jax
import numpy as np
import pytest

from dew.recipes.config import RunConfig
from dew.recipes.run import train
from dew.training.initializers import ParamsFrom

pytestmark = pytest.mark.slow


def test_flow_grpo_raises_the_brightness_of_digits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        train(RunConfig.load("digits-diffusion", ["trainer.steps=150", "trainer.eval_every=150",
                                                  "trainer.preview=false"]))
        state = train(RunConfig.load("flow-grpo-digits", ["trainer.steps=16", "trainer.log_every=1"]))
    rows = [json.loads(line) for line in
            (tmp_path / "runs" / "flow-grpo-digits" / "scalars.jsonl").read_text().splitlines()]
    reward = np.asarray([row["train/reward"] for row in rows if "train/reward" in row])
    assert len(reward) == 16
    start, end = reward[:4].mean(), reward[-4:].mean()
    assert end > start + 0.05, reward

    # The frozen reference is the digits run's parameters, read independently.
    started = ParamsFrom(tmp_path / "runs" / "digits-diffusion")(
        {"params": jax.device_get(state.params["reference"])})["params"]
    for kept, read in zip(jax.tree.leaves(jax.device_get(state.params["reference"])),
                          jax.tree.leaves(started), strict=True):
        np.testing.assert_array_equal(kept, read)
