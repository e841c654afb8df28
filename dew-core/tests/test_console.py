"""What a person sees: the spec's plain lines without a terminal, a live bar with one."""

from __future__ import annotations

import io

from dew.telemetry.records import Goodput
from dew.tracking.console import Console

MESH = {"data": 1, "expert": 1, "fsdp": 1, "tensor": 1, "sequence": 1, "stage": 1}
SPEC_LINES = [
    "Training from step 0 to 100 on {'data': 1, 'expert': 1, 'fsdp': 1, 'tensor': 1, "
    "'sequence': 1, 'stage': 1} (1 process(es))",
    "step 25: loss 0.0306",
    "step 50: loss 0.0102",
    "Goodput: first step after 2.14 s, 28.4% of the wall time in steps",
]


def _fit(console: Console) -> None:
    console.start(0, 100, MESH, 1)
    for step in range(1, 51):
        console.advance(step)
        if step == 25:
            console.log(25, {"train/loss": 0.03061, "throughput": 12.5})
        if step == 50:
            console.log(50, {"train/loss": 0.01018})
    # 28.4% of 10 s in steps; the first step ended after 2.14 s
    console.finish(Goodput(first_step_seconds=2.14, wall_seconds=10.0, step_seconds=2.84))
    console.close()


def test_plain_lines_without_a_terminal(capsys):
    _fit(Console())  # pytest's captured stdout is not a terminal
    assert capsys.readouterr().out.splitlines() == SPEC_LINES


def test_advance_prints_nothing_in_plain_mode():
    stream = io.StringIO()
    console = Console(stream)
    console.start(0, 10, {"data": 1}, 1)
    before = stream.getvalue()
    for step in range(1, 11):
        console.advance(step)
    assert stream.getvalue() == before


def test_scalars_without_a_loss_are_all_shown():
    stream = io.StringIO()
    Console(stream).log(7, {"reward": 0.5, "kl": 0.00012})
    assert stream.getvalue() == "step 7: reward 0.5000, kl 0.00012\n"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_display_on_a_terminal_keeps_the_spec_lines():
    stream = Terminal()
    console = Console(stream)
    _fit(console)
    text = stream.getvalue()
    for line in SPEC_LINES:
        assert line in text
    assert "steps/s" in text and "loss 0.0102" in text and "50/100" in text


PTY_RUN = r'''
import itertools, sys, time
import jax, numpy as np, optax
from dew import Checkpoints, Trainer
from dew.data import Dataset
from dew.testing.doubles import Linear


def slow(partition):  # y = 2x, one batch every 50 ms
    for _ in itertools.count():
        time.sleep(0.05)
        yield {"x": np.ones((4, 1), np.float32), "y": np.full((4, 1), 2.0, np.float32)}


Trainer(Linear(inputs=1), optax.sgd(0.1), key=jax.random.key(0), checkpoints=Checkpoints(sys.argv[1])).fit(
    Dataset(train=slow, batch=4), steps=40, log_every=20, checkpoint_every=20)
'''


def test_a_terminal_shows_the_compile_line_checkpoint_lines_and_an_eta_that_agrees(tmp_path):
    """A real fit on a pseudo-terminal: rich draws the bar, the news lines print above it."""
    import os
    import pty
    import re
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(PTY_RUN)
    leader, follower = pty.openpty()
    env = dict(os.environ, JAX_PLATFORMS="cpu", COLUMNS="160", TERM="xterm")
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt")], stdout=follower,
                             stderr=follower, env=env, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert child.wait(timeout=300) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    assert "compiling the step for batches of 4 rows: " in text
    assert re.search(r"step 20: checkpoint handed to the writer, the loop blocked [0-9.]+ s", text)
    assert re.search(r"step 40: checkpoint handed to the writer", text)
    assert f"checkpoints: {tmp_path / 'ckpt'}" in text
    # Every drawn bar's time left is the steps left over its own rate (within rounding).
    bars = re.findall(r"(\d+)/40 .*?([0-9.]+) steps/s\s+eta (\d+):(\d\d):(\d\d)", text)
    assert bars, text[-2000:]
    for done, rate, hours, minutes, seconds in bars:
        left = int(hours) * 3600 + int(minutes) * 60 + int(seconds)
        expected = (40 - int(done)) / float(rate)
        assert abs(left - expected) <= 1 + 0.05 * expected, (done, rate, left)
