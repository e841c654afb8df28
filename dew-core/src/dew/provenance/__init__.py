"""Prove after a run: where two runs part (``diff_runs``) and which records a run consumed (``read_ledger``,
``audit``), from what a run leaves in its directory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dew._surface import surface

if TYPE_CHECKING:
    from dew.provenance.diff import RunDiff as RunDiff
    from dew.provenance.diff import diff_runs as diff_runs
    from dew.provenance.diff import load_leaves as load_leaves
    from dew.provenance.ledger import Audit as Audit
    from dew.provenance.ledger import Ledgered as Ledgered
    from dew.provenance.ledger import audit as audit
    from dew.provenance.ledger import read_ledger as read_ledger

__getattr__, __dir__, __all__ = surface(__name__, __file__)
