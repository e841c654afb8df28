"""``dew audit RUN [--against RUN_B] [--json]``: which records a run consumed, proven from its ledger.

The run's data ledger (dew.training.ledger) is replayed and compared with an
uninterrupted run's consumption, or with RUN_B's (dew.provenance.ledger).
Exit status 0 when the run consumed exactly those records, 1 when not, 2
when a run has no ledger, a damaged one or one that records no step.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dew.provenance.ledger import Audit, Ledgered

__all__ = ["add_arguments", "render_audit", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("run", metavar="RUN", help="a run directory (trainer.checkpoint_dir of dew train)")
    parser.add_argument("--against", metavar="RUN_B", default=None,
                        help="compare with this run's ledger instead of an uninterrupted run's order")
    parser.add_argument("--json", action="store_true", help="print the audit as JSON")
    parser.epilog = ("examples:\n  dew audit runs/tiny-lm\n  dew audit runs/resumed --against runs/uninterrupted\n\n"
                     "exit status: 0 exactly the records; 1 records skipped, repeated or different; "
                     "2 a run without a ledger, with a damaged one or with one that records no step.")


def run(args: argparse.Namespace) -> int:
    from dew.cli.runs import note_if_training
    from dew.provenance.ledger import (
        LedgerDamagedError,
        LedgerEmptyError,
        LedgerMissingError,
        audit,
        read_ledger,
    )

    try:
        ledger = read_ledger(args.run)
        against = None if args.against is None else read_ledger(args.against)
    except (LedgerMissingError, LedgerDamagedError, LedgerEmptyError) as error:
        print(f"dew audit: {error}", file=sys.stderr)
        return 2
    result = audit(ledger, against, name=args.against or "RUN_B")
    note_if_training("audit", args.run, *([] if args.against is None else [args.against]))
    if args.json:
        print(json.dumps({**asdict(result), "exact": result.exact,
                          "segments": [asdict(s) for s in ledger.segments]}, indent=2))
    else:
        print(render_audit(result, ledger))
    return 0 if result.exact else 1


def render_audit(result: Audit, ledger: Ledgered) -> str:
    fits = "; ".join(f"from step {s.step} on {s.processes} process{'es' if s.processes > 1 else ''} "
                     f"({s.shares} data share{'s' if s.shares > 1 else ''})" for s in ledger.segments)
    lines = [f"{result.steps} steps in {len(ledger.segments)} fit{'s' if len(ledger.segments) > 1 else ''}: {fits}"]
    if ledger.undone:
        lines.append(f"{ledger.undone} step(s) trained after a checkpoint were undone by a resume and trained again")
    counts = (f"{result.records} records consumed, {result.expected} expected; {result.skipped} skipped, "
              f"{result.repeated} repeated, {result.extra} never in the reference")
    if result.exact:
        lines.append(f"identical through step {result.compared} to {result.against}: {counts}")
    elif result.agrees:  # what the ledger holds agrees; the steps before it cannot be vouched for
        lines.append(f"identical from step {result.unledgered + 1} through step {result.compared} to "
                     f"{result.against}: {counts}; steps 1 to {result.unledgered} have no ledger lines (the "
                     "ledger begins at a later fit), so what they consumed cannot be checked")
    else:
        where = f"from step {result.first_difference}" if result.first_difference is not None else "in total"
        lines.append(f"the records differ {where} from {result.against}: {counts}")
        if result.missing_steps:
            lines.append(f"steps without a ledger entry: {list(result.missing_steps)[:10]}")
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
