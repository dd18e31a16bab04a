"""Compiled HLO, read back from its text: computations in schedule order, each instruction's
result arrays with their tiled sizes and memory spaces, its operands and the computations it
calls. Enough for a cost model to walk the program a device runs (compilation/step_cost.py); not a
general HLO parser."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
            "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
            "u64": 8, "f64": 8, "c64": 8, "c128": 16}
HBM = 0  # memory space 0: device memory. TPU: S(1) VMEM, S(2) sync flags, S(6) SMEM

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = ")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclass(frozen=True, slots=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int
    nbytes: int  # as laid out: the minor dims padded to the layout's first tile

    @property
    def logical_bytes(self) -> int:
        return math.prod(self.dims) * ITEMSIZE.get(self.dtype, 4)


@dataclass(slots=True)
class Instruction:
    name: str
    opcode: str
    arrays: tuple[Array, ...]  # the result: one array, or a tuple's leaves in order
    operands: tuple[str, ...]
    attributes: str  # everything after the operand list
    called: tuple[str, ...]  # computations it calls (fusion, while body/condition, ...)
    is_root: bool = False

    @property
    def array(self) -> Array:
        return self.arrays[0]

    def attribute(self, key: str) -> str | None:
        """The text of `key=...` up to the next top-level comma (braces and quotes kept)."""
        start = self.attributes.find(f"{key}=")
        if start < 0:
            return None
        i, depth, quoted = start + len(key) + 1, 0, False
        for j in range(i, len(self.attributes)):
            c = self.attributes[j]
            if c == '"' and self.attributes[j - 1] != "\\":
                quoted = not quoted
            elif not quoted and c in "{(":
                depth += 1
            elif not quoted and c in "})":
                depth -= 1
            elif not quoted and c == "," and depth == 0:
                return self.attributes[i:j]
        return self.attributes[i:]


@dataclass(slots=True)
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    by_name: dict[str, Instruction] = field(default_factory=dict)

    @property
    def root(self) -> Instruction:
        return next(i for i in reversed(self.instructions) if i.is_root)

    def parameter(self, index: int) -> Instruction:
        return next(i for i in self.instructions
                    if i.opcode == "parameter" and i.operands == (str(index),))


@dataclass(slots=True)
class HloModule:
    computations: dict[str, Computation]
    entry: str

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]


def _array(match: re.Match[str]) -> Array:
    dtype, dims_text, layout = match.group(1), match.group(2), match.group(3) or ""
    dims = tuple(int(d) for d in dims_text.split(",") if d)
    space = re.search(r"S\((\d+)\)", layout)
    return Array(dtype, dims, int(space.group(1)) if space else HBM,
                 _tiled_bytes(dtype, dims, layout))


def _tiled_bytes(dtype: str, dims: tuple[int, ...], layout: str) -> int:
    """Bytes of an array as its layout stores it: the first tile T(a,b,...) pads the most minor
    dims (in the layout's order) up to whole tiles."""
    itemsize = ITEMSIZE.get(dtype, 4)
    if not dims:
        return itemsize
    order_text, _, tiling = layout.partition(":")
    order = [int(d) for d in order_text.split(",") if d.strip().isdigit()]
    tile = re.match(r"T\(([0-9,]+)\)", tiling)
    if len(order) != len(dims) or tile is None:
        return math.prod(dims) * itemsize
    major_to_minor = [dims[d] for d in reversed(order)]
    tile_dims = [int(t) for t in tile.group(1).split(",")]
    for k, t in enumerate(reversed(tile_dims), start=1):
        if k <= len(major_to_minor):
            major_to_minor[-k] = -(-major_to_minor[-k] // t) * t
    return math.prod(major_to_minor) * itemsize


def _split_shape(text: str) -> tuple[str, str]:
    """(the result shape, the rest) of `SHAPE opcode(...)...`; a tuple shape nests parens."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    depth = 0
    for i, c in enumerate(text):
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            return text[:i + 1], text[i + 2:]
    raise ValueError(f"unbalanced tuple shape: {text[:200]}")


def _split_operands(text: str) -> tuple[str, str]:
    """(operand list, attributes) of `opcode(a, b), attrs`, from just after the `(`."""
    depth = 1
    for i, c in enumerate(text):
        depth += c in "({"
        depth -= c in ")}"
        if depth == 0:
            return text[:i], text[i + 1:].lstrip(", ")
    raise ValueError(f"unbalanced operand list: {text[:200]}")


def _parse_instruction(line: str) -> Instruction | None:
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    shape, rest = _split_shape(line[head.end():])
    opcode = _OPCODE.match(rest)
    if opcode is None:
        return None
    operand_text, attributes = _split_operands(rest[opcode.end():])
    operand_text = re.sub(r"/\*[^*]*\*/", "", operand_text)  # /*index=5*/
    operands = tuple(o.strip().lstrip("%") for o in operand_text.split(",") if o.strip())
    called = [m.group(2) for m in _CALLED.finditer(attributes)]
    branches = _BRANCHES.search(attributes)
    if branches:
        called += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
    return Instruction(head.group(2), opcode.group(1),
                       tuple(_array(m) for m in _ARRAY.finditer(shape)), operands,
                       attributes, tuple(called), bool(head.group(1)))


def parse(text: str) -> HloModule:
    computations: dict[str, Computation] = {}
    entry = ""
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = Computation(header.group(2))
                computations[current.name] = current
                entry = current.name if header.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            current.instructions.append(instruction)
            current.by_name[instruction.name] = instruction
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return HloModule(computations, entry)
