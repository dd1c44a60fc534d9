"""A ``jax.profiler`` trace of one compiled program turned into a table of its kernels.

The profiler writes an XSpace (``<run>/<host>.xplane.pb``); ``jax.profiler.ProfileData`` reads it without
TensorFlow. The events of XLA's kernels carry an ``hlo_op`` stat (the optimized HLO instruction: a fusion, a
custom call, a cuBLAS GEMM) and an ``hlo_module`` stat (the program):

* on a GPU they are on the device plane (``/device:GPU:0``), one line per CUDA stream; lines that the
  profiler derives from them (``XLA Ops``, ``XLA Modules``, ...) would count them twice and are skipped;
* on the CPU, XLA's thunks are host events (``/host:CPU``, the client's and Eigen's threads). A thunk that runs others (a while loop's, a conditional's) spans its body's
  events on the same thread: only the innermost events count, so no time is counted twice.

Where a trace has no such event (an older runtime, a backend that does not record its thunks),
``KernelTable.events_found`` is False and the table says so instead of inventing numbers.
"""

from __future__ import annotations

import glob
import os
from dataclasses import asdict, dataclass, field

#: Lines of a device plane that the profiler derives from the stream lines (their events repeat the kernels').
_DERIVED_LINES = ("XLA Ops", "XLA Modules", "XLA TraceMe", "Steps", "Framework", "Source code", "Launch Stats")


@dataclass
class KernelRow:
    """One kernel (an optimized-HLO instruction) over the traced steps."""

    name: str  # the HLO instruction (``hlo_op``)
    launches: int  # per step
    time_us: float  # per step, summed over its launches
    share: float = 0.0  # of the step's time
    flops: int | None = None  # per step (``jaxmamba.hlo_flops``), where known
    bytes_moved: int | None = None  # per step (``jaxmamba.hlo_traffic``)
    kind: str = ""  # the HLO opcode, and a Pallas kernel's or a custom call's name
    op_name: str = ""  # jax's name for the operation

    @property
    def flops_per_s(self) -> float | None:
        return self.flops / (self.time_us * 1e-6) if self.flops and self.time_us > 0 else None

    @property
    def bytes_per_s(self) -> float | None:
        return self.bytes_moved / (self.time_us * 1e-6) if self.bytes_moved and self.time_us > 0 else None


@dataclass
class KernelTable:
    """The kernels of ``steps`` traced steps, per step, largest time first."""

    steps: int
    step_ms: float  # wall time of one step, timed apart from the trace (the shares' denominator)
    rows: list[KernelRow] = field(default_factory=list)
    events_found: bool = True
    planes: list[str] = field(default_factory=list)  # where the events were read (for the report)
    note: str = ""

    @property
    def kernel_ms(self) -> float:
        return sum(r.time_us for r in self.rows) / 1e3

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "rows"}
        out["kernel_ms"] = self.kernel_ms
        out["rows"] = [asdict(r) | {"flops_per_s": r.flops_per_s, "bytes_per_s": r.bytes_per_s} for r in self.rows]
        return out

    def format(self, limit: int = 40) -> str:
        if not self.events_found:
            return (f"no kernel events in the trace ({self.note or 'the runtime recorded none'}); step "
                    f"{self.step_ms:.3f} ms wall over {self.steps} steps")
        lines = [f"{'kernel (HLO op)':<44}{'kind':<26}{'launch':>7}{'us/step':>10}{'share':>7}{'GFLOP':>9}"
                 f"{'TFLOP/s':>9}{'MB':>9}{'GB/s':>8}"]
        for r in self.rows[:limit]:
            fl = f"{r.flops / 1e9:9.3f}" if r.flops else f"{'':>9}"
            rate = f"{r.flops_per_s / 1e12:9.2f}" if r.flops_per_s else f"{'':>9}"
            mb = f"{r.bytes_moved / 1e6:9.2f}" if r.bytes_moved else f"{'':>9}"
            bw = f"{r.bytes_per_s / 1e9:8.1f}" if r.bytes_per_s else f"{'':>8}"
            lines.append(f"{r.name[:43]:<44}{r.kind[:25]:<26}{r.launches:>7}{r.time_us:>10.1f}"
                         f"{100 * r.share:>6.1f}%{fl}{rate}{mb}{bw}")
        if len(self.rows) > limit:
            rest = self.rows[limit:]
            lines.append(f"{f'... {len(rest)} more kernels':<70}{sum(r.launches for r in rest):>7}"
                         f"{sum(r.time_us for r in rest):>10.1f}{100 * sum(r.share for r in rest):>6.1f}%")
        gap = self.step_ms - self.kernel_ms
        outside = (f"{gap:.3f} ms outside kernels: launch gaps, host work, idle" if gap >= 0 else
                   "kernels overlap: independent thunks run on several threads or streams")
        lines.append(f"kernels {self.kernel_ms:.3f} ms of a {self.step_ms:.3f} ms step ({self.steps} steps traced; "
                     f"{outside}){'; ' + self.note if self.note else ''}")
        return "\n".join(lines)


def latest_xplane(log_dir: str) -> str:
    """The newest ``*.xplane.pb`` under ``log_dir`` (``jax.profiler.trace`` writes one per run directory)."""
    paths = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no .xplane.pb under {log_dir}: did jax.profiler.trace run?")
    return max(paths, key=os.path.getmtime)


@dataclass(frozen=True)
class _Event:
    op: str
    module: str
    start_ns: float
    duration_ns: float
    line: str


def _stats(event) -> dict:
    out = {}
    for key, value in event.stats:
        out.setdefault(key, value)
    return out


def read_events(profile) -> tuple[list[_Event], list[str]]:
    """``(kernel events, planes they came from)`` of a ``jax.profiler.ProfileData``: device planes' stream lines
    where a device plane has kernel events, else the host plane's innermost thunk events."""
    device, host = [], []
    for plane in profile.planes:
        on_device = plane.name.startswith("/device:")
        if not on_device and not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            if on_device and line.name in _DERIVED_LINES:
                continue
            for event in line.events:
                stats = _stats(event)
                op = stats.get("hlo_op")
                if not op or event.name.startswith("end: "):
                    continue
                item = _Event(str(op), str(stats.get("hlo_module", "")), float(event.start_ns),
                              float(event.duration_ns), f"{plane.name}/{line.name}")
                (device if on_device else host).append((plane.name, item))
    chosen = device or host
    events = [e for _, e in chosen]
    if not device:
        events = _innermost(events)
    return events, sorted({p for p, _ in chosen})


def _innermost(events: list[_Event]) -> list[_Event]:
    """Drop every event that encloses another on its thread (a loop's or a conditional's thunk)."""
    keep = []
    by_line: dict[str, list[_Event]] = {}
    for e in events:
        by_line.setdefault(e.line, []).append(e)
    for line_events in by_line.values():
        line_events.sort(key=lambda e: (e.start_ns, -e.duration_ns))
        for i, e in enumerate(line_events):
            end = e.start_ns + e.duration_ns
            encloses = any(o.start_ns < end and o.start_ns + o.duration_ns <= end
                           for o in line_events[i + 1:i + 64] if o.start_ns >= e.start_ns)
            if not encloses:
                keep.append(e)
    return keep


def kernel_table(profile, module: str, steps: int, step_ms: float, flops: dict[str, int] | None = None,
                 bytes_moved: dict[str, int] | None = None, kinds: dict[str, tuple[str, str]] | None = None
                 ) -> KernelTable:
    """The kernels of the program ``module`` (its HLO module name: a substring of the events' ``hlo_module``)
    over ``steps`` traced steps of ``step_ms`` each. ``flops`` / ``bytes_moved``: per step by HLO instruction
    name (``jaxmamba.hlo_flops`` / ``jaxmamba.hlo_traffic``); ``kinds``: ``(kind, op_name)`` by name."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    events, planes = read_events(profile)
    ours = [e for e in events if module and module in e.module]
    note = ""
    if events and not ours:
        # The module stat is spelled differently by some runtimes: keep every kernel and say so.
        ours, note = events, f"no event names the module {module!r}: every traced kernel is listed"
    table = KernelTable(steps=steps, step_ms=step_ms, planes=planes, note=note)
    if not ours:
        table.events_found = False
        table.note = "the trace has no event with an hlo_op stat" + (f" (planes: {', '.join(planes)})" if planes else "")
        return table
    grouped: dict[str, list[_Event]] = {}
    for e in ours:
        grouped.setdefault(e.op, []).append(e)
    for op, evs in grouped.items():
        kind, op_name = (kinds or {}).get(op, ("", ""))
        time_us = sum(e.duration_ns for e in evs) / 1e3 / steps
        table.rows.append(KernelRow(op, round(len(evs) / steps), time_us,
                                    share=time_us / (1e3 * step_ms) if step_ms > 0 else 0.0,
                                    flops=(flops or {}).get(op), bytes_moved=(bytes_moved or {}).get(op),
                                    kind=kind, op_name=op_name))
    table.rows.sort(key=lambda r: -r.time_us)
    return table
