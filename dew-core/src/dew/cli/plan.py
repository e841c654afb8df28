"""``dew plan RECIPE [key=value ...] --devices N [--device-kind KIND ...] [--json]``: a step, before it runs.

The recipe's training step is compiled for its mesh on N fake CPU devices, in
a fresh interpreter (JAX fixes its device count when it starts), by the
trainer's own placement and compile (dew.planning). What the compiled program
holds, exchanges and computes on each device is printed; for each named
device kind, the step's compute-bound time and the memory left.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from dew.cli.runs import seconds

__all__ = ["add_arguments", "render_plan", "run"]

_LABELS = {
    "parameters": "parameters", "frozen": "frozen copies", "variables": "other variables",
    "optimizer": "optimizer state", "ema": "EMA", "accumulation": "accumulation window",
    "counters": "counters and key", "batch": "batch",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("recipe", help="a recipe file, or the name of a shipped one (`dew recipes`)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, as for dew train (trainer.mesh.fsdp=8)")
    parser.add_argument("--devices", type=int, required=True, metavar="N",
                        help="how many devices the mesh spans (faked on the CPU)")
    parser.add_argument("--device-kind", action="append", default=[], metavar="KIND",
                        help="estimate the step time and memory headroom on this kind (repeat for several): "
                             "h100, h200, a100, l4, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON, for scripts")
    parser.add_argument("--timeout", type=seconds(0, inclusive=False), default=1800, metavar="SECONDS",
                        help="give up on the compile after this long (default %(default)g)")
    parser.epilog = (
        "examples:\n  dew plan tiny-lm --devices 8 trainer.mesh.fsdp=8 --device-kind h100\n"
        "  dew plan tiny-lm --devices 8 trainer.mesh.stage=2 model.scan_layers=true --json\n\n"
        "exit status: 0 planned; 2 refused (a bad recipe, a mesh that does not divide the devices, an "
        "unknown device kind, a layout that replicates past its tolerance); 1 anything else."
    )


def _fail(message: str) -> int:
    print(f"dew plan: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from dew.recipes.config import RunConfig
    from dew.recipes.errors import RecipeError
    from dew.telemetry.hardware import UnknownAcceleratorError, accelerator

    if args.devices < 1:
        return _fail(f"--devices {args.devices}: a mesh needs at least one device.")
    try:
        kinds = [accelerator(kind) for kind in args.device_kind]
    except UnknownAcceleratorError as error:
        return _fail(str(error))
    try:
        config = RunConfig.load(args.recipe, overrides=args.overrides)
    except RecipeError as error:
        return _fail(str(error).replace("\n", " "))
    mesh = config.trainer.mesh
    if args.devices % mesh.model_devices:
        return _fail(
            f"the mesh fsdp={mesh.fsdp} x expert={mesh.expert} x tensor={mesh.tensor} x "
            f"sequence={mesh.sequence} x stage={mesh.stage} = {mesh.model_devices} devices does not divide "
            f"--devices {args.devices}; choose axis sizes whose product divides {args.devices} (the data "
            "axis takes the rest).")
    answer = _plan_in_child(args.recipe, list(args.overrides), args.devices, args.timeout,
                            xla_flags=tuple(config.trainer.xla_flags or ()))
    if "error" in answer:
        failed = answer["error"]
        if args.json:
            print(json.dumps({"refused" if failed["leaves"] else "error": failed}, indent=2))
        else:
            print(f"dew plan: {failed['type']}: {failed['message']}", file=sys.stderr)
            for leaf in failed["leaves"]:
                print(f"  {leaf['path']} {tuple(leaf['shape'])} split {leaf['spec']}: {_size(leaf['bytes'])} "
                      f"per device, {_size(leaf['perfect'])} if sharded perfectly", file=sys.stderr)
        return answer.get("status", 2)
    plan = answer["plan"]
    plan["device_kinds"] = {kind.name: _estimate(plan, kind) for kind in kinds}
    print(json.dumps(plan, indent=2) if args.json else render_plan(plan))
    return 0


def _plan_in_child(recipe: str, overrides: list[str], devices: int, timeout: float,
                   xla_flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run dew.planning in a fresh interpreter with devices fake CPU devices; its one JSON answer.

    The recipe's trainer.xla_flags are appended to the environment's XLA_FLAGS, as a run's process
    appends them before JAX starts, so the step compiled is the one the run compiles."""
    from dew.training.runtime.process import unknown_xla_flags

    with tempfile.TemporaryDirectory(prefix="dew-plan-") as dump:
        flags = [f for f in [*os.environ.get("XLA_FLAGS", "").split(), *xla_flags]
                 if not f.startswith(("--xla_force_host_platform_device_count", "--xla_dump"))]
        flags += [f"--xla_force_host_platform_device_count={devices}", f"--xla_dump_to={dump}",
                  "--xla_dump_hlo_pass_re=spmd-partitioning"]
        env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", DEW_PLAN_DUMP=dump)
        request = json.dumps({"recipe": recipe, "overrides": overrides})
        try:
            done = subprocess.run([sys.executable, "-m", "dew.planning", request], capture_output=True,
                                  text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": {"type": "Timeout", "message": f"the compile took longer than {timeout:g} s",
                              "leaves": []}, "status": 1}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    unknown = unknown_xla_flags(done.stderr) if not lines else None
    if unknown is not None:  # XLA aborted the child with its fatal line alone
        return {"error": {"type": type(unknown).__name__, "message": str(unknown), "leaves": []}, "status": 2}
    if not lines:
        tail = (done.stderr or done.stdout).strip()[-3000:]
        if done.returncode < 0:  # killed: the planner's own process cannot say why
            import signal

            name = signal.Signals(-done.returncode).name if -done.returncode in signal.valid_signals() else ""
            why = (f"the planning process was stopped by signal {-done.returncode} ({name}) before it "
                   f"planned: faking {devices} devices on this machine's CPU most likely ran it out of "
                   "memory. Plan the mesh on fewer devices (its per-device figures hold for a larger "
                   "data axis), or on a machine with more memory.")
            return {"error": {"type": "PlanFailed", "message": why + (f"\n{tail}" if tail else ""),
                              "leaves": []}, "status": 1}
        return {"error": {"type": "PlanFailed", "message": f"the planning process exited with status "
                          f"{done.returncode} and no plan:\n{tail}", "leaves": []}, "status": 1}
    answer = json.loads(lines[-1])
    if "error" in answer and done.returncode != 2:
        answer["status"] = 1
        sys.stderr.write(done.stderr[-3000:])
    return answer


def _estimate(plan: dict[str, Any], kind: Any) -> dict[str, float]:
    """The step's compute-bound time and the memory left on one device of kind."""
    usable = kind.usable()
    return {"peak_flops": kind.peak_flops, "memory": kind.memory, "usable": usable,
            "compute_bound_seconds": plan["flops_per_device"] / kind.peak_flops,
            "headroom": usable - plan["peak"]}


def _size(count: float) -> str:
    """Bytes in binary units.

    >>> _size(1536), _size(3 * 2**30)
    ('1.5 KiB', '3.00 GiB')
    """
    sign = "-" if count < 0 else ""
    count = abs(count)
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 2), ("KiB", 2**10, 1)):
        if count >= scale:
            return f"{sign}{count / scale:.{digits}f} {unit}"
    return f"{sign}{int(count)} B"


def _pipeline_lines(figures: dict[str, Any]) -> list[str]:
    """The schedule's bubble and held activations, as render_plan prints them.

    >>> for line in _pipeline_lines({"schedule": "1f1b", "stages": 4, "microbatches": 8, "repeats": 1,
    ...                                "bubble": 3 / 11, "held": 7, "gpipe_held": 11}):
    ...     print(line)
    pipeline: 1f1b, 4 stages x 8 microbatches
      bubble 27.3% of each stage's time
      a stage holds at most 7 microbatch chunk inputs (recomputing each chunk in its backward); GPipe: 11
    """
    kind = figures["schedule"]
    name = f"interleaved {kind}" if figures["repeats"] > 1 else kind
    chunks = f", {figures['repeats']} chunks per stage" if figures["repeats"] > 1 else ""
    if kind == "gpipe":
        held = f"a stage holds all its {figures['held']} iterations' activations, inside every layer"
    else:
        held = (f"a stage holds at most {figures['held']} microbatch chunk inputs (recomputing each chunk in "
                f"its backward); GPipe: {figures['gpipe_held']}")
    return [f"pipeline: {name}, {figures['stages']} stages x {figures['microbatches']} microbatches{chunks}",
            f"  bubble {100 * figures['bubble']:.1f}% of each stage's time", f"  {held}"]


def render_plan(plan: dict[str, Any]) -> str:
    """The plan as a page of text: bytes per device, collectives, FLOPs, device kinds, warnings."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in plan["mesh"].items() if size > 1) or "one device"
    lines = [f"dew plan: {plan['recipe']} on {plan['devices']} devices ({mesh}), global batch of "
             f"{plan['batch_rows']} rows", "", "per device:"]
    totals, host = plan["totals"], plan["host_totals"]
    for category, label in _LABELS.items():
        if totals[category] or host[category]:
            where = f"  (+{_size(host[category])} in host memory)" if host[category] else ""
            lines.append(f"  {label:<28}{_size(totals[category]):>12}{where}")
    memory = plan["memory"]
    lines += [
        f"  {'= inputs (XLA arguments)':<28}{_size(memory['argument']):>12}",
        f"  {'activations and temporaries':<28}{_size(memory['temporaries']):>12}",
        f"  {'output not donated':<28}{_size(memory['output'] - memory['alias']):>12}",
        f"  {'peak':<28}{_size(plan['peak']):>12}",
        "", "collectives per step, per device:",
    ]
    for kind, found in sorted(plan["collectives"].items()) or [("none", None)]:
        lines.append(f"  {kind:<20}" + (f"{found['count']:>6} x, {_size(found['bytes']):>12}" if found else ""))
    if plan.get("pipeline"):
        lines += ["", *_pipeline_lines(plan["pipeline"])]
    flops = plan["flops_per_device"]
    lines += ["", f"FLOPs per step: {flops:.3g} per device, {flops * plan['devices']:.3g} on all "
              f"{plan['devices']} (matmuls, over every loop's trips)"]
    if plan["model_flops"]:
        lines.append(f"  the objective's own count of the model's FLOPs: {plan['model_flops']:.3g}")
    for name, estimate in plan.get("device_kinds", {}).items():
        share = "" if estimate["usable"] == estimate["memory"] else (
            f" (the {estimate['usable'] / estimate['memory']:.0%} of {_size(estimate['memory'])} JAX's GPU "
            "allocator takes; XLA_PYTHON_CLIENT_MEM_FRACTION sets it)")
        lines.append(f"{name}: compute-bound step {estimate['compute_bound_seconds'] * 1e3:.3g} ms; "
                     f"memory headroom {_size(estimate['headroom'])} of {_size(estimate['usable'])}{share}")
    remats = plan["rematerializations"]
    lines += ["", f"involuntary full rematerializations XLA reported: {len(remats) or 'none'}"]
    lines += [f"  {remat['describe']}" for remat in remats]
    lines += [f"note: {note}" for note in plan["notes"]]
    lines.append("note: activations and temporaries are those of XLA's CPU compiler for this mesh; an "
                 "accelerator's compiler fuses differently")
    return "\n".join(lines)
