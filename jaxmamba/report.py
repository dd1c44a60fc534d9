"""Cross-framework comparison report: per-layer |Δ| plots and a markdown (or HTML) summary.

``write_compare_report(results, out_dir)`` takes the ``CompareResult`` objects of
``jaxmamba.compare.compare_with_transformers`` (any mix of checkpoints, families
and dtypes) and writes into ``out_dir``:

* ``delta_<NN>_<family>_<dtype>.png`` -- one plot per result: max |Δ| at every
  residual-stream position (embedding, each layer, final norm), log scale;
* ``summary.png`` -- relative logit |Δ| of every result against its tolerance;
* ``report.md`` (or ``report.html``) -- a summary table (one line per result,
  OK / MISMATCH), then per result the table of every position and its plot.

``python -m jaxmamba compare --report PATH`` calls it. Needs matplotlib (the
``notebooks`` extra).
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path
from typing import Sequence

import jaxmamba
from jaxmamba.compare import CompareResult

#: Per-layer plot colours by layer kind (anything else is grey).
KIND_COLORS = {
    "embedding": "#7f7f7f",
    "mamba": "#1f77b4",
    "attention": "#d62728",
    "hybrid": "#9467bd",
    "mlp": "#2ca02c",
    "moe": "#8c564b",
    "norm": "#ff7f0e",
}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_") or "x"


def _plot_name(index: int, r: CompareResult) -> str:
    return f"delta_{index:02d}_{_slug(r.family)}_{_slug(r.dtype)}.png"


def _status(r: CompareResult) -> str:
    return "OK" if r.ok else "MISMATCH"


def _last_layer_note(r: CompareResult) -> str:
    """transformers' ``hidden_states`` of most families skip the last layer's raw output (it is
    reported after the final norm): say so, so a missing "layer N-1" row is not read as a gap."""
    layers = [name for name, _, _ in r.rows if name.startswith("layer ")]
    if r.rows and r.rows[0][0] == "embed" and layers and r.rows[-1][0] == "final_norm":
        last = int(layers[-1].split()[1]) + 1
        return (f"transformers reports layer {last}'s output only after the final norm: "
                f"`final_norm` covers layer {last}.")
    return ""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_layer_deltas(r: CompareResult, path: Path | None, ax=None) -> Path | None:
    """Bar plot (log scale) of ``r.rows``' max |Δ| per position, coloured by layer kind.

    With ``ax`` (a matplotlib Axes) it draws there and saves nothing (``path`` may be None);
    otherwise it makes its own figure and saves it to ``path``.
    """
    plt = _pyplot()
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(r.rows) + 2.0), 3.2))
    names = [name for name, _, _ in r.rows]
    # A |Δ| of exactly 0 (e.g. the embedding lookup) cannot sit on a log axis: it is drawn as a
    # stub at the axis floor, a decade under the smallest non-zero |Δ|, and labelled "0".
    nonzero = [d for _, _, d in r.rows if d > 0]
    floor = (min(nonzero) if nonzero else 1e-8) / 10
    values = [max(delta, floor * 1.5) for _, _, delta in r.rows]
    colors = [KIND_COLORS.get(kind, "#bbbbbb") for _, kind, _ in r.rows]
    ax.bar(range(len(names)), values, color=colors)
    ax.set_yscale("log")
    ax.set_ylim(floor, max(values) * 8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{n}\n({k})" for n, k, _ in r.rows], fontsize=7)
    ax.set_ylabel("max |Δ| vs transformers")
    ax.set_title(f"{r.family} {r.dtype}: logits rel |Δ| {r.logits_rel:.1e} ({_status(r)})", fontsize=9)
    for i, ((_, _, delta), v) in enumerate(zip(r.rows, values, strict=True)):
        ax.text(i, v * 1.2, f"{delta:.1e}" if delta > 0 else "0", ha="center", va="bottom", fontsize=6)
    if not own:
        return None
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_summary(results: Sequence[CompareResult], path: Path) -> Path:
    """Relative logit |Δ| of every result (bars) against its tolerance (black ticks)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(results) + 2.0), 3.2))
    labels = [f"{r.family}\n{r.dtype}" for r in results]
    rel = [max(r.logits_rel, 1e-12) for r in results]
    ax.bar(range(len(results)), rel, color=["#2ca02c" if r.ok else "#d62728" for r in results])
    ax.scatter(range(len(results)), [r.tolerance for r in results], marker="_", s=600, color="black",
               label="tolerance", zorder=3)
    ax.set_yscale("log")
    top = max(rel + [r.tolerance for r in results])
    ax.set_ylim(min(rel + [r.tolerance for r in results]) / 10, top * 10)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("logits max |Δ| / max |logit|")
    ax.set_title("jaxmamba vs transformers: final logits (green OK, red MISMATCH)", fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _markdown(results: Sequence[CompareResult], plots: list[str]) -> str:
    lines = [
        "# jaxmamba vs transformers",
        "",
        "Same checkpoint, same token ids, run through transformers (torch, CPU) and jaxmamba. "
        "Each position is a point of the residual stream (transformers' `hidden_states`); "
        "|Δ| is the max absolute difference over the batch. A result is OK when the logits' "
        "max |Δ| relative to the largest |logit| is within its tolerance.",
        "",
        "![summary](summary.png)",
        "",
        "| # | family | dtype | input (batch x tokens) | logits max abs Δ | relative | tolerance "
        "| argmax agreement | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results):
        lines.append(
            f"| {i} | {r.family} | {r.dtype} | {r.input_shape[0]} x {r.input_shape[1]} | {r.logits_max_abs:.3e} "
            f"| {r.logits_rel:.3e} | {r.tolerance:.0e} | {100 * r.argmax_agreement:.2f}% | {_status(r)} |"
        )
    for i, (r, plot) in enumerate(zip(results, plots, strict=True)):
        lines += [
            "",
            f"## {i}. {r.family}, {r.dtype} ({_status(r)})",
            "",
            f"checkpoint: `{r.checkpoint}`",
            "",
            f"![{r.family} {r.dtype} per-layer |Δ|]({plot})",
            "",
            "| position | kind | max abs Δ |",
            "|---|---|---|",
        ]
        lines += [f"| {name} | {kind} | {delta:.3e} |" for name, kind, delta in r.rows]
        note = _last_layer_note(r)
        lines += [
            "",
            *([note, ""] if note else []),
            f"logits: max |Δ| = {r.logits_max_abs:.3e}, scale = {r.logits_scale:.3f}, relative = "
            f"{r.logits_rel:.3e} (tolerance {r.tolerance:.0e}); greedy argmax agreement "
            f"{100 * r.argmax_agreement:.2f}%",
        ]
    return "\n".join(lines) + "\n"


def _html(results: Sequence[CompareResult], plots: list[str]) -> str:
    e = html.escape
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>jaxmamba vs transformers</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}td,th{padding:2px 8px;text-align:right}"
        ".MISMATCH{color:#b00}.OK{color:#070}</style></head><body>",
        "<h1>jaxmamba vs transformers</h1>",
        "<p>Same checkpoint, same token ids, run through transformers (torch, CPU) and jaxmamba; |Δ| is the max "
        "absolute difference at each residual-stream position. A result is OK when the logits' relative |Δ| is "
        "within its tolerance.</p>",
        "<img src='summary.png' alt='summary'>",
        "<table><tr><th>#</th><th>family</th><th>dtype</th><th>input</th><th>logits max |Δ|</th><th>relative</th>"
        "<th>tolerance</th><th>argmax agreement</th><th>status</th></tr>",
    ]
    for i, r in enumerate(results):
        s = _status(r)
        out.append(
            f"<tr><td>{i}</td><td>{e(r.family)}</td><td>{e(r.dtype)}</td><td>{r.input_shape[0]} x {r.input_shape[1]}"
            f"</td><td>{r.logits_max_abs:.3e}</td><td>{r.logits_rel:.3e}</td><td>{r.tolerance:.0e}</td>"
            f"<td>{100 * r.argmax_agreement:.2f}%</td><td class='{s}'>{s}</td></tr>"
        )
    out.append("</table>")
    for i, (r, plot) in enumerate(zip(results, plots, strict=True)):
        s = _status(r)
        out += [
            f"<h2>{i}. {e(r.family)}, {e(r.dtype)} (<span class='{s}'>{s}</span>)</h2>",
            f"<p>checkpoint: <code>{e(r.checkpoint)}</code></p>",
            f"<img src='{e(plot)}' alt='{e(r.family)} {e(r.dtype)} per-layer |Δ|'>",
            "<table><tr><th>position</th><th>kind</th><th>max |Δ|</th></tr>",
        ]
        out += [f"<tr><td>{e(n)}</td><td>{e(k)}</td><td>{d:.3e}</td></tr>" for n, k, d in r.rows]
        note = _last_layer_note(r)
        out += [
            "</table>",
            *([f"<p>{e(note)}</p>"] if note else []),
            f"<p>logits: max |Δ| = {r.logits_max_abs:.3e}, relative = {r.logits_rel:.3e} (tolerance "
            f"{r.tolerance:.0e}); greedy argmax agreement {100 * r.argmax_agreement:.2f}%</p>",
        ]
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_compare_report(results: list[CompareResult], out_dir, *, filename: str = "report.md") -> Path:
    """Write the plots and the report for ``results`` into ``out_dir``; return the report's path.

    ``filename`` ending in ``.html`` writes HTML instead of markdown. Images are
    referenced by relative names, so the directory can be moved as a whole.
    """
    results = list(results)
    if not results:
        raise ValueError("write_compare_report needs at least one CompareResult")
    for r in results:
        if not isinstance(r, CompareResult):
            raise TypeError(f"expected CompareResult, got {type(r).__name__}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for i, r in enumerate(results):
        name = _plot_name(i, r)
        plot_layer_deltas(r, out / name)
        plots.append(name)
    plot_summary(results, out / "summary.png")
    path = out / filename
    text = _html(results, plots) if filename.endswith((".html", ".htm")) else _markdown(results, plots)
    path.write_text(text, encoding="utf-8")
    return path


def notebook_out() -> Path:
    """Where the notebooks save their figures: ``$JAXMAMBA_NOTEBOOK_OUT``, else the checkout's ``notebooks/_out``."""
    env = os.environ.get("JAXMAMBA_NOTEBOOK_OUT")
    root = Path(jaxmamba.__file__).resolve().parents[1]
    # Without the variable: the repository's notebooks/_out when run from a checkout, else ./notebooks/_out.
    default = root / "notebooks" / "_out" if (root / "notebooks").is_dir() else Path("notebooks/_out")
    out = Path(env) if env else default
    out.mkdir(parents=True, exist_ok=True)
    return out
