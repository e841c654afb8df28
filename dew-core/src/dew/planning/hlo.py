"""Read an HLO module's text: its computations, how often each runs, its collectives and matmuls.

XLA's own cost analysis counts a loop's body once, however many times the
loop runs, and it does not list collectives; a training step is mostly
loops (a scanned layer stack, a pipeline's iterations, accumulation). So
the plan reads the compiled module's text itself: every computation is
weighted by how many times one step runs it (a while loop's body by its
``known_trip_count``), and the collectives and matmul FLOPs are summed
over those weights.

>>> text = '''HloModule m
...
... %body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
...   %p = (s32[], f32[8,4]{1,0}) parameter(0)
...   %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
...   %w = f32[4,4]{1,0} constant({...})
...   %d = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
...   %r = f32[8,4]{1,0} all-reduce(%d), replica_groups={{0,1}}, to_apply=%add
...   ROOT %t = (s32[], f32[8,4]{1,0}) tuple(%i, %r)
... }
...
... ENTRY %main (a: f32[8,4]) -> f32[8,4] {
...   %a = f32[8,4]{1,0} parameter(0)
...   %w = (s32[], f32[8,4]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
...   ROOT %g = f32[8,4]{1,0} all-gather(%a), dimensions={0}
... }
... '''
>>> module = Module.parse(text)
>>> module.weights["body"]
3
>>> module.matmul_flops()  # 3 iterations of 2 * 8 * 4 * 4
768
>>> {kind: (c.count, c.bytes) for kind, c in module.collectives().items()}
{'all-reduce': (3, 384), 'all-gather': (1, 128)}
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["COLLECTIVES", "Collective", "Instruction", "Module", "array_bytes", "array_shapes", "shape_bytes",
           "split_top"]

# Element sizes in bits of the HLO primitive types.
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
    "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64,
    "c128": 128, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\]")

# Collective opcodes, by the kind a plan reports them under (an async -start counts, its -done not).
COLLECTIVES = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
    "collective-broadcast": "collective-broadcast",
}


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return int(dtype[1])
    raise ValueError(f"unknown HLO element type {dtype!r}")


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array of a shape's text (a tuple's components in order) as (dtype, dims).

    >>> array_shapes("(f32[2,3]{1,0}, s32[])")
    [('f32', (2, 3)), ('s32', ())]
    """
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(shape)]


def array_bytes(shape: str) -> list[int]:
    """Bytes of each array a shape's text holds (a tuple's components in order)."""
    return [math.prod(dims) * _bits(dtype) // 8 for dtype, dims in array_shapes(shape)]


def shape_bytes(shape: str) -> int:
    """Bytes of every array a shape's text holds (a tuple's components summed)."""
    return sum(array_bytes(shape))


def split_top(text: str, separator: str = ",") -> list[str]:
    """text split at separators outside brackets, braces, parentheses and quotes.

    >>> split_top('a={1,2}, b="x,y", c=(3, 4)')
    ['a={1,2}', 'b="x,y"', 'c=(3, 4)']
    """
    parts, depth, quoted, start = [], 0, False, 0
    for i, char in enumerate(text):
        if char == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and char in "{[(":
            depth += 1
        elif not quoted and char in "}])":
            depth -= 1
        elif not quoted and depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i].strip())
            start = i + len(separator)
    tail = text[start:].strip()
    if tail:
        parts.append(tail)
    return parts


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at start."""
    depth, quoted = 0, False
    for i in range(start, len(text)):
        char = text[i]
        if char == '"' and text[i - 1] != "\\":
            quoted = not quoted
        elif quoted:
            continue
        elif char in "{[(":
            depth += 1
        elif char in "}])":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, result shape, opcode, operand names and attributes."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: dict[str, str]
    computation: str

    @classmethod
    def parse(cls, line: str, computation: str) -> Instruction | None:
        """The instruction a line of a computation's body defines (None for anything else)."""
        line = line.strip()
        if line.startswith("ROOT "):
            line = line[5:]
        if not line.startswith("%") or " = " not in line:
            return None
        name, rest = line[1:].split(" = ", 1)
        if rest.startswith("("):
            end = _closing(rest, 0)
        else:
            end = rest.find(" ")
        shape, rest = rest[:end], rest[end:].lstrip()
        opening = rest.find("(")
        if opening < 0:
            return None
        opcode = rest[:opening]
        close = _closing(rest, opening)
        operands = tuple(o.split(" ")[-1].lstrip("%") for o in split_top(rest[opening + 1:close - 1]) if o)
        attributes = {}
        for part in split_top(rest[close:].lstrip(", ")):
            key, _, value = part.partition("=")
            attributes[key.strip()] = value.strip()
        return cls(name, shape, opcode, operands, attributes, computation)

    @property
    def bytes(self) -> int:
        return shape_bytes(self.shape)

    @property
    def op_name(self) -> str | None:
        """The JAX name stack XLA keeps in the instruction's metadata (where in the model it is)."""
        found = re.search(r'op_name="([^"]*)"', self.attributes.get("metadata", ""))
        return found.group(1) if found else None

    @property
    def sharding(self) -> str | None:
        return self.attributes.get("sharding")

    def called(self) -> Iterator[tuple[str, int]]:
        """(computation, times per run of this instruction) for every computation it calls."""
        trips = 1
        if self.opcode == "while":
            found = re.search(r'"known_trip_count":\{"n":"(\d+)"', self.attributes.get("backend_config", ""))
            trips = int(found.group(1)) if found else 1
        for key in ("calls", "to_apply", "body", "condition", "true_computation", "false_computation"):
            value = self.attributes.get(key)
            if value:
                for name in value.strip("{}").split(","):
                    if name.strip():
                        yield name.strip().lstrip("%"), trips if key in ("body", "condition") else 1
        branches = self.attributes.get("branch_computations")
        if branches:
            for name in branches.strip("{}").split(","):
                yield name.strip().lstrip("%"), 1


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: how many run and the bytes they move, per device."""

    count: int = 0
    bytes: int = 0


@dataclass
class Module:
    """An HLO module's computations (in text order), and each one's runs per run of the entry."""

    computations: dict[str, list[Instruction]]
    entry: str
    weights: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Module:
        computations: dict[str, list[Instruction]] = {}
        entry = None
        current: str | None = None
        for line in text.splitlines():
            if current is None:
                header = re.match(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$", line)
                if header and not line.startswith(" "):
                    current = header.group(2)
                    computations[current] = []
                    if header.group(1):
                        entry = current
                continue
            if line.startswith("}"):
                current = None
                continue
            instruction = Instruction.parse(line, current)
            if instruction is not None:
                computations[current].append(instruction)
        if entry is None:
            raise ValueError("The HLO text has no ENTRY computation.")
        module = cls(computations, entry)
        module.weights = module._weigh()
        return module

    def _weigh(self) -> dict[str, int]:
        """Runs of every computation per run of the entry (callers come after callees in the text)."""
        weights: dict[str, int] = defaultdict(int)
        weights[self.entry] = 1
        for name in reversed(list(self.computations)):
            weight = weights.get(name, 0)
            if not weight:
                continue
            for instruction in self.computations[name]:
                for callee, times in instruction.called():
                    weights[callee] += weight * times
        return dict(weights)

    def instructions(self) -> Iterator[Instruction]:
        for body in self.computations.values():
            yield from body

    def table(self, computation: str) -> dict[str, Instruction]:
        return {instruction.name: instruction for instruction in self.computations.get(computation, [])}

    def collectives(self) -> dict[str, Collective]:
        """Per kind, the collectives one step runs and the bytes they move on each device.

        The bytes of one collective are the size of the whole buffer it
        exchanges: an all-gather's and an all-to-all's result, a
        reduce-scatter's operand, an all-reduce's operand (every operand of a
        combined one), a collective-permute's result. An all-reduce whose
        result each device only slices its share of is the reduce-scatter
        SPMD partitioning meant, and is counted as one (see _only_sliced):

        >>> text = '''HloModule m
        ...
        ... ENTRY %main (g: f32[8,4], n: f32[4]) -> (f32[2,4], f32[4]) {
        ...   %g = f32[8,4]{1,0} parameter(0)
        ...   %n = f32[4]{0} parameter(1)
        ...   %r = (f32[8,4]{1,0}, f32[4]{0}) all-reduce(%g, %n), replica_groups={{0,1,2,3}}, to_apply=%add
        ...   %e = f32[8,4]{1,0} get-tuple-element(%r), index=0
        ...   %i = u32[] partition-id()
        ...   %s = f32[2,4]{1,0} dynamic-slice(%e, %i, %i), dynamic_slice_sizes={2,4}
        ...   %m = f32[4]{0} get-tuple-element(%r), index=1
        ...   ROOT %t = (f32[2,4]{1,0}, f32[4]{0}) tuple(%s, %m)
        ... }
        ... '''
        >>> {kind: (c.count, c.bytes) for kind, c in Module.parse(text).collectives().items()}
        {'reduce-scatter': (1, 128), 'all-reduce': (1, 16)}
        """
        found: dict[str, Collective] = {}

        def add(kind: str, weight: int, size: int, count: int = 1) -> None:
            before = found.get(kind, Collective())
            found[kind] = Collective(before.count + weight * count, before.bytes + weight * size)

        for name, body in self.computations.items():
            weight = self.weights.get(name, 0)
            if not weight:
                continue
            symbols = None
            users: dict[str, list[Instruction]] | None = None
            for instruction in body:
                kind = COLLECTIVES.get(instruction.opcode)
                if kind is None:
                    continue
                if instruction.opcode == "all-reduce":  # a reduce-scatter the CPU compiler left unformed
                    users = users if users is not None else self._users(name)
                    elements = array_bytes(instruction.shape)
                    scattered = [size for index, size in enumerate(elements)
                                 if self._only_sliced(instruction, index, size, users)]
                    if scattered:
                        add("reduce-scatter", weight, sum(scattered), len(scattered))
                    if len(scattered) < len(elements):
                        add(kind, weight, sum(elements) - sum(scattered))
                    continue
                if kind == "reduce-scatter":
                    symbols = symbols or self.table(name)
                    size = sum(symbols[o].bytes for o in instruction.operands if o in symbols)
                elif instruction.opcode.endswith("-start") and kind != "all-reduce":
                    parts = split_top(instruction.shape.strip()[1:-1]) if instruction.shape.startswith("(") else []
                    size = shape_bytes(parts[1]) if len(parts) > 1 else instruction.bytes
                else:
                    size = instruction.bytes
                add(kind, weight, size)
        return found

    def _users(self, computation: str) -> dict[str, list[Instruction]]:
        """Each value of computation and the instructions that read it."""
        users: dict[str, list[Instruction]] = defaultdict(list)
        for instruction in self.computations.get(computation, []):
            for operand in instruction.operands:
                users[operand].append(instruction)
        return users

    def _only_sliced(self, reduced: Instruction, index: int, size: int,
                     users: dict[str, list[Instruction]]) -> bool:
        """Whether every reader of the all-reduce's result (its index-th, when it is a tuple) takes
        only a slice of it (a dynamic-slice, or a fusion holding one, with a smaller result): a
        reduce-scatter, as SPMD partitioning writes one. XLA's GPU and TPU pipelines turn the pair
        into a reduce-scatter (its ReduceScatterCreator pass); the CPU pipeline the plan compiles
        with leaves it, and counted as an all-reduce it would misstate what an FSDP step exchanges."""
        if reduced.shape.startswith("("):
            readers = [user for element in users.get(reduced.name, [])
                       if element.opcode == "get-tuple-element" and element.attributes.get("index") == str(index)
                       for user in users.get(element.name, [])]
        else:
            readers = users.get(reduced.name, [])

        def slices(user: Instruction) -> bool:
            if user.bytes >= size:
                return False
            if user.opcode == "dynamic-slice":
                return True
            fused = user.attributes.get("calls", "").strip("{}").lstrip("%")
            return user.opcode == "fusion" and any(i.opcode == "dynamic-slice"
                                                   for i in self.computations.get(fused, []))

        return bool(readers) and all(slices(user) for user in readers)

    def matmul_flops(self) -> int:
        """FLOPs of the step's matmuls and convolutions on one device (2 per multiply-add)."""
        total = 0
        for name, body in self.computations.items():
            weight = self.weights.get(name, 0)
            if not weight:
                continue
            symbols = None
            for instruction in body:
                if instruction.opcode not in ("dot", "convolution"):
                    continue
                symbols = symbols or self.table(name)
                total += weight * _flops(instruction, symbols)
        return total


def _dims(value: str | None) -> list[int]:
    return [int(d) for d in (value or "").strip("{}").split(",") if d.strip()]


def _flops(instruction: Instruction, symbols: dict[str, Instruction]) -> int:
    shapes = array_shapes(instruction.shape)
    if not shapes:
        return 0
    out = math.prod(shapes[0][1])
    operands = [symbols.get(o) for o in instruction.operands]
    if instruction.opcode == "dot":
        lhs = operands[0]
        if lhs is None:
            return 0
        dims = array_shapes(lhs.shape)[0][1]
        contracted = math.prod(dims[d] for d in _dims(instruction.attributes.get("lhs_contracting_dims")))
        return 2 * out * contracted
    rhs = operands[1] if len(operands) > 1 else None
    labels = instruction.attributes.get("dim_labels", "")
    if rhs is None or "_" not in labels:
        return 0
    kernel = labels.split("_")[1].split("->")[0]
    dims = array_shapes(rhs.shape)[0][1]
    per_output = math.prod(d for d, label in zip(dims, kernel, strict=False) if label != "o")
    return 2 * out * per_output

