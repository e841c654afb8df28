"""A Trainer fed by TokenWindows saves the stream's global position and resumes it exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


@pytest.mark.slow
def test_a_resumed_fit_reads_the_records_an_uninterrupted_fit_reads(tmp_path: Path, python_in_subprocess):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a small corpus\n" for i in range(300)))
    code = f"""
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from dew import Checkpoints, Trainer
    from dew.data import Dataset, TokenWindows
    from dew.data.base import is_global_position
    from dew.objectives.base import Aux, Mean, Objective
    from dew.testing.doubles import WatchedStream

    class Probe(Objective):
        def init(self, key, variables=None):
            return {{"params": {{"w": jnp.zeros(())}}}}

        def loss(self, variables, batch, step):
            x = batch["text"].astype(jnp.float32)
            return Mean(jnp.sum((variables["params"]["w"] - x) ** 2), jnp.asarray(x.size)), Aux(metrics={{}})

        def required_keys(self):
            return ("text",)

    data = TokenWindows(files=[{str(corpus)!r}], length=15).load(batch=4, seed=5)
    def logged(log):
        return Dataset(train=lambda p: WatchedStream(data.train(p), lambda b: log.append(b["text"][:, 0].tolist())),
                       records=data.records, batch=4)

    whole = []
    Trainer(Probe(), optax.sgd(0.01), key=jax.random.key(0)).fit(logged(whole), steps=7, log_every=7)
    checkpoints = Checkpoints({str(tmp_path / "ckpt")!r})
    first, second = [], []
    Trainer(Probe(), optax.sgd(0.01), key=jax.random.key(0), checkpoints=checkpoints).fit(
        logged(first), steps=3, log_every=3, checkpoint_every=3)
    checkpoints.wait()
    resumed = Trainer(Probe(), optax.sgd(0.01), key=jax.random.key(0), checkpoints=checkpoints)
    _, _, position = resumed.place()
    resumed.fit(logged(second), steps=7, log_every=7, checkpoint_every=7)
    checkpoints.wait()
    print(json.dumps({{"whole": whole, "first": first, "second": second,
                      "global": is_global_position(position), "position": position.decode()}}))
    """
    import json

    out = json.loads(python_in_subprocess(code).strip().splitlines()[-1])
    assert out["global"] and '"records": 12' in out["position"]
    assert out["first"] == out["whole"][:3]
    assert out["second"] == out["whole"][3:7]
    assert len({tuple(b) for b in out["whole"]}) > 1 and np.asarray(out["whole"]).shape == (7, 4)
