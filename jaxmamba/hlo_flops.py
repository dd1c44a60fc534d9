"""The FLOPs a compiled program performs, read from its optimized HLO text.

``compiled.cost_analysis()`` is None on the compile-only GPU targets of ``jaxmamba.aot``, so the contractions
are counted from ``compiled.as_text()`` as ``jaxmamba.hlo_traffic`` counts bytes, kernel by kernel (each
top-level instruction after fusion is one kernel), loop bodies times their known trip counts, a conditional
at its costliest branch:

* ``dot`` (in a fusion or alone): ``2 x`` result elements ``x`` contracted elements;
* ``convolution``: ``2 x`` result elements ``x`` (kernel elements / output features);
* a cuBLAS GEMM custom call (``__cublas$gemm``, ``__cublas$lt$matmul``): the same from its
  ``dot_dimension_numbers``;
* a Pallas kernel compiled for a GPU (a Triton custom call): the tiles it runs for the batch, from its
  name (block shapes), shapes and grid (``jaxmamba.pallas_work``, which needs the batch: ``count_flops``'s
  ``batch``); a Pallas kernel without a formula, or any when no batch is given, is listed in
  ``Flops.unknown_kernels`` and counts 0. On the CPU the kernels run in interpret mode, as plain HLO whose
  dots count as above (every tile: the interpreter runs ``pl.when``'s skipped tiles' loads as well).

Only contractions count (multiply-adds, 2 FLOPs each): elementwise work, reductions and softmax are left
out here and in the batch's FLOPs they are compared with (``jaxmamba.roofline.batch_flops``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from jaxmamba.hlo_traffic import _TRIP, Computation, Instr, parse_module
from jaxmamba.pallas_work import BatchShape, KernelCall, kernel_work

_DIMS = re.compile(r"\b[a-z]+[0-9]*(?:e[0-9]+m[0-9]+\w*)?\[([0-9,]*)\]")
_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul")
_TRITON = "__gpu$xla.gpu.triton"


def dims_of(type_text: str) -> list[list[int]]:
    """The dimensions of every array in an HLO type (``f32[8,128]{1,0}`` -> ``[[8, 128]]``)."""
    return [[int(d) for d in filter(None, m.split(","))] for m in _DIMS.findall(type_text)]


def _attr_ints(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs)
    return [int(v) for v in m.group(1).split(",") if v] if m else []


def dot_flops(lhs_dims: list[int], result_dims: list[int], contracting: list[int]) -> int:
    return 2 * math.prod(result_dims) * math.prod(lhs_dims[d] for d in contracting)


def _convolution_flops(instr: Instr, comp: Computation) -> int:
    rhs = dims_of(comp.instrs[instr.operands[1]].type_text)[0]
    labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
    out_feature = rhs[labels.group(1).index("o")] if labels else rhs[-1]
    return 2 * math.prod(dims_of(instr.type_text)[0]) * (math.prod(rhs) // max(out_feature, 1))


@dataclass(frozen=True)
class KernelFlops:
    name: str
    opcode: str
    op_name: str
    flops: int  # over the program (trip counts included)
    launches: int
    kind: str = ""  # a custom call's target or a Pallas kernel's name


@dataclass
class Flops:
    total: int
    kernels: list[KernelFlops] = field(default_factory=list)
    unknown_kernels: list[str] = field(default_factory=list)  # Pallas kernels without a formula (counted 0)
    unknown_trip_counts: int = 0

    def by_name(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.kernels:
            out[k.name] = out.get(k.name, 0) + k.flops
        return out

    def by_op_name(self, depth: int = 3) -> dict[str, int]:
        """FLOPs by the first ``depth`` parts of jax's operation names (``jit(step)/.../dot_general``)."""
        out: dict[str, int] = {}
        for k in self.kernels:
            key = "/".join(k.op_name.split("/")[:depth]) or k.kind or k.opcode
            out[key] = out.get(key, 0) + k.flops
        return dict(sorted(out.items(), key=lambda item: -item[1]))


class _Counter:
    def __init__(self, comps: dict[str, Computation], batch: BatchShape | None):
        self.comps = comps
        self.batch = batch
        self.result = Flops(0)

    def computation_flops(self, name: str) -> int:
        """The contractions inside a fused (or otherwise called) computation, once."""
        comp, total = self.comps[name], 0
        for instr in comp.instrs.values():
            total += self.instr_flops(instr, comp)[0]
            if instr.opcode == "fusion" or instr.opcode == "call":
                for sub in _called(instr, self.comps):
                    total += self.computation_flops(sub)
        return total

    def instr_flops(self, instr: Instr, comp: Computation) -> tuple[int, str]:
        """``(FLOPs, kind)`` of one instruction, its called computations not included."""
        if instr.opcode == "dot":
            lhs = dims_of(comp.instrs[instr.operands[0]].type_text)[0]
            return dot_flops(lhs, dims_of(instr.type_text)[0], _attr_ints(instr.attrs, "lhs_contracting_dims")), ""
        if instr.opcode == "convolution":
            return _convolution_flops(instr, comp), ""
        if instr.opcode == "custom-call":
            return self._custom_call_flops(instr, comp)
        return 0, ""

    def _custom_call_flops(self, instr: Instr, comp: Computation) -> tuple[int, str]:
        target = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
        target = target.group(1) if target else ""
        if target in _CUBLAS:
            config = _json_backend_config(instr.attrs)
            numbers = config.get("gemm_backend_config", config).get("dot_dimension_numbers", {})
            lhs = dims_of(comp.instrs[instr.operands[0]].type_text)[0]
            contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
            return dot_flops(lhs, dims_of(instr.elements[0])[0], contracting), target
        if target == _TRITON:
            name, grid = _triton_launch(instr.attrs)
            call = KernelCall(name, [(dims_of(comp.instrs[o].type_text) or [[]])[0] for o in instr.operands],
                              [(dims_of(e) or [[]])[0] for e in instr.elements], grid)
            work = kernel_work(call, self.batch)
            if work is None:
                if name not in self.result.unknown_kernels:
                    self.result.unknown_kernels.append(name)
                return 0, name
            return work, name
        return 0, target

    def run(self, comp: Computation, trips: int) -> list[KernelFlops]:
        kernels = []
        for instr in comp.instrs.values():
            if instr.opcode == "while":
                m = _TRIP.search(instr.attrs)
                self.result.unknown_trip_counts += m is None
                n = int(m.group(1)) if m else 1
                for sub in (instr.called("body"), instr.called("condition")):
                    kernels += self.run(self.comps[sub], trips * n)
            elif instr.opcode == "call":
                for sub in _called(instr, self.comps):
                    kernels += self.run(self.comps[sub], trips)
            elif instr.opcode == "conditional":
                branches = [self.run(self.comps[sub], trips) for sub in _called(instr, self.comps)]
                if branches:
                    kernels += max(branches, key=lambda b: sum(k.flops for k in b))
            else:
                flops, kind = self.instr_flops(instr, comp)
                if instr.opcode == "fusion":
                    flops += sum(self.computation_flops(sub) for sub in _called(instr, self.comps))
                if flops:
                    op = re.search(r'op_name="([^"]*)"', instr.attrs)
                    kernels.append(KernelFlops(instr.name, instr.opcode, op.group(1) if op else "", flops * trips,
                                               trips, kind))
        return kernels


def _called(instr: Instr, comps: dict[str, Computation]) -> list[str]:
    return [sub for sub in re.findall(r"%([\w.\-]+)", instr.attrs.split("metadata=")[0]) if sub in comps]


def _triton_launch(attrs: str) -> tuple[str, tuple[int, int, int]]:
    """A Triton custom call's kernel name and grid, from its backend config (an MLIR attribute dictionary:
    ``{debug = false, grid_x = 25 : i32, ..., name = "ssd_bmm_cs128_bm64_bn64", ...}``; JSON in older XLAs)."""
    config = attrs[attrs.find("backend_config="):]
    name = re.search(r'"?name"?\s*[=:]\s*"([^"]*)"', re.sub(r'\bir\s*=\s*"(?:[^"\\]|\\.)*"', "", config))
    grid = tuple(int(m.group(1)) if (m := re.search(rf'"?grid_{a}"?\s*[=:]\s*"?(\d+)', config)) else 1 for a in "xyz")
    return (name.group(1) if name else ""), grid


def _json_backend_config(attrs: str) -> dict:
    """A custom call's JSON backend config (cuBLAS calls carry one), {} where there is none."""
    start = attrs.find("backend_config=")
    if start < 0:
        return {}
    try:
        config, _ = json.JSONDecoder().raw_decode(attrs, start + len("backend_config="))
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def count_flops(hlo_text: str, batch: BatchShape | None = None) -> Flops:
    """``Flops`` of an optimized HLO module (``compiled.as_text()``) running ``batch`` (for the Pallas kernels,
    whose work follows the batch's rows: ``jaxmamba.pallas_work``)."""
    comps, entry, _ = parse_module(hlo_text)
    counter = _Counter(comps, batch)
    counter.result.kernels = counter.run(comps[entry], 1)
    counter.result.total = sum(k.flops for k in counter.result.kernels)
    return counter.result
