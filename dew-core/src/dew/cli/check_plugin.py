"""``dew check-plugin DISTRIBUTION [--json]``: certify an installed distribution's dew components.

Every component the distribution registers is checked by the matching
conformance kit of dew.testing, each kit in a fresh interpreter
(dew.testing.certify). The report is Markdown, to paste into the plugin's
README; the exit status gates a CI: 0 when every check passed (or was
skipped by its kit), 1 when one failed (a component that fails to load, a
name another installed distribution registers, a kit named after no
component) or a component has no kit, 2 when the distribution is not
installed or registers nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from dew.cli.runs import seconds

if TYPE_CHECKING:
    from dew.testing.certify import Check

__all__ = ["add_arguments", "render_certification", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("distribution", metavar="DISTRIBUTION",
                        help="the installed distribution's name (as in its pyproject.toml)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--timeout", type=seconds(0, inclusive=False), default=1800, metavar="SECONDS",
                        help="give up on one component's checks after this long (default %(default)g)")
    parser.epilog = (
        "A component's kit is a subclass of the dew.testing kit for its group, registered by the same name\n"
        "under the entry-point group dew.conformance:\n\n"
        '  [project.entry-points."dew.conformance"]\n  my_objective = "my_package.conformance:MyObjectiveKit"\n\n'
        "exit status: 0 every check passed; 1 a check failed (a component that fails to load, a name another\n"
        "installed distribution registers in the same group, a kit named after no component) or a component\n"
        "has no kit; 2 no such distribution, or it registers no dew component."
    )


def run(args: argparse.Namespace) -> int:
    from dew.cli import version
    from dew.testing.certify import NotADistributionError, certify

    try:
        plugin_version, checks = certify(args.distribution, timeout=args.timeout)
    except NotADistributionError as error:
        print(f"dew check-plugin: {error}", file=sys.stderr)
        return 2
    passed = all(check.result in ("passed", "skipped") for check in checks)
    if args.json:
        print(json.dumps({"distribution": args.distribution, "version": plugin_version, "dew": version(),
                          "passed": passed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render_certification(args.distribution, plugin_version, version(), checks))
    return 0 if passed else 1


def render_certification(distribution: str, plugin_version: str, dew: str, checks: list[Check]) -> str:
    """The certification as Markdown: a sentence of totals, one table row per check, then the failures."""
    import jax

    counts = {kind: sum(c.result == kind for c in checks) for kind in ("passed", "failed", "skipped", "unchecked")}
    verdict = "passes" if not counts["failed"] and not counts["unchecked"] else "does not pass"
    lines = [
        f"## dew conformance: {distribution} {plugin_version}",
        "",
        f"{distribution} {plugin_version} **{verdict}** dew's conformance kits: {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped, {counts['unchecked']} unchecked "
        f"(checked with {dew}; jax {jax.__version__}, Python {platform.python_version()}, `dew check-plugin "
        f"{distribution}`).",
        "",
        "| component | check | result |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {c.subject} | {c.check} | {c.result} |" for c in checks]
    failures = [c for c in checks if c.result in ("failed", "unchecked")]
    if failures:
        lines += ["", "### What failed", ""]
        for check in failures:
            first = check.message.strip().splitlines()[0] if check.message.strip() else ""
            lines.append(f"- {check.subject}, {check.check}: {first}")
    return "\n".join(lines)
