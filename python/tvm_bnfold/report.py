"""Comparison reports across chips: ``report.md``, a self-contained ``report.html`` and PNG plots.

    results = collect(["avx2", "aarch64"], ["resnet50"], repeat=10)
    write(results, "reports/NAME")

Every variant of :data:`bench.VARIANTS` per chip and model. Chips that cannot run here get only
their static columns (kernel count, bytes, registers and spills from the LLVM asm or ``ptxas``)
and "not run: no device" for latency: no number is invented.
"""

from __future__ import annotations

import base64
import datetime
import html
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import bench, chips, runtime
from .errors import BNFoldError
from .fuse_epilogue import FusionRecord
from .models import get_model, load_onnx
from .register_pressure import ToolMissing


@dataclass
class Result:
    """One chip and model: the variant rows of :func:`bench.compare` and the records of the
    FoldBN+FuseEpilogue kernels."""

    chip: chips.Chip
    model: str
    rows: list[dict]
    records: list[FusionRecord]
    gflop: float
    note: str = ""  # e.g. why registers/spills are missing


def progress(message: str) -> None:
    """A progress line on stderr."""
    print(f"[tvm-bnfold] {message}", file=sys.stderr, flush=True)


def model_name(model: str) -> str:
    """A built-in name as is, an ONNX path by its file stem."""
    return Path(model).stem if model.endswith(".onnx") else model


def collect(
    chip_names: Sequence[str],
    models: Sequence[str],
    repeat: int = 10,
    say: Callable[[str], None] = progress,
    baselines: tuple[str, ...] = ("unfused", "stock", "foldbn", "nchw"),
) -> list[Result]:
    """Measure every variant per chip and model (see the module docstring); ``baselines``
    as in :func:`bench.compare`."""
    selected = [chips.get(c) for c in chip_names]  # unknown chips fail before any work
    results = []
    for model in models:
        proto = get_model(model)
        mod = load_onnx(proto)
        name = model_name(model)
        for chip in selected:
            note = ""
            try:
                rows, found = bench.compare(mod, name, chip, repeat, proto, say,
                                            baselines=baselines)
            except ToolMissing as err:  # ptxas/nvcc absent: static estimate only
                note = f"registers/spills not measured: {err}"
                say(f"{chip.name}/{name}: {note}")
                rows, found = bench.compare(mod, name, chip, repeat, proto, say,
                                            measure=False, baselines=baselines)
            results.append(Result(chip, name, rows, found["ours"].records or [],
                                  bench.model_flops(mod) / 1e9, note))
    return results


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(results: list[Result], model: str, path: Path) -> None:
    """Latency bars (median, p90 as the whisker) per variant, grouped by chip."""
    plt = _pyplot()
    mine = [r for r in results if r.model == model]
    names = [v for v in bench.VARIANTS if any(row["variant"] == v for r in mine for row in r.rows)]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(mine)), 4.2))
    width = 0.8 / max(len(names), 1)
    for i, variant in enumerate(names):
        xs, ys, errs = [], [], []
        for x, r in enumerate(mine):
            row = next((row for row in r.rows if row["variant"] == variant), None)
            if row and row.get("median_ms") is not None:
                xs.append(x + (i - (len(names) - 1) / 2) * width)
                ys.append(row["median_ms"])
                errs.append(row["p90_ms"] - row["median_ms"])
        ax.bar(xs, ys, width, yerr=[np.zeros(len(errs)), errs], capsize=2,
               label=bench.VARIANTS[variant])
    for x, r in enumerate(mine):
        if all(row.get("median_ms") is None for row in r.rows):
            ax.text(x, 0.5, bench.NOT_RUN, transform=ax.get_xaxis_transform(), ha="center",
                    va="center", rotation=90, color="gray")
    ax.set_xticks(range(len(mine)), [r.chip.name for r in mine])
    ax.set_xlim(-0.6, len(mine) - 0.4)
    ax.set_ylabel("latency per image, ms (median; whisker: p90)")
    ax.set_title(f"{model}: latency per variant and chip")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, path)


def plot_kernels(results: list[Result], path: Path) -> None:
    """Kernel count before (unfused) and after (FoldBN+FuseEpilogue) per model and chip."""
    plt = _pyplot()
    labels = [f"{r.model}\n{r.chip.name}" for r in results]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(results)), 4))
    xs = np.arange(len(results))
    for offset, variant, label in ((-0.2, "unfused", "before (unfused)"),
                                   (0.2, "ours", "after (FoldBN+FuseEpilogue)")):
        counts = [_row(r, variant)["kernels"] for r in results]
        bars = ax.bar(xs + offset, counts, 0.4, label=label)
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("kernels launched")
    ax.set_ylim(0, max(_row(r, "unfused")["kernels"] for r in results) * 1.3)
    ax.set_title("Kernel count before / after")
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    _save(fig, path)


_DECISION_COLORS = {"register": "tab:blue", "cache": "tab:orange", "separate": "tab:gray",
                    "database": "tab:green"}


@dataclass
class RegisterBar:
    """One bar of the registers plot: a kernel's registers and the budget its own register check
    used (:attr:`FusionRecord.budget`: a blocked conv tile against the whole vector register file,
    any other CPU tile against it less ``register_pressure.CPU_RESERVE``, CUDA the per-thread
    cap)."""

    kernel: str
    registers: int
    budget: int | None
    decision: str
    spills: int


def register_bars(records: Sequence[FusionRecord]) -> list[RegisterBar]:
    """The bars of :func:`plot_registers`: every kernel with a register count (a database
    schedule has none), with the budget its check recorded."""
    return [RegisterBar(rec.kernel, rec.registers, rec.budget, rec.decision,
                        rec.spill_bytes or rec.spill_moves or 0)
            for rec in records if rec.registers is not None]


def plot_registers(results: list[Result], model: str, path: Path) -> dict[str, list[RegisterBar]]:
    """Registers of every FoldBN+FuseEpilogue kernel against its budget, per chip; returns the
    bars drawn, by chip. CPU: the static estimate of live vector registers; CUDA: registers per
    thread (ptxas). Bar colour: where the epilogue went; red edge: the kernel spills; a dash over
    each bar: the budget its register check used (one chip's kernels may differ)."""
    plt = _pyplot()
    mine = [r for r in results if r.model == model]
    fig, axes = plt.subplots(len(mine), 1, figsize=(11, 1.0 + 3.2 * len(mine)), squeeze=False)
    drawn: dict[str, list[RegisterBar]] = {}
    for ax, r in zip(axes[:, 0], mine, strict=True):
        bars = drawn[r.chip.name] = register_bars(r.records)
        xs = np.arange(len(bars))
        ax.bar(xs, [b.registers for b in bars],
               color=[_DECISION_COLORS.get(b.decision, "tab:purple") for b in bars],
               edgecolor=["red" if b.spills else "none" for b in bars], linewidth=2)
        budgeted = [(x, b.budget) for x, b in zip(xs, bars, strict=True) if b.budget]
        if budgeted:
            bx, by = (np.array(v) for v in zip(*budgeted, strict=True))
            ax.hlines(by, bx - 0.45, bx + 0.45, colors="black", linestyles="--", linewidth=1,
                      label="budget")
            for value in sorted(set(by.tolist())):  # each budget labelled once, at its last bar
                ax.text(int(bx[by == value].max()) + 0.45, value, f"budget {value}", ha="right",
                        va="bottom", fontsize=7)
        kind = "registers / thread\n(ptxas)" if r.chip.kind == "cuda" else "live vector\nregisters"
        ax.set_ylabel(kind, fontsize=8)
        spilled = sum(1 for b in bars if b.spills)
        ax.set_title(f"{model} on {r.chip.name}: {len(bars)} kernels, {spilled} spilling"
                     + (f" ({r.note})" if r.note else ""), fontsize=9)
        ax.set_xticks(xs, [b.kernel for b in bars], rotation=90, fontsize=6)
        top = max([b.budget or 0 for b in bars] + [b.registers for b in bars], default=0)
        if top:
            ax.set_ylim(0, top * 1.15)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _DECISION_COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="red", linewidth=2))
    handles.append(plt.Line2D([0], [0], color="black", linestyle="--", linewidth=1))
    fig.legend(handles, [f"epilogue: {d}" for d in _DECISION_COLORS]
               + ["spills", "budget of the kernel's check"],
               loc="upper center", ncol=6, fontsize=8, bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    _save(fig, path)
    return drawn


def _row(result: Result, variant: str) -> dict:
    return next(row for row in result.rows if row["variant"] == variant)


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=90, bbox_inches="tight")
    _pyplot().close(fig)


# --------------------------------------------------------------------------------------------
# report.md and report.html
# --------------------------------------------------------------------------------------------

HEADER = ["chip", "variant", *(h for _, h, _ in bench.COLUMNS)]


def _table(results: list[Result], model: str) -> list[list[str]]:
    lines = []
    for r in results:
        if r.model != model:
            continue
        for row in r.rows:
            cells = [r.chip.name, bench.VARIANTS[row["variant"]]]
            for key, _, fmt in bench.COLUMNS:
                text = bench.cell(row, key, fmt)
                if key == "max_registers" and row["variant"] == "ours" and r.note:
                    text = r.note
                cells.append(text)
            lines.append(cells)
    return lines


def _notes(results: list[Result], peak: float | None, fma: dict[str, float]) -> list[str]:
    notes = [
        "Latency: median and p90 per image, batch 1, fp32, "
        f"{runtime.current_threads()} TVM threads, all variants of a chip timed "
        "side by side in one process. Speedups are over the unfused and stock-TVM rows.",
        "Variants: unfused = every op its own kernel; stock = TVM's DecomposeOpsForInference + "
        "FuseOps + FuseTIR; both, and FoldBN only, get our default NCHW conv/matmul schedule; "
        "FoldBN+FuseEpilogue puts CPU convs in the blocked channel layout (the NCHW row is the "
        "same without it). Tuned rows use tuning_logs/<chip>/<model>[-stock]/. ONNX Runtime "
        "runs with all graph optimizations and one intra-op thread per core.",
        "max regs / max spills: the largest over the conv/matmul kernels (CPU: static estimate of "
        "live vector registers and vector spill moves counted in the LLVM asm; CUDA: registers "
        "per thread and spill bytes from ptxas -v). rejected: kernels whose epilogue the "
        "register check kept off the register tile; in brackets, the candidate tiles and levels "
        "it refused on the way (their numbers are in FuseEpilogue().report).",
    ]
    not_run = sorted({r.chip.name for r in results if not r.chip.runs_here})
    if not_run:
        notes.append(f"{', '.join(not_run)}: cannot run on this machine ({_cpu()}), so only "
                     f"static columns; latency says \"{bench.NOT_RUN}\". There nothing is "
                     "tuned or measured: the register check's static estimate (and the spill "
                     "count of the cross-compiled asm, or ptxas for CUDA) and the default "
                     "schedule decide every kernel.")
    if peak:
        for r in results:
            for row in r.rows:
                if row["variant"] in ("ours", "tuned", "onnxruntime") and row.get("median_ms"):
                    gflops = r.gflop / (row["median_ms"] / 1e3)
                    of_fma = (f", {gflops / fma[r.chip.name]:.0%} of the {r.chip.name} FMA peak"
                              if r.chip.name in fma else "")
                    notes.append(f"{r.model} on {r.chip.name}, {bench.VARIANTS[row['variant']]}: "
                                 f"{gflops:.1f} GFLOP/s = {gflops / peak:.0%} of the sgemm peak"
                                 f"{of_fma}.")
    return notes


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.partition(':')[2].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write(
    results: list[Result], out: str | os.PathLike, peak: float | None = None,
    fma: dict[str, float] | None = None,
    title: str = "tvm-bnfold comparison report",
) -> dict[str, Path]:
    """Write report.md, report.html (plots embedded as data URIs) and the PNGs into ``out``."""
    if not results:
        raise BNFoldError("nothing to report: no chip/model results")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    models = list(dict.fromkeys(r.model for r in results))
    plots: list[tuple[str, Path]] = [("Kernel count before / after", out / "kernels.png")]
    plot_kernels(results, plots[0][1])
    for model in models:
        plots.append((f"{model}: latency per variant and chip", out / f"latency_{model}.png"))
        plot_latency(results, model, plots[-1][1])
        plots.append((f"{model}: registers vs budget per fused kernel",
                      out / f"registers_{model}.png"))
        plot_registers(results, model, plots[-1][1])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    machine = f"{_cpu()}; generated {stamp}; load average {load} (1, 5, 15 min)"
    if peak:
        machine += f"; practical peak ({bench.PEAK_LABEL}): {peak:.1f} GFLOP/s"
    fma = fma or {}
    if fma:
        machine += f"; {bench.fma_summary(fma)}"
    notes = _notes(results, peak, fma)
    tables = {m: _table(results, m) for m in models}

    md = [f"# {title}", "", machine, ""]
    for model, lines in tables.items():
        md += [f"## {model}", "", "| " + " | ".join(HEADER) + " |",
               "|" + "---|" * len(HEADER)]
        md += ["| " + " | ".join(cells) + " |" for cells in lines]
        md.append("")
    md += ["## Plots", ""] + [f"![{t}]({p.name})" for t, p in plots] + ["", "## Notes", ""]
    md += [f"- {n}" for n in notes]
    (out / "report.md").write_text("\n".join(md) + "\n")

    esc = html.escape
    body = [f"<h1>{esc(title)}</h1>", f"<p>{esc(machine)}</p>"]
    for model, lines in tables.items():
        body.append(f"<h2>{esc(model)}</h2><table><tr>"
                    + "".join(f"<th>{esc(h)}</th>" for h in HEADER) + "</tr>")
        body += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>"
                 for cells in lines]
        body.append("</table>")
    body.append("<h2>Plots</h2>")
    for caption, path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        body.append(f'<figure><img alt="{esc(caption)}" src="data:image/png;base64,{data}">'
                    f"<figcaption>{esc(caption)}</figcaption></figure>")
    body.append("<h2>Notes</h2><ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    style = ("body{font-family:sans-serif;margin:2em;max-width:1400px}"
             "table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #bbb;padding:2px 6px;text-align:right}"
             "td:nth-child(-n+2){text-align:left}img{max-width:100%}")
    (out / "report.html").write_text(
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")
    return {"md": out / "report.md", "html": out / "report.html",
            **{p.stem: p for _, p in plots}}


def run(chip_names: Sequence[str], models: Sequence[str], out: str | os.PathLike,
        repeat: int = 10, say: Callable[[str], None] = progress) -> dict[str, Path]:
    """:func:`collect` then :func:`write`; the sgemm peak and the FMA peak of each chip are
    measured when a chip runs here."""
    results = collect(chip_names, models, repeat, say)
    peak, fma = None, {}
    if any(r.chip.runs_here for r in results):
        say("measuring the practical peak (2048^3 sgemm) and the FMA peaks")
        peak = bench.sgemm_peak()
        fma = {name: bench.fma_peak(name) for name in chip_names if chips.get(name).runs_here}
    paths = write(results, out, peak, fma)
    say(f"wrote {paths['md']} and {paths['html']}")
    return paths
