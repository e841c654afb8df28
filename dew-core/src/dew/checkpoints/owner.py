"""Which run a local checkpoint folder belongs to.

A local folder (``trainer.local_checkpoint_dir``) sits outside the run's own
folder, often at a path relative to where the run started. A copy of the run
resumed from there would find the original's local folder, restore its
newest local step and write its own beside them. The folder therefore names
its run (``dew-owner.json``, written by the writer), and a run that is not
the one named, while that one is still there, is refused.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from dew.checkpoints.errors import LocalStepsOwnedError

__all__ = ["OWNER", "check_owner", "claim_folder"]

OWNER = "dew-owner.json"


def check_owner(local: Path, run: object) -> None:
    """Refuse local when it names another run than run (the persistent folder) that still exists; a
    folder naming none, or a run gone (moved away with its local folder), is this run's."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        owner = str(json.loads((local / OWNER).read_text())["checkpoint_dir"])
        if owner != str(run) and Path(owner).exists():
            raise LocalStepsOwnedError(local, owner, run)


def claim_folder(local: Path, run: object) -> None:
    """Name run as local's owner (the writer calls this once it holds the lease)."""
    with contextlib.suppress(OSError):  # a folder that cannot be written says so at the first save
        local.mkdir(parents=True, exist_ok=True)
        (local / OWNER).write_text(json.dumps({"checkpoint_dir": str(run)}) + "\n")
