"""The involuntary full rematerializations XLA's SPMD partitioner reports, and what each concerns.

When the partitioner cannot reshard a tensor from one sharding to the next
efficiently, it replicates it whole on every device and cuts it again, and
says so on stderr ("Involuntary full rematerialization"). On an accelerator
that whole copy is what runs out of memory. The warning names an HLO
instruction of the module being partitioned, often one the partitioner made
itself; the plan finds the instructions of the module as it stood before
partitioning (XLA's dump of that pass) that match it, by name stack or by
opcode, sharding and shape, and walks their operands back through data
movement (reshapes, slices, gathers, copies) to the train state's leaves.
What reaches a leaf names the parameter; what does not is an activation,
named by where in the model it is computed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dew.planning.hlo import Instruction, Module, array_shapes

__all__ = ["Rematerialization", "attribute", "before_partitioning", "rematerializations"]

_MARK = "Involuntary full rematerialization"
_OPERATION = re.compile(r"for HLO operation:?\s+(%.*?)(?:\. As the last resort|\. You probably want|$)", re.S)
# Instructions that move or view data without computing new values: walking back through them
# from a resharded tensor reaches the state leaf it was read from.
_MOVES = {"parameter", "get-tuple-element", "bitcast", "reshape", "transpose", "copy", "convert", "slice",
          "dynamic-slice", "broadcast", "all-gather", "custom-call", "gather", "tuple", "optimization-barrier"}
_HOPS = 6


@dataclass(frozen=True)
class Rematerialization:
    """One warning: the shardings it could not go between, the instruction, and what it concerns."""

    source: str
    target: str
    operation: str
    opcode: str
    shape: str
    where: str | None
    parameters: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        subject = (f"parameter {' or '.join(self.parameters)}" if self.parameters
                   else f"an activation ({self.opcode} {self.shape}{f' in {self.where}' if self.where else ''})")
        return (f"{subject}: XLA replicates it whole to go from sharding {self.source} to "
                f"{self.target}")


def _braced(text: str, start: int) -> tuple[str, int]:
    """The balanced {...} at text[start:], and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1], i + 1
    return text[start:], len(text)


def _where(op_name: str | None) -> str | None:
    """The model path of a JAX name stack: jit(step)/jvp(CausalTransformer)/layers_0/mlp/dot -> the modules."""
    if not op_name:
        return None
    parts = [re.sub(r"^(?:[a-z_]+\()+|\)+$", "", part) for part in op_name.split("/")[1:-1]]
    return "/".join(part for part in parts if part and not part.startswith("jit(")) or None


def rematerializations(log: str) -> list[Rematerialization]:
    """Every distinct involuntary-rematerialization warning in a compiler's stderr, in order."""
    found: dict[tuple[str, str, str], Rematerialization] = {}
    for chunk in log.split(_MARK)[1:]:
        start = chunk.find("go from sharding ")
        operation = _OPERATION.search(chunk)
        if start < 0 or operation is None:
            continue
        source, after = _braced(chunk, start + len("go from sharding "))
        target_start = chunk.find("{", after)
        target, _ = _braced(chunk, target_start)
        text = operation.group(1).strip().splitlines()[0]
        instruction = Instruction.parse(text, "?")
        if instruction is None:
            continue
        key = (source, target, text)
        if key not in found:
            found[key] = Rematerialization(source, target, text, instruction.opcode, _short(instruction.shape),
                                           _where(instruction.op_name))
    return list(found.values())


def _short(shape: str) -> str:
    return ", ".join(f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in array_shapes(shape))


def before_partitioning(dump: Path) -> Module | None:
    """The largest module XLA dumped just before SPMD partitioning (the train step), if any."""
    files = sorted(dump.glob("*before_spmd-partitioning.txt"), key=lambda p: p.stat().st_size)
    return Module.parse(files[-1].read_text()) if files else None


def _compatible(candidate: Instruction, shape: str) -> bool:
    """Whether shape could be candidate's shape, whole or cut into equal pieces along its axes."""
    mine, theirs = array_shapes(candidate.shape), array_shapes(shape)
    if len(mine) != 1 or len(theirs) != 1 or len(mine[0][1]) != len(theirs[0][1]) or mine[0][0] != theirs[0][0]:
        return False
    return all(t and m % t == 0 for m, t in zip(mine[0][1], theirs[0][1], strict=True))


def _sharding(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip())


def attribute(found: Sequence[Rematerialization], module: Module | None,
              leaves: Sequence[str]) -> list[Rematerialization]:
    """found, each with the state leaves (by entry parameter index, named by leaves) it concerns."""
    if module is None:
        return list(found)
    out = []
    for remat in found:
        names = set()
        for candidate in _candidates(remat, module):
            names.update(_leaves_behind(candidate, module, leaves))
        parameters = tuple(sorted(names)) if 0 < len(names) <= 3 else ()
        out.append(Rematerialization(remat.source, remat.target, remat.operation, remat.opcode, remat.shape,
                                     remat.where, parameters))
    return out


def _candidates(remat: Rematerialization, module: Module) -> list[Instruction]:
    instruction = Instruction.parse(remat.operation, "?")
    assert instruction is not None
    if instruction.op_name:
        return [i for i in module.instructions() if i.op_name == instruction.op_name
                and i.opcode == instruction.opcode]
    shardings = {_sharding(remat.source), _sharding(remat.target)}
    return [i for i in module.instructions()
            if (instruction.opcode == "parameter" or i.opcode == instruction.opcode)
            and i.sharding is not None and _sharding(i.sharding) in shardings
            and _compatible(i, instruction.shape)]


def _leaves_behind(start: Instruction, module: Module, leaves: Sequence[str]) -> set[str]:
    """The state leaves start reads by data movement alone, within a few instructions."""
    if start.opcode not in _MOVES:
        return set()
    tables = {name: module.table(name) for name in module.computations}
    found: set[str] = set()
    frontier = [(start, 0)]
    seen = set()
    while frontier:
        instruction, hops = frontier.pop()
        if (instruction.computation, instruction.name) in seen or hops > _HOPS:
            continue
        seen.add((instruction.computation, instruction.name))
        if instruction.opcode == "parameter":
            if instruction.computation == module.entry:
                index = _index(instruction)
                if 0 <= index < len(leaves):
                    found.add(leaves[index])
            continue
        if instruction.opcode not in _MOVES:
            continue
        operands = instruction.operands[:1] if instruction.opcode in ("gather", "dynamic-slice") else instruction.operands
        if instruction.opcode == "get-tuple-element":
            outer = _through_loop(instruction, module, tables)
            if outer is not None:
                frontier.append((outer, hops + 1))
                continue
        for name in operands:
            operand = tables[instruction.computation].get(name)
            if operand is not None:
                frontier.append((operand, hops + 1))
    return found


def _index(instruction: Instruction) -> int:
    """A parameter instruction's number (its operand list holds it: parameter(3))."""
    return int(instruction.operands[0]) if instruction.operands and instruction.operands[0].isdigit() else -1


def _through_loop(instruction: Instruction, module: Module,
                  tables: dict[str, dict[str, Instruction]]) -> Instruction | None:
    """For element k of a loop body's parameter, the instruction the loop was started with there."""
    inner = tables[instruction.computation].get(instruction.operands[0]) if instruction.operands else None
    if inner is None or inner.opcode != "parameter" or instruction.computation == module.entry:
        return None
    k = int(instruction.attributes.get("index", "-1"))
    for caller in module.instructions():
        if caller.opcode == "while" and any(c == instruction.computation for c, _ in caller.called()):
            start = tables[caller.computation].get(caller.operands[0]) if caller.operands else None
            if start is not None and start.opcode == "tuple" and 0 <= k < len(start.operands):
                return tables[caller.computation].get(start.operands[k])
    return None
