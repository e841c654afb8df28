"""docs/weights.md against the code: its table names every registered objective, each `dew`
command of its sessions parses, and the lines it shows dew printing are what dew prints.
(Its Python runs in tests/test_docs.py; the commands on real runs in tests/test_recipe_matrix.py.)"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from dew import registry
from dew.cli import COMMANDS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "weights.md"


def _sessions() -> list[tuple[list[str], list[str]]]:
    """Each `$ dew ...` line of the page's console blocks, and the lines shown after it."""
    found: list[tuple[list[str], list[str]]] = []
    fence = None  # the open block's language ("" for a console session), None outside blocks
    for line in PAGE.read_text().splitlines():
        if line.startswith("```"):
            fence = line[3:] if fence is None else None
        elif fence == "" and line.startswith("$ dew "):
            found.append((shlex.split(line[2:].split("  #")[0])[1:], []))
        elif fence == "" and found and not line.startswith("$ "):
            found[-1][1].append(line)
    return found


def test_the_table_has_a_row_for_every_registered_objective():
    text = PAGE.read_text()
    table = text[text.index("## Every kind of run"):text.index("## Language models and policies")]
    rows = [row for row in table.splitlines() if row.startswith("| ")][2:]  # past the header and rule
    listed = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert set(registry.objectives.names()) <= listed, set(registry.objectives.names()) - listed


@pytest.mark.parametrize("argv", [argv for argv, _ in _sessions()], ids=lambda a: " ".join(a)[:50])
def test_every_dew_command_in_the_sessions_parses(argv):
    parser = argparse.ArgumentParser(prog=f"dew {argv[0]}")
    importlib.import_module(COMMANDS[argv[0]][0]).add_arguments(parser)
    parser.parse_args(argv[1:])


def test_the_lines_shown_for_a_digits_run_are_what_dew_prints(tmp_path):
    import flax.linen as nn
    import jax

    from dew.nn.dit import DiT
    from dew.objectives.diffusion import DiffusionObjective
    from dew.objectives.inference import GenerateRequest, UnsupportedRequestError

    shown = {" ".join(argv): lines for argv, lines in _sessions()}
    dit = DiT(image_size=8, channels=1, patch_size=4, emb_features=16, num_layers=1, num_heads=2,
              mlp_features=32, num_classes=10)  # the recipe's ten digits, a small model
    objective = DiffusionObjective(dit, schedule="flow", sampler="euler", sample_steps=2)
    pipeline = objective.pipeline(nn.meta.unbox(objective.init(jax.random.key(0))))
    with pytest.raises(UnsupportedRequestError) as refused:
        pipeline.generate(GenerateRequest(("a cat",), out=tmp_path))
    assert shown["generate runs/digits-diffusion a cat"] == [f"dew generate: {refused.value}"]
    made = pipeline.generate(GenerateRequest(("3", "7"), count=4, steps=2, out=tmp_path / "digits"))
    (line,) = shown["generate runs/digits-diffusion 3 7 --count 4 --guidance 3 --steps 32 --out digits"]
    assert line == (f"Wrote {made.samples} sample(s) to digits: {made.files[0].name} (all of them) and "
                    f"{len(made.files) - 1} file(s) more, one each")
