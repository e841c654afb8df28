"""What a person sees: the spec's plain lines without a terminal, a live bar with one."""

from __future__ import annotations

import io

from dew.telemetry.records import Goodput
from dew.training.console import Console

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
