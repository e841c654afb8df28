"""docs/tools.md: every `dew` command on the page is one its command accepts, and every command the
page documents is on it. (The output it shows is compared with the command's in test_tools_plan.py.)"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from dew.cli import COMMANDS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "tools.md"


def _commands() -> list[list[str]]:
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(), flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("dew ")]


COMMANDS_ON_PAGE = _commands()


@pytest.mark.parametrize("argv", COMMANDS_ON_PAGE, ids=[" ".join(c)[:60] for c in COMMANDS_ON_PAGE])
def test_every_command_on_the_page_parses(argv):
    parser = argparse.ArgumentParser(prog=f"dew {argv[0]}")
    importlib.import_module(COMMANDS[argv[0]][0]).add_arguments(parser)
    parser.parse_args(argv[1:])  # exits (a failure here) on anything the command does not accept


def test_the_page_covers_the_five_commands():
    assert {argv[0] for argv in COMMANDS_ON_PAGE} == {"plan", "diff", "audit", "rescore", "check-plugin"}
