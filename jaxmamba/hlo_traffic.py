"""The bytes a compiled program moves and the kernels it launches, read from its optimized HLO text.

``compiled.cost_analysis()`` is None for the compile-only GPU targets of ``jaxmamba.aot``, but the optimized
HLO (``compiled.as_text()``) is there, and after XLA's fusion passes each top-level instruction of it is
one kernel (a fusion, a custom call such as a Pallas/Triton kernel or a cuBLAS GEMM, a copy). So:

* a kernel moves its operands' bytes plus its results' bytes, except where it touches only part of a
  buffer: an operand a fusion only slices or gathers from counts the slices' bytes; a fusion whose root
  updates an operand in place (dynamic-update-slice, scatter) writes the update, not the whole buffer;
* a conditional counts its most expensive branch but those marked as rare fallbacks (traced under
  ``jax.named_scope(RARE_BRANCH)``: the sampler's exact bisection beside its candidate set);
  ``Traffic.worst_case_extra_bytes`` says how much more the rare branches would move;
* loop bodies count their trip count times (XLA's ``known_trip_count``; a loop without one counts once and
  is listed in ``Traffic.unknown_trip_counts``);
* the program's in-place cache pools (entry parameters aliased to outputs: the donated caches) are indexed
  by row inside the kernels that read or update them, which the HLO cannot show: an access to one counts
  ``touched_bytes[parameter number]`` (the rows a step addresses; the whole buffer when not given). A
  ``copy`` of a pool, or a fusion reading one elementwise, still counts the whole buffer: that is the
  traffic a failed donation costs.

Free instructions (parameters, constants, tuples, bitcasts, ...) launch nothing and move nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: The named scope (``jax.named_scope``) of a conditional's rare fallback branch: not counted as the step's traffic.
RARE_BRANCH = "rare_fallback"

#: bytes per element of HLO's primitive types (token/opaque move nothing).
_ITEMSIZE = {"pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
             "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
         "partition-id", "replica-id", "add-dependency", "domain", "while", "call", "conditional", "iota"}
_SLICING = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}

_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+\w*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s*=\s*(.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_ALIAS_ENTRY = re.compile(r"\{[0-9,\s]*\}:\s*\((\d+),")
_OUTPUT_ALIAS = re.compile(r"\{(\d*)\}:\s*\((\d+),")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})$')


def array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (``f32[8,128]{1,0}``, or a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        size = _ITEMSIZE.get(dtype, 1 if dtype.startswith("f8") else 0)
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size
    return total


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    closing = set(pairs.values())
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO line: {text[:200]!r}")


def _split_top(text: str) -> list[str]:
    """``text`` split at its top-level commas."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


@dataclass
class Instr:
    name: str
    type_text: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool
    number: int | None = None  # a parameter's number

    @property
    def elements(self) -> list[str]:
        """The array types of a tuple result (one entry for an array result)."""
        if self.type_text.startswith("("):
            return _split_top(self.type_text[1:-1])
        return [self.type_text]

    def called(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%([\w.\-]+)", self.attrs)
        return m.group(1) if m else None


@dataclass
class Computation:
    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    root: str | None = None

    def users(self, name: str) -> list[Instr]:
        return [i for i in self.instrs.values() if name in i.operands]

    def parameter(self, number: int) -> Instr | None:
        return next((i for i in self.instrs.values() if i.opcode == "parameter" and i.number == number), None)


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if m is None:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
    type_text, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    close = _balanced(rest, op.end() - 1)
    operand_text = rest[op.end():close - 1]
    number = int(operand_text) if op.group(1) == "parameter" else None
    return Instr(name, type_text, op.group(1), _OPERAND.findall(operand_text), rest[close:], root, number)


def source_files(text: str) -> dict[int, str]:
    """``{stack_frame_id: source file}`` from the module's stack-frame tables: the file each operation was
    written in (its innermost frame), for attributing bytes to the code that moves them."""
    tables, current = {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := _TABLE_ROW.match(line)):
            current[int(m.group(1))] = m.group(2) if m.group(2) is not None else m.group(3)
        elif line.startswith("%") or line.startswith("ENTRY"):
            break
        else:
            current = None
    field_of = lambda row, key: int(re.search(rf"{key}=(\d+)", row).group(1))  # noqa: E731
    files = tables.get("FileNames", {})
    locations = tables.get("FileLocations", {})
    out = {}
    for frame, row in tables.get("StackFrames", {}).items():
        location = locations.get(field_of(row, "file_location_id"))
        if location is not None:
            out[frame] = files.get(field_of(location, "file_name_id"), "")
    return out


def parse_module(text: str) -> tuple[dict[str, Computation], str, set[int]]:
    """``(computations by name, the entry's name, entry parameter numbers aliased to outputs)``."""
    comps, entry, current = {}, None, None
    first = text.split("\n", 1)[0]
    aliased = set()
    if "input_output_alias=" in first:
        start = first.index("input_output_alias=") + len("input_output_alias=")
        aliased = {int(n) for n in _ALIAS_ENTRY.findall(first[start:_balanced(first, start)])}
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = Computation(m.group(2))
                comps[current.name] = current
                if m.group(1):
                    entry = current.name
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            current.instrs[instr.name] = instr
            if instr.root:
                current.root = instr.name
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry, aliased


@dataclass(frozen=True)
class KernelTraffic:
    """One top-level kernel of the program: its bytes and launches (trip counts included)."""

    name: str
    opcode: str
    op_name: str  # jax's name for the operation (metadata), for reading a report
    bytes_moved: int
    launches: int
    source: str = ""  # the file the operation was written in ("" where the HLO does not say)


@dataclass(frozen=True)
class Traffic:
    """What a compiled program reads and writes, and the kernels it launches (see the module docstring)."""

    bytes_moved: int
    kernel_launches: int
    kernels: tuple[KernelTraffic, ...]
    unknown_trip_counts: int  # loops counted once for want of a known trip count
    #: Bytes beyond ``bytes_moved`` if every conditional took its most expensive branch (a fallback).
    worst_case_extra_bytes: int = 0

    def largest(self, n: int = 10) -> list[KernelTraffic]:
        return sorted(self.kernels, key=lambda k: -k.bytes_moved)[:n]

    def by_source(self) -> dict[str, int]:
        """Bytes moved by the kernels of each source file (from its package directory on: ``jaxmamba/...``,
        ``pallas_kernels/...``; ``?`` where the HLO does not say), largest first."""
        out = {}
        for k in self.kernels:
            m = re.search(r"(?:^|/)((?:jaxmamba|pallas_kernels)/.*)$", k.source)
            name = m.group(1) if m else (k.source.rsplit("/", 1)[-1] or "?")
            out[name] = out.get(name, 0) + k.bytes_moved
        return dict(sorted(out.items(), key=lambda item: -item[1]))


class _Analysis:
    def __init__(self, comps: dict[str, Computation], touched: dict[str, int], sources: dict[int, str]):
        self.comps = comps
        self.sources = sources
        self.kernels: list[KernelTraffic] = []
        self.unknown = 0
        self.worst_extra = 0  # bytes a conditional's most expensive branch moves beyond its cheapest
        self._entry_touched = touched

    # Pool info of a value: an int (the bytes one access touches) for an array, {index: int} for a tuple.
    def run(self, comp: Computation, pools: dict, trips: int) -> dict:
        """Account ``comp``'s kernels ``trips`` times; return the pool info of every value."""
        for instr in comp.instrs.values():
            info = self._pool_of(instr, pools, comp)
            if info is not None:
                pools[instr.name] = info
            if instr.opcode == "while":
                m = _TRIP.search(instr.attrs)
                n = int(m.group(1)) if m else 1
                self.unknown += m is None
                body, cond = instr.called("body"), instr.called("condition")
                inner = {}
                if instr.operands and instr.operands[0] in pools:
                    inner = pools[instr.operands[0]]
                for sub in (body, cond):
                    param = next(i for i in self.comps[sub].instrs.values() if i.opcode == "parameter")
                    self.run(self.comps[sub], {param.name: inner} if inner else {}, trips * n)
            elif instr.opcode == "call":
                for sub in self._called(instr):
                    self.run(self.comps[sub], {}, trips)
            elif instr.opcode == "conditional":
                self._conditional(instr, trips)
            elif instr.opcode not in _FREE:
                moved = self._kernel_bytes(instr, comp, pools)
                op, frame = _OP_NAME.search(instr.attrs), _FRAME_ID.search(instr.attrs)
                self.kernels.append(KernelTraffic(instr.name, instr.opcode, op.group(1) if op else "",
                                                  moved * trips, trips,
                                                  self.sources.get(int(frame.group(1)), "") if frame else ""))
        return pools

    def _called(self, instr: Instr) -> list[str]:
        return [sub for sub in re.findall(r"%([\w.\-]+)", instr.attrs.split("metadata=")[0]) if sub in self.comps]

    def _conditional(self, instr: Instr, trips: int) -> None:
        """One branch of a conditional runs: count the most expensive branch that is not a rare fallback (one
        traced under ``jax.named_scope(RARE_BRANCH)``, e.g. the sampler's exact bisection), and keep how much
        more the most expensive branch of all would move in ``worst_extra``."""
        branches = []
        for sub in self._called(instr):
            start = len(self.kernels)
            self.run(self.comps[sub], {}, trips)
            branches.append(self.kernels[start:])
            del self.kernels[start:]
        if branches:
            cost = [sum(k.bytes_moved for k in b) for b in branches]
            # XLA's copies carry no op name: a branch is rare when every named kernel of it is in the scope.
            named = [[k.op_name for k in b if k.op_name] for b in branches]
            common = [i for i, ops in enumerate(named) if not (ops and all(RARE_BRANCH in op for op in ops))]
            chosen = max(common or range(len(branches)), key=lambda i: cost[i])
            self.kernels += branches[chosen]
            self.worst_extra += max(cost) - cost[chosen]

    def _pool_of(self, instr: Instr, pools: dict, comp: Computation):
        ops = instr.operands
        if instr.opcode == "parameter" and comp.name == self._entry_name:
            return self._entry_touched.get(instr.number)
        if instr.opcode in ("bitcast", "copy") and ops and isinstance(pools.get(ops[0]), int):
            return pools[ops[0]]
        if instr.opcode == "tuple":
            out = {i: pools[o] for i, o in enumerate(ops) if isinstance(pools.get(o), int)}
            return out or None
        if instr.opcode == "get-tuple-element" and isinstance(pools.get(ops[0]), dict):
            index = int(re.search(r"index=(\d+)", instr.attrs).group(1))
            return pools[ops[0]].get(index)
        if instr.opcode == "while" and ops:
            return pools.get(ops[0])
        aliased = self._in_place_outputs(instr, comp)
        out = {k: pools[ops[j]] for k, j in aliased.items() if isinstance(pools.get(ops[j]), int)}
        if not out:
            return None
        return out.get(None) if None in out else out

    def _in_place_outputs(self, instr: Instr, comp: Computation) -> dict:
        """``{output index (None: the whole result): operand number}`` of results that update an operand in place."""
        if instr.opcode == "custom-call":
            m = re.search(r"output_to_operand_aliasing=", instr.attrs)
            if m is None:
                return {}
            start = m.end()
            text = instr.attrs[start:_balanced(instr.attrs, start)]
            return {(int(k) if k else None): int(j) for k, j in _OUTPUT_ALIAS.findall(text)}
        if instr.opcode in _IN_PLACE:
            return {None: 0}
        if instr.opcode != "fusion":
            return {}
        fused = self.comps[instr.called("calls")]
        root = fused.instrs[fused.root]
        roots = {None: root} if root.opcode != "tuple" else {
            i: fused.instrs[o] for i, o in enumerate(root.operands)}
        out = {}
        for index, r in roots.items():
            if r.opcode in _IN_PLACE:
                p = self._through_bitcasts(fused, r.operands[0])
                if p.opcode == "parameter":
                    out[index] = p.number
        return out

    @staticmethod
    def _through_bitcasts(comp: Computation, name: str) -> Instr:
        instr = comp.instrs[name]
        while instr.opcode == "bitcast":
            instr = comp.instrs[instr.operands[0]]
        return instr

    def _kernel_bytes(self, instr: Instr, comp: Computation, pools: dict) -> int:
        elements = instr.elements
        in_place = self._in_place_outputs(instr, comp)
        written = {}  # output index -> bytes an in-place output writes
        if instr.opcode == "fusion":
            fused = self.comps[instr.called("calls")]
            root = fused.instrs[fused.root]
            roots = [root] if root.opcode != "tuple" else [fused.instrs[o] for o in root.operands]
            for index in in_place:
                r = roots[0 if index is None else index]
                update = r.operands[1] if r.opcode == "dynamic-update-slice" else r.operands[2]
                written[index] = array_bytes(fused.instrs[update].type_text)
        elif instr.opcode in _IN_PLACE:
            update = instr.operands[1] if instr.opcode == "dynamic-update-slice" else instr.operands[2]
            written[None] = array_bytes(comp.instrs[update].type_text)
        total = 0
        for number, operand in enumerate(instr.operands):
            if number in in_place.values() and instr.opcode != "custom-call":
                continue  # updated in place: the update is counted as the write
            full = array_bytes(comp.instrs[operand].type_text)
            pool = pools.get(operand)
            if isinstance(pool, int) and (instr.opcode == "custom-call" or self._only_sliced(instr, number)):
                total += min(full, pool)
            elif instr.opcode == "fusion" and self._only_sliced(instr, number):
                total += min(full, self._sliced_bytes(instr, number))
            elif instr.opcode in _SLICING and number == 0:
                total += min(full, array_bytes(instr.type_text))
            else:
                total += full
        for index, element in enumerate(elements):
            key = None if len(elements) == 1 and not instr.type_text.startswith("(") else index
            if key in written:
                total += written[key]
            elif key in in_place and instr.opcode == "custom-call":
                pool = pools.get(instr.operands[in_place[key]])
                total += min(array_bytes(element), pool) if isinstance(pool, int) else array_bytes(element)
            else:
                total += array_bytes(element)
        return total

    def _fused_users(self, instr: Instr, number: int) -> list[Instr] | None:
        """The users of fused parameter ``number`` (through bitcasts), or None for a non-fusion."""
        if instr.opcode != "fusion":
            return None
        fused = self.comps[instr.called("calls")]
        param = fused.parameter(number)
        if param is None:
            return []
        users, frontier = [], [param.name]
        while frontier:
            via = frontier.pop()
            for u in fused.users(via):
                if u.opcode == "bitcast":
                    frontier.append(u.name)
                else:
                    users.append((u, via))
        return users

    def _only_sliced(self, instr: Instr, number: int) -> bool:
        users = self._fused_users(instr, number)
        if not users:
            return False
        # Sliced from, not used as an index: the parameter is the slicing op's first operand only.
        return all(u.opcode in _SLICING and u.operands[0] == via and via not in u.operands[1:] for u, via in users)

    def _sliced_bytes(self, instr: Instr, number: int) -> int:
        return sum(array_bytes(u.type_text) for u, _ in self._fused_users(instr, number))


def analyze(hlo_text: str, touched_bytes: dict[int, int] | None = None) -> Traffic:
    """``Traffic`` of an optimized HLO module (``compiled.as_text()``). ``touched_bytes``: for entry
    parameters updated in place (the donated caches), the bytes one kernel's access touches (see the
    module docstring); an aliased parameter not named counts whole."""
    comps, entry, aliased = parse_module(hlo_text)
    touched = {}
    for number in aliased:
        param = comps[entry].parameter(number)
        if param is not None:
            touched[number] = (touched_bytes or {}).get(number, array_bytes(param.type_text))
    analysis = _Analysis(comps, touched, source_files(hlo_text))
    analysis._entry_name = entry
    analysis.run(comps[entry], {}, 1)
    kernels = tuple(analysis.kernels)
    return Traffic(sum(k.bytes_moved for k in kernels), sum(k.launches for k in kernels), kernels, analysis.unknown,
                   analysis.worst_extra)
