"""Every ```python block in docs/ runs as written (each page in its own interpreter)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md") if "```python" in p.read_text())


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


# Pages whose examples train through the command line: the fast lane skips them.
SLOW = {"cli.md", "training.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW
                                  else p for p in PAGES], ids=[p.name for p in PAGES])
def test_every_python_block_runs(page, python_in_subprocess, tmp_path):
    program = "\n".join(python_blocks(page))
    python_in_subprocess(program, cwd=tmp_path)
