"""An export killed with SIGKILL part way leaves its OUT holding one export whole: the previous one
or the new one, never shards of both (the export is written beside OUT and swapped in).

A child saves exports of one model over and over into the same OUT, export n with every weight
equal to n, sharded (several files and an index). It is killed at moments spread over a save; OUT
must then load with every weight the same n, one the child had started to write.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.backbones import CausalTransformer
from dew.pretrained import Pretrained
from dew.testing.processes import device_env

SAVER = r"""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from dew.nn.backbones import CausalTransformer
from dew.pretrained import Pretrained

out = sys.argv[1]
model = CausalTransformer(vocab_size=64, emb_features=64, num_layers=2, num_heads=4, mlp_features=256,
                          max_seq_len=32, position_embedding="rotary", mlp_activation="swiglu")
shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
for n in range(1, 10**6):
    began = time.perf_counter()
    variables = jax.tree.map(lambda x: np.full(x.shape, n, x.dtype), shapes)
    Pretrained(model, variables, None).save(out, max_shard_bytes=100_000)
    print("saved", n, time.perf_counter() - began, flush=True)
"""


def _values(out) -> set[float]:
    loaded = Pretrained.load(out)
    return {float(v) for leaf in jax.tree.leaves(loaded.variables) for v in np.unique(np.asarray(leaf))}


@pytest.mark.slow  # three child interpreters
@pytest.mark.parametrize("share", [0.2, 0.5, 0.8])
def test_a_killed_export_leaves_out_holding_one_export_whole(tmp_path, share):
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", SAVER, str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=device_env(1))
    assert child.stdout is not None
    seconds, last = [], 0
    try:
        for line in child.stdout:
            _, n, took = line.split()
            last = int(n)
            seconds.append(float(took))
            if last == 3:  # the saves are warm: kill the fourth part way through
                time.sleep(share * float(np.median(seconds)))
                child.send_signal(signal.SIGKILL)
                break
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL, child.stderr.read()[-3000:] if child.stderr else ""
    for line in child.stdout:  # saves the child finished before the kill landed (a warm save can be quicker)
        last = int(line.split()[1])
    assert (out / "model.safetensors.index.json").is_file()
    # Every weight the same number: one export, whole, and one the child wrote (the last finished, or the next).
    values = _values(out)
    assert len(values) == 1 and values <= {float(last), float(last + 1)}, values


LEAVER = r"""
import os, sys
from pathlib import Path
from dew.pretrained.writing import fresh_beside

fresh = fresh_beside(Path(sys.argv[1]))
(fresh / "model-00001-of-00002.safetensors").write_bytes(b"half a shard")
print(fresh.name, flush=True)
if sys.argv[2] == "killed":
    os._exit(0)  # gone without removing it, as a SIGKILL leaves it
sys.stdin.read()  # still writing until the test closes its input
"""


def test_the_next_export_removes_what_a_killed_writer_left_beside_out_and_not_a_running_ones(tmp_path):
    out = tmp_path / "out"
    running = subprocess.Popen([sys.executable, "-c", LEAVER, str(out), "running"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=device_env(1))
    try:
        assert running.stdout is not None
        writing = running.stdout.readline().strip()
        killed = subprocess.run([sys.executable, "-c", LEAVER, str(out), "killed"], capture_output=True,
                                text=True, env=device_env(1), check=True).stdout.strip()
        assert {killed, writing} <= {p.name for p in tmp_path.iterdir()}
        model = CausalTransformer(vocab_size=16, emb_features=8, num_layers=1, num_heads=2, mlp_features=16,
                                  max_seq_len=8, position_embedding="rotary", mlp_activation="swiglu")
        variables = model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
        Pretrained(model, variables).save(out)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", writing])
    finally:
        running.communicate("", timeout=60)


def test_an_out_with_a_long_name_is_written(tmp_path):
    """The fresh folder was named after OUT plus a suffix, so an OUT name the file system takes (230
    characters) was refused as 'File name too long'."""
    model = CausalTransformer(vocab_size=16, emb_features=8, num_layers=1, num_heads=2, mlp_features=16,
                              max_seq_len=8, position_embedding="rotary", mlp_activation="swiglu")
    variables = model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
    out = tmp_path / ("e" * 240)
    out.mkdir()
    out.rmdir()  # a name the file system takes
    assert Pretrained(model, variables).save(out) == out and (out / "config.json").is_file()
