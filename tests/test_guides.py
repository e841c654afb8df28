"""The guides the spec sends a reader to exist, are linked from the index, and their commands work.

key-concepts names "Write a custom objective", "Supply training data",
"Save and resume" and "Distributed training"; resuming-training names
"resume from a data position", "distributed training for topology
requirements" and "the TPU guide for remote setup". The pages' Python runs
in tests/test_docs.py (distributed.md and tpu.md on fake devices); here the
shell commands are checked as far as a CPU can: every `dew` command parses,
a `dew train` a TPU worker runs resolves its recipe in full (--check), and
the JobSet the TPU guide shows is what `dew launch --print jobset` prints.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
from pathlib import Path

import pytest

from dew.cli import COMMANDS, main

DOCS = Path(__file__).resolve().parents[1] / "docs"
GUIDES = {  # the spec's words -> the page and the heading that answers them
    "Write a custom objective": ("objectives.md", "# Write a custom objective"),
    "Supply training data": ("data.md", "# Supply training data"),
    "Save and resume": ("resuming.md", "# Save and resume"),
    "resume from a data position": ("resuming.md", "## Resume from a data position"),
    "distributed training for topology requirements": ("distributed.md", "## Topology requirements"),
    "the TPU guide for remote setup": ("tpu.md", "# Training on Cloud TPU"),
}


@pytest.mark.parametrize("words", list(GUIDES))
def test_every_guide_the_spec_names_is_written_and_linked(words):
    page, heading = GUIDES[words]
    assert re.search(rf"^{re.escape(heading)}$", (DOCS / page).read_text(), flags=re.M), (page, heading)
    assert f"]({page})" in (DOCS / "index.md").read_text(), f"docs/index.md does not link {page}"


def _commands(page: str) -> list[list[str]]:
    """Every `dew` command of the page's sh blocks, including those a remote shell runs (--command='dew ...')."""
    blocks = re.findall(r"```sh\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    found = []
    for line in (line.split("  #")[0].strip() for block in blocks for line in block.splitlines()):
        words = shlex.split(line)
        if words[:1] == ["dew"]:
            found.append(words[1:])
        remote = [w.split("=", 1)[1] for w in words if w.startswith("--command=")]
        found.extend(shlex.split(command)[1:] for command in remote if command.startswith("dew "))
    return found


ON_PAGES = [(page, argv) for page in ("distributed.md", "tpu.md") for argv in _commands(page)]


@pytest.mark.parametrize(("page", "argv"), ON_PAGES, ids=[f"{p}: {' '.join(a)[:50]}" for p, a in ON_PAGES])
def test_every_dew_command_on_the_guides_parses(page, argv):
    parser = argparse.ArgumentParser(prog=f"dew {argv[0]}")
    importlib.import_module(COMMANDS[argv[0]][0]).add_arguments(parser)
    parser.parse_args(argv[1:])  # exits (a failure here) on anything the command does not accept


def test_the_run_a_tpu_worker_starts_resolves_its_recipe(capsys):
    runs = [argv for argv in _commands("tpu.md") if argv[0] == "train"]
    assert runs, "tpu.md shows no dew train for the workers"
    for argv in runs:
        assert main([*argv, "--check"]) == 0, capsys.readouterr().err
        config = json.loads(capsys.readouterr().out)
        assert config["trainer"]["multi_host"] is True
        assert config["trainer"]["checkpoint_dir"].startswith("gs://")  # one directory every worker reaches


def test_the_jobset_on_the_tpu_page_is_what_launch_prints(capsys):
    text = (DOCS / "tpu.md").read_text()
    command = re.search(r"^`dew launch (--print jobset .*?)`$", text, flags=re.M).group(1)
    assert main(["launch", *shlex.split(command)]) == 0
    assert f"```yaml\n{capsys.readouterr().out}```" in text, "docs/tpu.md shows a stale --print jobset"
