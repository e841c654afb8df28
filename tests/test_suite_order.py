"""The suite hands its files to the workers longest first, by a table scripts/durations.py writes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest


def _script(repository: Path):
    spec = importlib.util.spec_from_file_location("durations", repository / "scripts" / "durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_durations_sums_each_files_tests_from_a_junit_report(repository, tmp_path):
    report = tmp_path / "run.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_kits_dew.TestDPOObjective" name="a" time="1.25"/>'
        '<testcase classname="tests.test_kits_dew.TestGRPOObjective" name="b" time="2.5"/>'
        '<testcase classname="dew-core.tests.test_trainer" name="c" time="7.0"/>'
        '<testcase classname="tests.no_such_module" name="d" time="99"/>'
        '</testsuite></testsuites>')
    table = _script(repository).durations(report)
    assert table == {"dew-core/tests/test_trainer.py": 7.0, "tests/test_kits_dew.py": 3.8}
    assert list(table) == ["dew-core/tests/test_trainer.py", "tests/test_kits_dew.py"]  # longest first


def _collected(repository: Path, paths: list[str], *options: str) -> list[str]:
    found = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            *options, *paths], capture_output=True, text=True, cwd=repository, timeout=300)
    assert found.returncode == 0, found.stdout + found.stderr
    return [line for line in found.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_collection_puts_the_longest_listed_file_first_and_keeps_each_files_order(repository):
    table = json.loads((repository / "tests" / "durations.json").read_text())
    longest = [path for path in table if (repository / path).is_file()][:3]
    ordered = _collected(repository, longest[::-1])  # given shortest first
    as_given = _collected(repository, longest[::-1], "--noconftest")  # without the workspace's hook
    assert list(dict.fromkeys(node.split("::", 1)[0] for node in ordered)) == longest
    assert list(dict.fromkeys(node.split("::", 1)[0] for node in as_given)) == longest[::-1]
    for path in longest:  # each file's tests together, in the order the file gives them
        assert [n for n in ordered if n.startswith(path + "::")] == [n for n in as_given if n.startswith(path + "::")]
        first = next(i for i, n in enumerate(ordered) if n.startswith(path + "::"))
        assert all(n.startswith(path + "::") for n in ordered[first:first + sum(n.startswith(path + "::") for n in ordered)])
