"""A step's time on a chip, modelled from its compiled HLO: the program the device runs, op by
op in the compiler's schedule.

- Each op moves the bytes of its operands and results that live in device memory (memory space
  0; TPU's VMEM and SMEM are on-chip). A fusion reads of an operand what it slices out of it,
  and writes in place what a dynamic-update-slice or scatter at its root updates.
- A loop counts its body times its trip count (XLA's own cost analysis counts it once).
- A Pallas kernel's reads and writes of the operands it moves by DMA come from a model beside
  the kernel (jaxserve/kernels/traffic.py), walked over the step's ragged batch; its other
  operands pass once through the grid's pipeline.
- An op takes max(bytes / HBM bandwidth, flops / peak); a collective sends its ring's bytes over
  the device's links, and an asynchronous one is hidden by the ops scheduled before its done.

Bytes are per device. step_floor.py says what no program can beat.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Callable

from jaxserve.compilation.hlo_text import HBM, ITEMSIZE, Computation, HloModule, Instruction
from jaxserve.kernels.gpu.ragged_paged_attention import KERNEL as GPU_ATTENTION
from jaxserve.kernels.gpu.ragged_paged_attention import hbm_traffic as gpu_attention_traffic
from jaxserve.kernels.tpu.ragged_paged_attention import KERNEL as TPU_ATTENTION
from jaxserve.kernels.tpu.ragged_paged_attention import hbm_traffic as tpu_attention_traffic
from jaxserve.kernels.traffic import KernelTraffic, RaggedBatch
from jaxserve.layers.moe import EXPERTS_SCOPE, hbm_traffic as grouped_matmul_traffic
from jaxserve.placement.targets import Chip

KernelModel = Callable[[str, list[tuple[tuple[int, ...], int]], RaggedBatch], KernelTraffic]
KERNEL_MODELS: dict[str, KernelModel] = {TPU_ATTENTION: tpu_attention_traffic,
                                         GPU_ATTENTION: gpu_attention_traffic,
                                         EXPERTS_SCOPE: grouped_matmul_traffic}
FREE_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
            "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
            "copy-done", "send-done", "recv-done"}
SLICING_OPS = {"dynamic-slice", "slice", "gather"}
IN_PLACE_OPS = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> operand with the update
COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"}


@dataclass
class StepCost:
    """Per device, for one step: device-memory bytes by kind, flops, and modelled seconds."""
    weights: float = 0.0  # bytes of the model's parameters read
    kv_read: float = 0.0  # bytes of KV cache read (attention kernels by their DMAs)
    kv_write: float = 0.0  # bytes of KV cache written
    activations: float = 0.0  # every other device-memory byte read or written
    flops: float = 0.0
    collective_bytes: float = 0.0  # sent over the device's links
    compute_seconds: float = 0.0  # per op: max(bytes / bandwidth, flops / peak)
    collective_seconds: float = 0.0  # the part of collectives no other op hides
    collectives: float = 0.0  # how many run
    in_kernels: float = 0.0  # of the bytes above, those Pallas kernels move

    @property
    def hbm_bytes(self) -> float:
        return self.weights + self.kv_read + self.kv_write + self.activations

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.collective_seconds

    def add(self, other: StepCost, times: float = 1.0) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + times * getattr(other, f.name))


def trip_count(module: HloModule, loop: Instruction, caller: Computation) -> int:
    """A while loop's trip count: XLA's own (known_trip_count), or read off a counted loop's
    condition `counter < N` with the counter starting from a constant."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
    if known:
        return int(known.group(1))
    condition = module.computations[loop.called[0]]
    root = condition.root
    limit = _constant(condition, root.operands[1]) if root.opcode == "compare" else None
    counter = condition.by_name.get(root.operands[0]) if root.opcode == "compare" else None
    if limit is None or counter is None or counter.opcode != "get-tuple-element" or \
            "direction=LT" not in root.attributes:
        raise ValueError(f"cannot read the trip count of {loop.name}: its condition is not "
                         "`counter < constant`")
    index = int(counter.attribute("index") or 0)
    start = _constant(caller, _tuple_operand(caller, loop.operands[0], index))
    if start is None:
        raise ValueError(f"cannot read the trip count of {loop.name}: its counter does not "
                         "start from a constant")
    return max(0, limit - start)


def _tuple_operand(comp: Computation, name: str, index: int) -> str:
    tup = comp.by_name[name]
    if tup.opcode != "tuple":
        raise ValueError(f"{name} is not a tuple")
    return tup.operands[index]


def _constant(comp: Computation, name: str) -> int | None:
    """The integer value of `name`, through copies and converts of a scalar constant."""
    instr = comp.by_name.get(name)
    while instr is not None and instr.opcode in ("copy", "convert", "bitcast"):
        instr = comp.by_name.get(instr.operands[0])
    if instr is None or instr.opcode != "constant":
        return None
    try:
        return int(instr.operands[0])
    except ValueError:
        return None


def dot_flops(comp: Computation, instr: Instruction) -> float:
    """2 x multiply-adds of a dot or convolution."""
    out = math.prod(instr.array.dims)
    if instr.opcode == "dot":
        lhs = comp.by_name[instr.operands[0]].array.dims
        contracting = instr.attribute("lhs_contracting_dims") or "{}"
        return 2.0 * out * math.prod(lhs[int(d)] for d in re.findall(r"\d+", contracting))
    if instr.opcode == "convolution":  # per output element: the kernel's dims but its outputs
        rhs = comp.by_name[instr.operands[1]].array.dims
        labels = (instr.attribute("dim_labels") or "").split("_")[1].split("->")[0]
        if len(labels) != len(rhs):
            raise ValueError(f"cannot read the dims of {instr.name}: {labels!r}")
        return 2.0 * out * math.prod(d for d, label in zip(rhs, labels) if label != "o")
    return 0.0


def group_size(instr: Instruction, num_devices: int) -> int:
    """Devices in each of a collective's replica groups."""
    groups = instr.attribute("replica_groups") or ""
    explicit = re.match(r"\{\{([0-9,]*)\}", groups)
    if explicit:
        return len(explicit.group(1).split(","))
    iota = re.match(r"\[([0-9,]+)\]<=", groups)
    if iota:
        return int(iota.group(1).split(",")[-1])
    mesh = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", groups)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2)))
    return num_devices


class _Walker:
    def __init__(self, module: HloModule, chip: Chip, batch: RaggedBatch, num_devices: int,
                 spaces: frozenset[int]):
        self.module, self.chip, self.batch = module, chip, batch
        self.num_devices, self.spaces = num_devices, spaces
        self.callers: dict[str, tuple[Computation, Instruction]] = {}
        for comp in module.computations.values():
            for instr in comp.instructions:
                for called in instr.called:
                    self.callers.setdefault(called, (comp, instr))
        self._origins: dict[tuple[str, str, int | None], str] = {}

    # ---- where an array comes from: the weights, the KV caches, or the step itself -------
    def origin(self, comp: Computation, name: str, index: int | None = None) -> str:
        key = (comp.name, name, index)
        if key not in self._origins:
            self._origins[key] = "activations"  # a cycle (loop-carried) resolves to this
            self._origins[key] = self._find_origin(comp, comp.by_name[name], index)
        return self._origins[key]

    def _find_origin(self, comp: Computation, instr: Instruction, index: int | None) -> str:
        op = instr.opcode
        if op == "parameter":
            if comp.name == self.module.entry:
                meta = instr.attribute("metadata") or ""
                if "cache" in meta:
                    return "kv"
                return ("weights" if "state[" in meta or "drafter_weights[" in meta
                        else "activations")
            caller_comp, caller = self.callers[comp.name]
            if caller.opcode == "fusion":
                return self.origin(caller_comp, caller.operands[int(instr.operands[0])])
            if caller.opcode == "while":
                return self.origin(caller_comp, caller.operands[0], index)
            return "activations"
        if op == "tuple" and index is not None:
            return self.origin(comp, instr.operands[index])
        if op == "get-tuple-element":
            return self.origin(comp, instr.operands[0], int(instr.attribute("index") or 0))
        if op == "while":
            return self.origin(comp, instr.operands[0], index)
        if op in ("bitcast", "copy", "copy-start", "copy-done", "reshape", *SLICING_OPS):
            return self.origin(comp, instr.operands[0])
        if op == "fusion":  # an update in place is the buffer it updates
            fused = self.module.computations[instr.called[0]]
            root = fused.root
            part = fused.by_name[root.operands[index]] if root.opcode == "tuple" and \
                index is not None else root
            _, into = self.fused_write(fused, part, 0.0)
            if into is not None:
                return self.origin(comp, instr.operands[into])
        if op == "custom-call" and index is not None:
            aliased = re.search(r"\{%d\}: \((\d+)," % index,
                                instr.attribute("output_to_operand_aliasing") or "")
            if aliased:
                return self.origin(comp, instr.operands[int(aliased.group(1))])
        return "activations"

    # ---- bytes an op moves -----------------------------------------------------------------
    def _read(self, cost: StepCost, comp: Computation, name: str, nbytes: float) -> None:
        kind = {"kv": "kv_read"}.get(self.origin(comp, name), self.origin(comp, name))
        setattr(cost, kind, getattr(cost, kind) + nbytes)

    def _write(self, cost: StepCost, comp: Computation, name: str, nbytes: float) -> None:
        if self.origin(comp, name) == "kv":
            cost.kv_write += nbytes
        else:
            cost.activations += nbytes

    def _operand_bytes(self, comp: Computation, name: str) -> float:
        return sum(a.nbytes for a in comp.by_name[name].arrays if a.memory_space in self.spaces)

    def fused_read(self, fused: Computation, name: str, full: float,
                   outer: tuple[tuple[Computation, str], ...] = ()) -> float:
        """Bytes a fusion reads of its operand `name` (a parameter of `fused`): what its
        slicing users take, or all of it. `outer`: the nested fusions `fused` sits in, as
        (computation, the nested fusion's instruction), whose users read what it returns."""
        total = 0.0
        if fused.root.name == name:  # returned as it is (e.g. a nested bitcast fusion)
            if not outer:
                return full
            total += self.fused_read(outer[-1][0], outer[-1][1], full, outer[:-1])
        for user in fused.instructions:
            if name not in user.operands:
                continue
            if user.opcode in SLICING_OPS and user.operands[0] == name:
                total += user.array.nbytes
            elif user.opcode in IN_PLACE_OPS and user.operands[0] == name:
                continue  # the buffer it updates in place
            elif user.opcode in ("bitcast", "reshape"):
                total += self.fused_read(fused, user.name, full, outer)
            elif user.opcode == "fusion":
                nested = self.module.computations[user.called[0]]
                total += sum(self.fused_read(nested, nested.parameter(j).name, full,
                                             (*outer, (fused, user.name)))
                             for j, operand in enumerate(user.operands) if operand == name)
            else:
                return full
        return min(total, full)

    def fused_write(self, fused: Computation, instr: Instruction, full: float,
                    ) -> tuple[float, int | None]:
        """Bytes a fusion writes of its result: an in-place update writes the update only, into
        the fusion's operand of the returned index (None: a new array)."""
        if instr.opcode in IN_PLACE_OPS:
            update = fused.by_name[instr.operands[IN_PLACE_OPS[instr.opcode]]]
            target = fused.by_name.get(instr.operands[0])
            into = int(target.operands[0]) if target and target.opcode == "parameter" else None
            return min(full, update.array.nbytes), into
        if instr.opcode == "bitcast":
            return self.fused_write(fused, fused.by_name[instr.operands[0]], full)
        return full, None

    def fused_flops(self, fused: Computation) -> float:
        return sum(self.fused_flops(self.module.computations[i.called[0]])
                   if i.opcode == "fusion" else dot_flops(fused, i)
                   for i in fused.instructions)

    def op(self, comp: Computation, instr: Instruction) -> StepCost:
        cost = StepCost()
        op = instr.opcode
        if op in FREE_OPS or op.endswith("-done"):
            return cost
        if op == "while":
            body = self.module.computations[instr.called[1]]
            cost.add(self.computation(body), trip_count(self.module, instr, comp))
            return cost
        if op == "call":
            return self.computation(self.module.computations[instr.called[0]])
        if op == "conditional":
            branches = [self.computation(self.module.computations[c]) for c in instr.called]
            return max(branches, key=lambda c: c.seconds)
        results = [a for a in instr.arrays if a.memory_space in self.spaces]
        if op == "fusion":
            fused = self.module.computations[instr.called[0]]
            for j, name in enumerate(instr.operands):
                self._read(cost, comp, name, self.fused_read(
                    fused, fused.parameter(j).name, self._operand_bytes(comp, name)))
            root = fused.root
            parts = ([fused.by_name[o] for o in root.operands] if root.opcode == "tuple"
                     else [root])
            for part, array in zip(parts, instr.arrays):
                if array.memory_space in self.spaces:
                    nbytes, into = self.fused_write(fused, part, array.nbytes)
                    if into is None:
                        cost.activations += nbytes
                    else:  # e.g. the KV cache, updated in place by a scatter
                        self._write(cost, comp, instr.operands[into], nbytes)
            cost.flops = self.fused_flops(fused)
        elif (kernel := self._kernel(instr)) is not None:
            self._kernel_call(cost, comp, instr, *kernel)
        elif op == "copy-start":  # (destination, source, context)
            self._read(cost, comp, instr.operands[0], self._operand_bytes(comp, instr.operands[0]))
            if instr.arrays[0].memory_space in self.spaces:
                cost.activations += instr.arrays[0].nbytes
        elif op == "slice-start":  # ((operand), slice, context): the slice moves, async
            source, dest = comp.by_name[instr.operands[0]].array, instr.arrays[1]
            if source.memory_space in self.spaces:
                self._read(cost, comp, instr.operands[0], dest.nbytes)
            if dest.memory_space in self.spaces:
                cost.activations += dest.nbytes
        elif op in SLICING_OPS:
            self._read(cost, comp, instr.operands[0], sum(a.nbytes for a in results))
            cost.activations += sum(a.nbytes for a in results)
        elif op in IN_PLACE_OPS:
            update = instr.operands[IN_PLACE_OPS[op]]
            self._read(cost, comp, update, self._operand_bytes(comp, update))
            self._write(cost, comp, instr.operands[0], self._operand_bytes(comp, update))
        else:
            for name in instr.operands:
                if name in comp.by_name:
                    self._read(cost, comp, name, self._operand_bytes(comp, name))
            cost.activations += sum(a.nbytes for a in results)
            cost.flops = dot_flops(comp, instr)
        cost.compute_seconds = max(cost.hbm_bytes / self.chip.hbm_bandwidth,
                                   cost.flops / self.chip.bf16_flops)
        return cost

    def _kernel(self, instr: Instruction) -> tuple[str, KernelModel] | None:
        """The Pallas kernel a custom call runs, by its name: the instruction's (TPU) or the
        op name in its metadata (GPU's Triton calls are all `pallas_call`)."""
        if instr.opcode != "custom-call":
            return None
        text = instr.name + " " + (instr.attribute("metadata") or "")
        for prefix, model in KERNEL_MODELS.items():
            found = re.search(rf"\b{prefix}(?:_[a-z]\d+)*\b", text)
            if found:
                return found.group(0), model
        return None

    def _kernel_call(self, cost: StepCost, comp: Computation, instr: Instruction, name: str,
                     model: KernelModel) -> None:
        operands = [(comp.by_name[o].array.dims, ITEMSIZE[comp.by_name[o].array.dtype])
                    for o in instr.operands]
        traffic = model(name, operands, self.batch)
        cost.kv_read += traffic.kv_read
        cost.kv_write += traffic.kv_write
        cost.weights += traffic.weights
        cost.flops += traffic.flops
        for j, name in enumerate(instr.operands):
            if j not in traffic.manual_operands:
                self._read(cost, comp, name, self._operand_bytes(comp, name))
        aliased = set(re.findall(r"\{(\d*)\}: \((\d+),",
                                 instr.attribute("output_to_operand_aliasing") or ""))
        manual_results = {int(out or 0) for out, operand in aliased
                          if int(operand) in traffic.manual_operands}
        cost.activations += sum(a.nbytes for k, a in enumerate(instr.arrays)
                                if a.memory_space in self.spaces and k not in manual_results)
        cost.in_kernels = cost.hbm_bytes

    def collective(self, comp: Computation, instr: Instruction) -> StepCost:
        """A collective's device-memory traffic, and its bytes and seconds on the links."""
        cost = StepCost(collectives=1)
        kind = instr.opcode.removesuffix("-start")
        n = group_size(instr, self.num_devices)
        size = sum(a.nbytes for o in instr.operands if o in comp.by_name
                   for a in comp.by_name[o].arrays)
        share, steps = {"all-reduce": (2 * (n - 1) / n, 2 * (n - 1)),
                        "all-gather": (n - 1, n - 1),  # of its operand, 1/n of the output
                        "reduce-scatter": ((n - 1) / n, n - 1),
                        "all-to-all": ((n - 1) / n, n - 1),
                        "collective-permute": (1.0, 1)}[kind]
        cost.collective_bytes = share * size if n > 1 else 0.0
        link_seconds = self.chip.collective_seconds(cost.collective_bytes, steps,
                                                    self.links(instr)) if n > 1 else 0.0
        for name in instr.operands:
            if name in comp.by_name:
                self._read(cost, comp, name, self._operand_bytes(comp, name))
        cost.activations += sum(a.nbytes for a in instr.arrays[:1] if a.memory_space in self.spaces)
        cost.compute_seconds = cost.hbm_bytes / self.chip.hbm_bandwidth
        cost.collective_seconds = link_seconds
        return cost

    def links(self, instr: Instruction) -> int:
        """The ports a collective sends over at once: as many as the rings ("colors") TPU's
        compiler built it from, else all; a collective-permute sends to one neighbour."""
        if instr.opcode.startswith("collective-permute"):
            return 1
        colors = re.search(r"colors:(\d+)", instr.attributes)
        return int(colors.group(1)) if colors else self.chip.ports

    def computation(self, comp: Computation) -> StepCost:
        """One run of `comp`, in schedule order: an async collective's link time counts only
        where the ops scheduled between its start and its done do not cover it."""
        total = StepCost()
        clock = 0.0
        pending: dict[str, tuple[float, float]] = {}  # start -> (clock at start, link seconds)
        for instr in comp.instructions:
            kind = instr.opcode.removesuffix("-start")
            if kind in COLLECTIVES:
                cost = self.collective(comp, instr)
                if instr.opcode.endswith("-start"):  # on the links from here to its done
                    link, cost.collective_seconds = cost.collective_seconds, 0.0
                    pending[instr.name] = (clock + cost.seconds, link)
            elif instr.opcode.endswith("-done") and instr.operands and \
                    instr.operands[0] in pending:
                started, link = pending.pop(instr.operands[0])
                cost = StepCost(collective_seconds=max(0.0, link - (clock - started)))
            else:
                cost = self.op(comp, instr)
            clock += cost.seconds
            total.add(cost)
        return total


def step_cost(module: HloModule, chip: Chip, batch: RaggedBatch, num_devices: int,
              spaces: frozenset[int] = frozenset({HBM})) -> StepCost:
    """The modelled cost of one run of the compiled step on one device. `spaces`: the memory
    spaces whose bytes count (device memory; all of them to compare with XLA's own count)."""
    return _Walker(module, chip, batch, num_devices, spaces).computation(
        module.entry_computation)
