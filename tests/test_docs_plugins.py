"""docs/plugins.md lists what the registry holds at test time: every entry-point group, and
every built-in name with its distribution (the table `dew describe --markdown` prints). Its
walkthrough of pipeline() and metrics() runs with the page's other Python (tests/test_docs.py)."""

from __future__ import annotations

import re
from pathlib import Path

from dew import registry
from dew.cli import main

PAGE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def test_the_groups_table_lists_every_entry_point_group():
    text = PAGE.read_text()
    table = text[text.index("## The groups"):text.index("### Errors")]
    listed = re.findall(r"^\| `(dew\.\w+)` \|", table, flags=re.M)
    assert sorted(listed) == sorted(registry.GROUPS.values()), listed
    for short, group in registry.GROUPS.items():  # each row names its registry
        assert re.search(rf"^\| `{re.escape(group)}` \| `dew\.registry\.{short}`", table, flags=re.M), group


def test_the_built_ins_table_is_what_the_registry_holds(capsys):
    assert main(["describe", "--markdown"]) == 0
    printed = capsys.readouterr().out.strip()
    shown = re.search(r"<!-- dew describe --markdown -->\n(.*?)\n<!-- end -->", PAGE.read_text(), flags=re.S)
    assert shown and shown.group(1) == printed, (
        "docs/plugins.md shows stale built-ins: paste `dew describe --markdown` over the table")
    for group in registry.GROUPS:  # and the table holds every registered name
        for name, distribution in registry.registry(group).names().items():
            assert re.search(rf"^\| `{re.escape(distribution)}` \| `{registry.GROUPS[group]}` \|.*`{name}`",
                             printed, flags=re.M), (group, name)


def test_the_walkthrough_takes_a_plugin_objective_through_generate_and_eval():
    text = PAGE.read_text()
    section = text[text.index("### What `dew generate` and `dew eval` ask of an objective"):]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    for needed in ("def pipeline(", "def metrics(", 'main(["generate"', 'main(["eval"'):
        assert needed in block, needed
    # the refusal of an objective without pipeline() points at this very section (its anchor)
    from dew.objectives.base import PIPELINE_GUIDE

    heading = section.splitlines()[0].lstrip("# ")
    anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    assert PIPELINE_GUIDE == f"docs/plugins.md#{anchor}"
