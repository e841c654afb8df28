"""``dew launch [-n N] RECIPE [key=value ...]``: train a recipe as a pool of processes.

With ``-n N`` the launcher starts N ranks on this machine, joined by
jax.distributed over 127.0.0.1. Without it, this process is one rank of a
pool a cluster engine started (srun, a Kubernetes indexed Job or JobSet),
and its place is read from that engine's environment. Either way the ranks
run ``dew train`` with ``trainer.multi_host=true``, under the launcher's
stop handling (dew.training.runtime.launcher), each on GPUs of its own when
the machine has several (dew.training.runtime.gpus). ``--print slurm|jobset``
writes a ready sbatch script or JobSet manifest instead of running.
"""

from __future__ import annotations

import argparse
import sys

from dew.cli.runs import seconds

__all__ = ["add_arguments", "rank_argv", "run"]


def _port(text: str) -> int:
    """An argparse type: a TCP port a coordinator can listen on (1 to 65535)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1 to 65535)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.training.runtime.launcher import DEFAULT_GRACE

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("recipe", help="a recipe file, or the name of a shipped one (`dew recipes`)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, as for dew train")
    parser.add_argument("-n", "--processes", type=int, default=None, metavar="N",
                        help="start a local pool of N processes over 127.0.0.1 (without it: join the "
                             "pool srun or a Kubernetes indexed Job describes)")
    parser.add_argument("--port", type=_port, default=None,
                        help="the coordinator's port (local pool: a free one; cluster: "
                             "DEW_COORDINATOR_PORT, else derived from the Slurm job, else 8476)")
    parser.add_argument("--grace", type=seconds(0, inclusive=True), default=DEFAULT_GRACE, metavar="SECONDS",
                        help="after a stop request, how long the ranks have to checkpoint and exit "
                             "before they are killed (default %(default)g)")
    parser.add_argument("--connect-timeout", type=seconds(0, inclusive=False), default=None, metavar="SECONDS",
                        help="how long a rank waits for the coordinator (default 300, or "
                             "DEW_CONNECT_TIMEOUT)")
    parser.add_argument("--print", dest="print_kind", choices=("slurm", "jobset"), default=None,
                        help="print an sbatch script or a JobSet manifest for the recipe, and exit")
    parser.add_argument("--per-node", type=int, default=None, metavar="K",
                        help="with --print slurm: ranks per node (default 1)")
    parser.add_argument("--image", default=None,
                        help="with --print jobset: the container image that has dew installed")
    parser.add_argument("--gpus-per-process", type=int, default=None, metavar="K",
                        help="with --print: the GPUs each rank is given (Slurm --gpus-per-task, the pod's "
                             "nvidia.com/gpu limit); a local pool splits the machine's GPUs evenly")
    parser.add_argument("--check", action="store_true",
                        help="check the recipe and print each rank's command, without starting them")
    parser.epilog = (
        "examples:\n  dew launch -n 2 tiny-lm trainer.steps=20\n"
        "  dew launch --print slurm -n 8 tiny-lm > tiny-lm.sbatch && sbatch tiny-lm.sbatch\n"
        "  dew launch --print jobset -n 8 --image REGISTRY/dew:latest tiny-lm | kubectl apply -f -\n\n"
        "exit status: 0 finished; 143 stopped on request (130 after Ctrl-C) with its checkpoint "
        "written;\n137 killed after the grace, on a second signal, or a rank killed outright (kill -9); otherwise "
        "the status of the rank that failed."
    )


def rank_argv(recipe: str, overrides: list[str]) -> list[str]:
    """The command one rank runs: dew train of the recipe, in the pool.

    >>> rank_argv("tiny-lm", ["trainer.steps=5"])[-4:]
    ['train', 'tiny-lm', 'trainer.steps=5', 'trainer.multi_host=true']
    """
    return [sys.executable, "-m", "dew.cli", "train", recipe, *overrides, "trainer.multi_host=true"]


def _print_script(args: argparse.Namespace, argv: list[str]) -> int:
    from dew.cli.launch_scripts import ScriptRequest, jobset_manifest, slurm_script
    from dew.recipes.config import RunConfig, shipped
    from dew.recipes.errors import RecipeError

    try:
        folder = RunConfig.load(args.recipe, overrides=[*args.overrides, "trainer.multi_host=true"]).trainer.checkpoint_dir
    except RecipeError as error:
        print(f"dew launch: {error}", file=sys.stderr)
        return 2
    if folder is None or "{timestamp}" in folder:  # each start of the job would be a new run, from step 0
        print(f"note: the {args.print_kind} job restarts after a preemption to resume from its checkpoints, "
              f"but trainer.checkpoint_dir={folder} names "
              f"{'none' if folder is None else 'a new folder at every start'}, so a restarted job would train "
              "from step 0: give a fixed folder every node can reach (trainer.checkpoint_dir=/shared/runs/NAME).",
              file=sys.stderr)
    if args.print_kind == "jobset" and args.recipe not in shipped():
        print(f"note: each pod runs the recipe file {args.recipe} inside its container: put it in the image, or "
              "in a volume every pod mounts, at that path (a relative path starts in the container's working "
              "directory); a shipped recipe's name needs no file.", file=sys.stderr)
    request = ScriptRequest(args.recipe, tuple(args.overrides), processes=args.processes or 1,
                            per_node=1 if args.per_node is None else args.per_node, port=args.port,
                            grace=args.grace, connect_timeout=args.connect_timeout,
                            gpus_per_process=args.gpus_per_process,
                            **({"image": args.image} if args.image else {}))
    try:
        text = slurm_script(request, argv) if args.print_kind == "slurm" else jobset_manifest(request, argv)
    except ValueError as error:
        print(f"dew launch: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def run(args: argparse.Namespace) -> int:
    from dew import interrupts
    from dew.recipes.config import RunConfig
    from dew.recipes.errors import RecipeError
    from dew.training.runtime.gpus import GpuShareError, gpu_environment
    from dew.training.runtime.launcher import Rank, supervise
    from dew.training.runtime.pool import (
        CONNECT_TIMEOUT,
        PoolEnvironmentError,
        seat_from_environment,
    )

    if args.processes is not None and args.processes < 1:
        print(f"dew launch: -n {args.processes}: a pool needs at least one process.", file=sys.stderr)
        return 2
    if args.per_node is not None and args.per_node < 1:
        print(f"dew launch: --per-node {args.per_node}: a node runs at least one rank.", file=sys.stderr)
        return 2
    # Options that shape a printed cluster job, given where they would change nothing.
    shaping = (("--per-node", args.per_node, ("slurm",)), ("--image", args.image, ("jobset",)),
               ("--gpus-per-process", args.gpus_per_process, ("slurm", "jobset")))
    unread = [(flag, readers) for flag, given, readers in shaping
              if given is not None and args.print_kind not in readers]
    if unread:
        jobs = sorted({kind for _, readers in unread for kind in readers})
        print(f"dew launch: {' and '.join(flag for flag, _ in unread)} shape{'s' if len(unread) == 1 else ''} the "
              f"job{'s' if len(jobs) > 1 else ''} {' and '.join(f'`--print {kind}`' for kind in jobs)} "
              f"write{'s' if len(jobs) == 1 else ''}, and this launch "
              f"{'prints ' + repr(args.print_kind) if args.print_kind else 'starts its ranks itself'}: drop "
              f"{'it' if len(unread) == 1 else 'them'}, or print {'that job' if len(jobs) == 1 else 'one of those'}.",
              file=sys.stderr)
        return 2
    if args.print_kind is not None:
        return _print_script(args, _asked(args))
    overrides = list(args.overrides)
    try:  # once here, rather than once per rank
        RunConfig.load(args.recipe, overrides=[*overrides, "trainer.multi_host=true"])
    except RecipeError as error:
        print(f"dew launch: {error}", file=sys.stderr)
        return 2
    env = {} if args.connect_timeout is None else {CONNECT_TIMEOUT: f"{args.connect_timeout:g}"}
    argv = tuple(rank_argv(args.recipe, overrides))
    if args.processes is not None:
        from dew.training.runtime.pool import PoolSeat, free_port

        address = f"127.0.0.1:{args.port or free_port()}"
        seats = [PoolSeat(address, args.processes, i, "local", local_index=i, local_count=args.processes)
                 for i in range(args.processes)]
    else:
        try:
            seat = seat_from_environment(port=args.port)
        except PoolEnvironmentError as error:
            print(f"dew launch: {error}", file=sys.stderr)
            return 2
        if seat is None:
            print("dew launch: no pool to join: nothing in the environment comes from srun or a "
                  "Kubernetes indexed Job. Pass -n N for a local pool of N processes, or write a "
                  "cluster job with --print slurm or --print jobset.", file=sys.stderr)
            return 2
        seats = [seat]
    try:
        ranks = [Rank(s.index, argv, {**s.environment(), **gpu_environment(s.local_index, s.local_count), **env,
                                      interrupts.RANK: "1"}) for s in seats]
    except GpuShareError as error:
        print(f"dew launch: {error}", file=sys.stderr)
        return 2
    if args.check:
        for rank in ranks:
            variables = " ".join(f"{k}={v}" for k, v in sorted(rank.env.items()))
            print(f"rank {rank.index}: {variables} {' '.join(rank.argv)}")
        return 0
    return supervise(ranks, grace=args.grace)


def _asked(args: argparse.Namespace) -> list[str]:
    """The launch command as given, for the printed script's first comment."""
    from dew.training.runtime.launcher import DEFAULT_GRACE

    asked = ["--print", args.print_kind]
    if args.processes is not None:
        asked += ["-n", str(args.processes)]
    if args.per_node not in (None, 1):
        asked += ["--per-node", str(args.per_node)]
    if args.port is not None:
        asked += ["--port", str(args.port)]
    if args.grace != DEFAULT_GRACE:
        asked += ["--grace", f"{args.grace:g}"]
    if args.connect_timeout is not None:
        asked += ["--connect-timeout", f"{args.connect_timeout:g}"]
    if args.image:
        asked += ["--image", args.image]
    if args.gpus_per_process is not None:
        asked += ["--gpus-per-process", str(args.gpus_per_process)]
    return [*asked, args.recipe, *args.overrides]
