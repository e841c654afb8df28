"""dew-core's tests run with dew-core and ``dew.testing`` alone.

A test that needs dew-objectives, dew-data or dew-trackers belongs in tests/ (the workspace's
cross-distribution folder), so that dew-core's suite is what a reader of dew-core, or someone
who installed only dew-core, can run. Two checks hold that line:

- **Collection with the other distributions blocked.** A child interpreter puts an import hook
  in front of every other finder that refuses each module another distribution ships (found
  from their pyprojects' source folders: ``dew.objectives.lm``, ``dew.data.stream``,
  ``dew.sampling``, ``dew.trackers``, ...), then runs ``pytest --collect-only`` over
  dew-core/tests. A test module that imports one at its top, or through a surface
  (``from dew.data import ByteTokenizer``), or a registry that loads an entry point while
  collecting, fails to collect. One child collects the whole folder: about 25 s on two cores.
- **A static scan** of every file in dew-core/tests (``core_test_reach``): the imports anywhere
  in a file, inside functions too, resolved through the surfaces' ``TYPE_CHECKING`` lists;
  the imports of Python programs a test keeps in string literals (the code it runs in a child);
  a string naming a shipped recipe whose objective or data another distribution registers
  (``"tiny-lm"``, ``"tiny-lm.yaml"``); and a recipe section, in a dict literal or a YAML string,
  naming an objective, dataset or tracker another distribution registers (``{"objective":
  {"name": "lm"}}``). Under a second.

What neither catches: a program assembled at run time (joined from pieces, or read from a file);
a registered name reached through a variable or an override (``objective.name=lm``); a ``dew``
command whose implementation imports another distribution's module lazily (``dew generate``
runs dew.sampling) when the test names no shipped recipe; an entry point loaded only while a
test runs; and dew-core's own source reaching another distribution while a test runs
(``Pretrained.load`` reads a directory's tokenizer.json through dew-data's ``HFTokenizer``, so
every test that loads a Hugging Face directory with a tokenizer needs dew-data). Running
dew-core's suite with the hook in a ``sitecustomize`` on ``PYTHONPATH``, so the children the
tests start carry it too, catches those at the cost of the suite itself:
``python tests/core_test_reach.py -m "not slow"`` (pytest's arguments; dew-core/tests unless
given).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import core_test_reach as reach

CORE_TESTS = reach.ROOT / "dew-core" / "tests"

BLOCKED_COLLECTION = r"""
import importlib.abc, json, sys

BLOCKED = frozenset(json.loads(sys.argv[1]))

class OtherDistributions(importlib.abc.MetaPathFinder):
    "Refuse every module a distribution other than dew-core ships, as if it were not installed."
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not dew-core's)", name=name)
        return None

sys.meta_path.insert(0, OtherDistributions())
try:  # the hook itself: a blocked module cannot be imported, directly or through a surface
    from dew.data import TokenWindows  # noqa: F401
except ImportError:
    print("HOOK-HOLDS")
import pytest
for path in sys.argv[2:]:  # each path collected on its own, its exit status printed
    status = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", path])
    print(f"COLLECTED {path} {int(status)}", flush=True)
"""


def _collect_blocked(*paths: Path) -> tuple[str, dict[str, int]]:
    """The child's output and each path's collection status (0: every test collected)."""
    blocked = sorted(reach.foreign_modules())
    done = subprocess.run([sys.executable, "-c", BLOCKED_COLLECTION, json.dumps(blocked), *map(str, paths)],
                          cwd=reach.ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    statuses = dict(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("COLLECTED "))
    return done.stdout, {path: int(status) for path, status in statuses.items()}


def test_the_other_distributions_modules_are_found():
    foreign = reach.foreign_modules()
    # a module of each other distribution, and none of dew-core's (namespace packages two fill)
    assert {"dew.objectives.lm", "dew.data.stream", "dew.sampling", "dew.trackers.wandb"} <= foreign
    assert not {"dew.objectives", "dew.objectives.base", "dew.data", "dew.data.base", "dew.testing",
                "dew.evaluations", "dew.tracking", "dew.data.tokenizers", "dew.data.hf_tokenizer"} & foreign
    assert reach.foreign_recipes()["tiny-lm"] == "its objective 'lm' is dew-objectives's"


@pytest.mark.slow  # one child collects dew-core's whole suite (about 30 s on two cores)
def test_dew_core_tests_collect_with_the_other_distributions_blocked(tmp_path):
    # The same child also collects a module that imports dew-objectives at its top: it must fail.
    reaching = tmp_path / "test_reaches.py"
    reaching.write_text("from dew.objectives.lm import LMObjective\n\ndef test_nothing():\n    pass\n")
    out, statuses = _collect_blocked(CORE_TESTS, reaching)
    assert "HOOK-HOLDS" in out, out[-3000:]
    assert statuses[str(CORE_TESTS)] == 0, out[-6000:]
    assert statuses[str(reaching)] != 0 and "blocked: not dew-core's" in out, out[-3000:]


def test_no_dew_core_test_reaches_another_distribution():
    found = [str(r) for path in sorted(CORE_TESTS.glob("*.py")) for r in reach.reaches(path)]
    assert not found, ("dew-core's tests must run with dew-core alone: move these tests to tests/ "
                       "(git mv), or use a dew.testing double:\n" + "\n".join(found))


def test_the_scan_finds_each_kind_of_reach(tmp_path):
    source = textwrap.dedent('''
        import dew.sampling
        from dew.data import TokenWindows, Dataset
        from dew.objectives.base import Objective

        CHILD = f"""
        from dew.trackers.wandb import WandbTracker
        print({1})
        """

        def test_inside():
            from dew.objectives import lm
            from dew import Trainer
            return RunConfig.load("tiny-lm"), {"objective": {"name": "lm"}}, "data: {name: token_windows}"
    ''')
    path = tmp_path / "test_sample.py"
    path.write_text(source)
    found = [r.what for r in reach.reaches(path)]
    joined = "\n".join(found)
    assert "imports dew.sampling (dew.sampling" in joined
    assert "imports dew.data.TokenWindows (dew.data.token_windows" in joined
    assert "code in a string imports dew.trackers.wandb.WandbTracker" in joined
    assert "imports dew.objectives.lm (dew.objectives.lm" in joined
    assert "names the shipped recipe 'tiny-lm'" in joined
    assert "a recipe section 'objective' names 'lm'" in joined
    assert "a recipe in a string names the data 'token_windows'" in joined
    assert len(found) == 7, found  # dew.data.Dataset, dew.objectives.base, dew.Trainer are dew-core's
