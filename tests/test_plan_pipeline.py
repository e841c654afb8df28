"""``dew plan`` on a pipelined shipped recipe: the schedule's bubble and held activations. It
plans tiny-lm, whose objective is dew-objectives', so it lives here (moved from
dew-core/tests/test_pipeline_schedules.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.mark.slow
def test_dew_plan_prints_the_schedule_s_bubble_and_held_activations(capsys):
    from dew.cli import main

    argv = ["plan", "tiny-lm", "model.scan_layers=true", "model.num_layers=4", "trainer.mesh.stage=2",
            "trainer.mesh.microbatches=4", "trainer.mesh.schedule=1f1b", "--devices", "8"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["pipeline"] == {"schedule": "1f1b", "stages": 2, "microbatches": 4, "repeats": 1,
                                "bubble": pytest.approx(1 / 5), "held": 3, "gpipe_held": 5}
    assert plan["memory"]["temporaries"] > 0
    from dew.cli.plan import render_plan

    text = render_plan(plan)
    assert "pipeline: 1f1b, 2 stages x 4 microbatches\n  bubble 20.0% of each stage's time" in text
    assert "at most 3 microbatch chunk inputs" in text and np.isfinite(plan["peak"])
