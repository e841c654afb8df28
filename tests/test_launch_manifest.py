"""The JobSet manifest ``dew launch --print jobset`` writes for a shipped recipe: every pod gets
its seat. It reads the tiny-lm recipe, whose objective is dew-objectives', so it lives here
(moved from dew-core/tests/test_launch.py)."""

from __future__ import annotations

import yaml

from dew.cli import main
from dew.training.runtime.pool import PoolSeat, seat_from_environment


def _printed(argv: list[str], capsys) -> str:
    assert main(["launch", *argv]) == 0
    return capsys.readouterr().out


def test_the_jobset_manifest_gives_every_pod_its_seat(capsys):
    text = _printed(["--print", "jobset", "-n", "4", "--image", "reg/dew:1", "tiny-lm", "trainer.steps=9"],
                    capsys)
    manifest = yaml.safe_load(text)
    assert manifest["kind"] == "JobSet" and manifest["metadata"]["name"] == "dew-tiny-lm"
    job = manifest["spec"]["replicatedJobs"][0]
    spec = job["template"]["spec"]
    assert spec["parallelism"] == spec["completions"] == 4 and spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 300  # the launcher's grace fits in Kubernetes' own
    container = pod["containers"][0]
    assert container["image"] == "reg/dew:1"
    env = {e["name"]: e["value"] for e in container["env"]}
    # JobSet's pod DNS name: <jobset>-<replicated job>-<job index>-<pod index>.<jobset>
    assert env["DEW_COORDINATOR_ADDRESS"] == f"dew-tiny-lm-{job['name']}-0-0.dew-tiny-lm:8476"
    # what pod 3 reads, and what it would run
    seat = seat_from_environment({**env, "JOB_COMPLETION_INDEX": "3"})
    assert seat == PoolSeat(env["DEW_COORDINATOR_ADDRESS"], 4, 3, "kubernetes")
    assert container["command"][:2] == ["dew", "launch"] and container["command"][-2:] == ["tiny-lm",
                                                                                         "trainer.steps=9"]
