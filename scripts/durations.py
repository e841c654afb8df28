"""Write tests/durations.json, each test module's seconds, from a junit XML of a whole suite run.

    scripts/test --junitxml=run.xml && .venv/bin/python scripts/durations.py run.xml

The suite's workers take whole modules in collection order, and conftest.py orders the modules
longest first by this table, so no long module starts near the end while the other worker runs
out of work (the longest-processing-time-first rule). Rewrite it when modules are added or
their times change much; a module it does not list still runs (see conftest.py).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "tests" / "durations.json"


def module_of(classname: str) -> str | None:
    """The test file a junit classname ('dew-core.tests.test_x.TestY') names, relative to ROOT."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    return None


def durations(report: str | Path) -> dict[str, float]:
    """Each module's seconds in report (setup, call and teardown of its tests), longest first."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        module = module_of(case.get("classname", ""))
        if module is not None:
            seconds[module] += float(case.get("time", 0))
    return {module: round(total, 1) for module, total in sorted(seconds.items(), key=lambda item: -item[1])}


def main(report: str) -> None:
    table = durations(report)
    TABLE.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{TABLE.relative_to(ROOT)}: {len(table)} modules, {sum(table.values()):.0f} s in all")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: scripts/durations.py RUN.xml (a junit report of the whole suite)")
    main(sys.argv[1])
