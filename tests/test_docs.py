"""Every ```python block in docs/ runs as written (each page in its own interpreter).

A block whose first line is ``# file: NAME`` is a file of the example (a plugin's module, its
test module): it is written to NAME in the page's working directory instead, where the
page's other blocks import or test it. A page that holds the line ``<!-- devices: N -->``
runs on N fake CPU devices (its examples build meshes).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md") if "```python" in p.read_text())


FILE = re.compile(r"# file: ([\w./-]+)\n")
DEVICES = re.compile(r"^<!-- devices: (\d+) -->$", flags=re.M)


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def write_files(blocks: list[str], directory: Path) -> list[str]:
    """Write the blocks headed ``# file: NAME`` under directory; return the others."""
    program = []
    for block in blocks:
        named = FILE.match(block)
        if named is None:
            program.append(block)
            continue
        target = directory / named.group(1)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block[named.end():])
    return program


# Pages whose examples train through the command line or train for more than a few seconds:
# the fast lane skips them.
SLOW = {"cli.md", "training.md", "plugins.md", "diffusion.md", "weights.md", "objectives.md", "resuming.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW
                                  else p for p in PAGES], ids=[p.name for p in PAGES])
def test_every_python_block_runs(page, python_in_subprocess, tmp_path):
    program = "\n".join(write_files(python_blocks(page), tmp_path))
    devices = DEVICES.search(page.read_text())
    python_in_subprocess(program, cwd=tmp_path, devices=int(devices.group(1)) if devices else 1)
