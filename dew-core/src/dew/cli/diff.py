"""``dew diff RUN_A RUN_B [--load] [--rtol R] [--atol A] [--json]``: where two runs part.

States are compared from the kept steps' manifests (a digest per leaf, no
array read), losses from the journals, recipes from run.json
(dew.provenance.diff). Exit status 0 when the runs are identical or agree
within the tolerances, 1 when they differ beyond them, 2 when a path is not
a run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dew.provenance.diff import RunDiff

__all__ = ["add_arguments", "render_diff", "run"]

_SHOWN = 5  # differing leaves listed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("run_a", metavar="RUN_A", help="a run directory (trainer.checkpoint_dir of dew train)")
    parser.add_argument("run_b", metavar="RUN_B", help="the run to compare it with")
    parser.add_argument("--load", action="store_true",
                        help="read the differing leaves of the first differing step and of the last common "
                             "step, and report their largest elementwise gap")
    parser.add_argument("--rtol", type=float, default=1e-4,
                        help="relative tolerance for losses and (with --load) states (default %(default)g)")
    parser.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance (default %(default)g)")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.epilog = ("examples:\n  dew diff runs/a runs/b\n  dew diff runs/one-device runs/eight-devices --load\n\n"
                     "exit status: 0 identical or within the tolerances; 1 they differ beyond them; "
                     "2 a path is not a run, or the runs keep no step in common to compare.")


def run(args: argparse.Namespace) -> int:
    from dew.checkpoints.errors import CheckpointCorruptedError
    from dew.cli.runs import note_if_training
    from dew.provenance.diff import NotARunDirectoryError, diff_runs
    from dew.telemetry.records import json_value

    for name in ("rtol", "atol"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            print(f"dew diff: --{name} {value!r} is not a tolerance; give a finite number of 0 or more.",
                  file=sys.stderr)
            return 2
    try:
        result = diff_runs(args.run_a, args.run_b, rtol=args.rtol, atol=args.atol, load=args.load)
    except (NotARunDirectoryError, CheckpointCorruptedError) as error:
        print(f"dew diff: {error}", file=sys.stderr)
        return 2
    if args.json:
        body = asdict(result)
        body.update(bitwise=result.bitwise, within_tolerance=result.within_tolerance, through=result.through)
        print(json.dumps(json_value(body), indent=2))  # a non-finite loss as the journal spells it
    else:
        print(render_diff(result))
    note_if_training("diff", args.run_a, args.run_b)
    if result.uncompared:
        return 2
    return 0 if result.bitwise or result.within_tolerance else 1


def _value(value: object) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def render_diff(result: RunDiff) -> str:
    """The comparison as lines of text, the verdict first."""
    from dew.provenance.diff import gap_width

    lines = []
    if result.uncompared:
        lines.append("not compared: the runs keep no step in common, so their states were not compared; "
                     "compare runs that keep the same steps (trainer.checkpoint_every, trainer.keep)")
    elif result.bitwise:
        last_kept = result.common_steps[-1]
        lines.append(f"identical through step {result.through}" + (
            f" (the states, kept through step {last_kept}; the losses after it)" if last_kept < result.through else ""))
    elif result.within_tolerance:
        lines.append(f"agree within the tolerance (rtol {result.rtol:g}, atol {result.atol:g}) through step "
                     f"{result.through}, not bitwise")
    else:
        lines.append(f"the runs differ (rtol {result.rtol:g}, atol {result.atol:g})")
    if result.models_differ:
        shown = ", ".join(f"{k}" for k in result.models_differ[:4])
        lines.append(f"the runs train different models ({shown}): comparing the leaves both hold with the "
                     f"same shapes; {len(result.incomparable)} leaves are not comparable")
    elif result.incomparable:
        named = ", ".join(result.incomparable[:_SHOWN]) + (
            f" and {len(result.incomparable) - _SHOWN} more" if len(result.incomparable) > _SHOWN else "")
        lines.append(f"states: {len(result.incomparable)} leaves are held by one run only or in another shape "
                     f"or dtype, so not comparable: {named}")
    if result.first_state_step is None:
        if result.common_steps and not result.weights_compared:
            lines.append("states: no parameter is held by both runs in one shape and dtype, so their weights "
                         "were not compared (only counters and keys were, and they agree)")
        elif result.common_steps:
            lines.append(f"states: identical at every common kept step ({len(result.common_steps)}, through step "
                         f"{result.common_steps[-1]})")
    else:
        leaves = ", ".join(result.differing[:_SHOWN]) + (
            f" and {len(result.differing) - _SHOWN} more" if len(result.differing) > _SHOWN else "")
        lines.append(f"states: part at step {result.first_state_step} (the first kept step that differs): {leaves}")
    for gap in sorted(result.gaps, key=lambda g: -g.relative)[:_SHOWN]:
        lines.append(f"  step {gap.step} {gap.path}: largest gap {gap.gap:.3g} (relative {gap.relative:.3g})")
    if result.first_loss is not None:
        lost = result.first_loss
        lines.append(f"losses: part at step {lost.step}: {lost.a:.8g} and {lost.b:.8g}")
    elif result.loss_steps:
        largest = result.largest_loss
        widest = gap_width(largest.a, largest.b) if largest else 0.0
        lines.append(f"losses: {'equal' if widest == 0 else 'within the tolerance'} at all "
                     f"{len(result.loss_steps)} common logged steps (largest gap {widest:.3g} at step "
                     f"{largest.step if largest else '-'})")
    if result.recipe:
        lines.append("recipes differ:")
        lines += [f"  {key}: {_value(a)} -> {_value(b)}" for key, a, b in result.recipe]
    elif result.recipes_compared:
        lines.append("recipes: the same")
    else:
        lines.append("recipes: not compared (a note below says why)")
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
