"""What the memory benchmarks of a frozen copy share: a fresh interpreter per arm, and the report.

frozen_bench, dpo_bench and distill_bench each train one model with and
without a frozen copy (a reference, a teacher) and print what the copy costs
in units of its own bytes. Each arm runs in its own interpreter so that its
peak is its own; its program prints one JSON line with ``state_mb``,
``step_mb`` (``STEP_MB``, XLA's accounting of the compiled step) and
``peak_mb``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

__all__ = ["STEP_MB", "report", "run"]

# Appended to an arm's program once it has `trainer`, `state` and `batch`: the compiled
# step's memory as XLA counts it (arguments and outputs less donated aliases, plus temporaries).
STEP_MB = """
from dew.training.placement.mesh import data_partition, shard_batch
sharded = shard_batch(batch, trainer.device_mesh, data_partition(trainer.device_mesh))
memory = trainer.compile(state, sharded).executable.memory_analysis()
step_mb = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
           + memory.temp_size_in_bytes) / 2**20
"""


def run(program: str, cfg: dict) -> dict:
    """Run program in a fresh interpreter with cfg as its JSON argument; return its last line."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(program), json.dumps(cfg)],
                            capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(arms: dict[str, dict], copy_mb: float, what: str) -> None:
    """Print each arm's figures, then what the second arm's copy costs in copies of copy_mb."""
    (_, without), (_, held) = arms.items()
    for name, row in arms.items():
        print(f"  {name:>24}: state {row['state_mb']:7.1f} MB, compiled step {row['step_mb']:7.1f} MB, "
              f"process peak +{row['peak_mb']:7.1f} MB")

    def copies(key: str) -> float:
        return (held[key] - without[key]) / copy_mb

    print(f"{what} costs (in copies of its bytes; target 1): state {copies('state_mb'):.2f}, "
          f"compiled step {copies('step_mb'):.2f}, process peak {copies('peak_mb'):.2f}")
