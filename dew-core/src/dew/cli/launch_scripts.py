"""What ``dew launch --print`` writes: an ``sbatch`` script and a JobSet manifest for a recipe.

Both start one ``dew launch`` per rank, which reads its place in the pool
from what the engine sets (srun's ``SLURM_*`` variables; the indexed Job's
``JOB_COMPLETION_INDEX`` and the two ``DEW_*`` variables the manifest sets),
so nothing in dew schedules anything: the cluster's own engine does.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ScriptRequest", "jobset_manifest", "job_name", "slurm_script"]

_MARGIN = 30  # seconds beyond the grace: the ranks' own exit after the launcher's kill
_LONGEST_SIGNAL = 65535  # sbatch --signal=SIG@TIME takes TIME up to 0xffff seconds


@dataclass(frozen=True)
class ScriptRequest:
    """A recipe and how to run it on a cluster: processes, processes per node, port, grace, the ranks'
    wait for the coordinator, image."""

    recipe: str
    overrides: tuple[str, ...] = ()
    processes: int = 1
    per_node: int = 1
    port: int | None = None  # None: Slurm's job-derived port; 8476 for a JobSet
    grace: float = 300.0
    connect_timeout: float | None = None  # None: each rank's default (300 s, or DEW_CONNECT_TIMEOUT)
    image: str = "IMAGE-WITH-DEW-INSTALLED"
    gpus_per_process: int | None = None  # None: the script asks for no GPUs (add your site's own)

    def rank_command(self) -> list[str]:
        """The command every rank runs: dew launch, which joins the pool the engine describes."""
        waits = [] if self.connect_timeout is None else ["--connect-timeout", f"{self.connect_timeout:g}"]
        return ["dew", "launch", "--grace", f"{self.grace:g}", *waits, self.recipe, *self.overrides]


def job_name(recipe: str) -> str:
    """A name a scheduler and Kubernetes' DNS both accept, from the recipe's name.

    >>> job_name("recipes/My_Run.yaml")
    'dew-my-run'
    """
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(recipe).stem.lower()).strip("-")
    return f"dew-{stem}"[:40].rstrip("-")


def _command_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def _written_by(asked: Sequence[str]) -> str:
    """The comment naming the command that wrote the file; a newline inside an argument (a prompt)
    continues the comment, where it would have ended it and made the rest a command."""
    return "# written by: dew launch " + _command_line(asked).replace("\n", "\n# ")


def slurm_script(request: ScriptRequest, asked: Sequence[str]) -> str:
    """An sbatch script: request.processes tasks, request.per_node per node, one rank each.

    >>> print(slurm_script(ScriptRequest("tiny-lm", processes=2), ["--print", "slurm"]).splitlines()[3])
    #SBATCH --nodes=2
    """
    if request.per_node < 1:
        raise ValueError(f"--per-node {request.per_node}: a node runs at least one rank.")
    if request.processes % request.per_node:
        raise ValueError(f"{request.processes} processes do not fill nodes of {request.per_node}; "
                         "choose --per-node dividing -n.")
    _check_gpus(request)
    name = job_name(request.recipe)
    warning = int(request.grace) + _MARGIN
    if warning > _LONGEST_SIGNAL:
        raise ValueError(f"--grace {request.grace:g}: Slurm's --signal warns at most {_LONGEST_SIGNAL} s ahead, "
                         f"which leaves the ranks {_LONGEST_SIGNAL - _MARGIN} s; give --grace at most that.")
    gpus = [] if request.gpus_per_process is None else [
        f"#SBATCH --gpus-per-task={request.gpus_per_process}",
        f"# --gpus-per-task: each rank its own {request.gpus_per_process} GPU(s) ({request.per_node * request.gpus_per_process}"
        " per node); dew launch makes them the rank's JAX devices (JAX_LOCAL_DEVICE_IDS).",
    ]
    lines = [
        "#!/bin/bash",
        _written_by(asked),
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={request.processes // request.per_node}",
        f"#SBATCH --ntasks={request.processes}",
        f"#SBATCH --ntasks-per-node={request.per_node}",
        f"#SBATCH --signal=TERM@{warning}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={name}-%j.log",
        *gpus,
        "# --signal: every rank hears SIGTERM that many seconds before the time limit, time for",
        "# the pool to checkpoint within its grace. --requeue: a preempted job queues again and",
        "# resumes from its checkpoint, so trainer.checkpoint_dir must be on a filesystem every",
        "# node sees. Add your site's --partition and --time lines here"
        + (", and the GPUs (--gpus-per-process K writes them)." if request.gpus_per_process is None else "."),
        "# Slurm gives each rank one CPU unless a --cpus-per-task=C line asks for more (a node's cores",
        "# over its ranks, for the data workers and the host's share of each step); srun takes it",
        "# from sbatch only through SRUN_CPUS_PER_TASK (Slurm 22.05 on), which the script sets.",
        "set -euo pipefail",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi',
        *([f"export DEW_COORDINATOR_PORT={request.port}"] if request.port is not None else []),
        f"srun --kill-on-bad-exit=1 {_command_line(request.rank_command())}",
    ]
    return "\n".join(lines) + "\n"


def jobset_manifest(request: ScriptRequest, asked: Sequence[str]) -> str:
    """A JobSet of one indexed Job with request.processes pods, one rank each.

    >>> print(jobset_manifest(ScriptRequest("tiny-lm", processes=2), []).splitlines()[4])
    kind: JobSet
    """
    _check_gpus(request)
    name = job_name(request.recipe)
    port = request.port if request.port is not None else 8476
    gpus = "" if request.gpus_per_process is None else f"""
                  resources:
                    limits:   # the pod's own GPUs, one rank per pod: all of them are the rank's
                      nvidia.com/gpu: {request.gpus_per_process}"""
    coordinator = f"{name}-ranks-0-0.{name}:{port}"
    n = request.processes
    return f"""\
{_written_by(asked)}
# kubectl apply -f this file (the JobSet controller must be installed: jobset.sigs.k8s.io).
# trainer.checkpoint_dir must be a volume every pod mounts, or a bucket (gs://...).
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: {name}
spec:
  failurePolicy:
    maxRestarts: 10   # a pool that stopped or failed starts again and resumes from its checkpoint
  replicatedJobs:
    - name: ranks
      replicas: 1
      template:
        spec:
          parallelism: {n}
          completions: {n}
          completionMode: Indexed   # JOB_COMPLETION_INDEX is each pod's rank
          backoffLimit: 0
          template:
            spec:
              restartPolicy: Never
              terminationGracePeriodSeconds: {int(request.grace) + _MARGIN}
              containers:
                - name: dew
                  image: {json.dumps(request.image)}
                  command: {json.dumps(request.rank_command())}
                  env:
                    - name: DEW_NUM_PROCESSES
                      value: "{n}"
                    - name: DEW_COORDINATOR_ADDRESS   # pod 0 of job 0, through the JobSet's service
                      value: "{coordinator}"
                  ports:
                    - containerPort: {port}{gpus}
"""


def _check_gpus(request: ScriptRequest) -> None:
    if request.gpus_per_process is not None and request.gpus_per_process < 1:
        raise ValueError(f"--gpus-per-process {request.gpus_per_process}: a rank needs at least one GPU "
                         "(leave the option out for ranks on the CPU).")
