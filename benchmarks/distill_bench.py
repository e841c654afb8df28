"""What a distillation teacher costs in memory: its bytes once, in the state and in the compiled step.

Two fresh interpreters train the same small student with adam through
Trainer.fit: once on the labels alone (LMObjective), once distilled from a
larger causal transformer held frozen beside it (DistillationObjective,
forward KL). Each reports the bytes its TrainState holds, the compiled step's
peak (XLA's memory analysis: arguments and outputs less the donated aliases,
plus temporaries) and the process's peak resident memory. The script prints
the differences in units of the teacher's parameter bytes (target: 1.0 for
the state, one copy; an optimizer state or EMA copy of the teacher would
show as 3 or more). The compiled step also holds the teacher's activations,
so its figure sits a little above 1. On a CPU the process peak is rougher.

    .venv/bin/python benchmarks/distill_bench.py [--teacher-width 512] [--teacher-layers 4]
"""

from __future__ import annotations

import argparse

from reference_memory import STEP_MB, report, run

from dew.cli.runs import positive

PROGRAM = """
import contextlib, io, itertools, json, resource, sys
import jax, numpy as np, optax
from dew import Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.objectives.distillation import DistillationObjective
from dew.objectives.lm import LMObjective
cfg = json.loads(sys.argv[1])
seq = 64
student = CausalTransformer(vocab_size=512, emb_features=64, num_layers=1, num_heads=2, mlp_features=256,
                            max_seq_len=seq)
teacher = CausalTransformer(vocab_size=512, emb_features=cfg["teacher_width"], num_layers=cfg["teacher_layers"],
                            num_heads=8, mlp_features=4 * cfg["teacher_width"], max_seq_len=seq)
objective = (DistillationObjective(student, teacher, seq) if cfg["teacher"] else LMObjective(student, seq))
batch = {"text": np.random.default_rng(0).integers(0, 512, size=(8, seq + 1)).astype(np.int32)}
data = Dataset(train=lambda p: itertools.repeat(batch), batch=8)
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
baseline = rss_mb()
trainer = Trainer(objective, optax.adam(1e-4), key=jax.random.key(0))
with contextlib.redirect_stdout(io.StringIO()):
    state = trainer.fit(data, steps=3, log_every=3)
""" + STEP_MB + """
size = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree)) / 2**20
teacher_mb = size(state.params["params"]["teacher"]) if cfg["teacher"] else 0.0
print(json.dumps({"peak_mb": rss_mb() - baseline, "step_mb": step_mb, "state_mb": size(state),
                  "teacher_mb": teacher_mb}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-width", type=positive, default=512)
    parser.add_argument("--teacher-layers", type=positive, default=4)
    args = parser.parse_args()
    cfg = {"teacher_width": args.teacher_width, "teacher_layers": args.teacher_layers}
    alone = run(PROGRAM, {**cfg, "teacher": False})
    both = run(PROGRAM, {**cfg, "teacher": True})
    teacher = both["teacher_mb"]
    print(f"teacher: {args.teacher_layers} layers of width {args.teacher_width}, {teacher:.1f} MB of parameters; "
          "student: 1 layer of width 64; adam")
    report({"student on labels": alone, "student distilled": both}, teacher, "the teacher")


if __name__ == "__main__":
    main()
