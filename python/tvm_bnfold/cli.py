"""The ``tvm-bnfold`` command: fold, compile, tune, bench, report, demo.

MODEL is an ONNX file or a built-in model name. User errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import tvm

from . import bench, chips, report, rpc, runtime, tuning
from .errors import BNFoldError
from .fold_bn import FoldBN
from .fuse_epilogue import FuseEpilogue
from .models import BUILTIN, get_model, load_onnx

logger = logging.getLogger("tvm_bnfold")
PROG = "tvm-bnfold"


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Fold inference BatchNorm into conv/dense weights and fuse conv epilogues "
                    "on the register tile, for Apache TVM (Relax).",
        epilog=f"MODEL: an ONNX file or a built-in model ({', '.join(BUILTIN)}). "
               f"Chips: host (this machine, the default), {', '.join(chips.PRESETS)}. "
               f"`{PROG} COMMAND --help` explains each.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log every decision; show tracebacks of internal errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_Parser)
    model_help = f"an ONNX file or a built-in model ({', '.join(BUILTIN)})"
    chip_help = (f"host (this machine: its CPU, ISA and cores; the default) or a preset for "
                 f"cross-compiling ({', '.join(chips.PRESETS)})")

    p = sub.add_parser("fold", help="run FoldBN; print what folded into what, and what not and why",
                       description="Run FoldBN on MODEL and print one line per BatchNorm: the "
                                   "conv/matmul it folded into, or why it stayed.")
    p.add_argument("model", metavar="MODEL", help=model_help)

    p = sub.add_parser("compile", help="FoldBN + FuseEpilogue (+ tuned schedules) -> a .so",
                       description="FoldBN + FuseEpilogue, with the tuned schedules of "
                                   "tuning_logs/<chip>/<model>/ when present, exported with "
                                   "export_library. Run it with tvm_bnfold.load(path) (every "
                                   "core), or relax.VirtualMachine.")
    p.add_argument("model", metavar="MODEL", help=model_help)
    p.add_argument("--chip", default="host", help=chip_help)
    p.add_argument("-o", "--output", required=True, help="the shared library to write (.so)")
    p.add_argument("--fast-math", action="store_true",
                   help="sigmoid/silu/tanh epilogues as polynomials (FuseEpilogue fast_math)")

    p = sub.add_parser("tune", help="tune MODEL's kernels for a chip with MetaSchedule",
                       description="Tune MODEL after FoldBN + FuseEpilogue with MetaSchedule "
                                   "(XGBoost cost model, register check in the search). The "
                                   "database goes to tuning_logs/<chip>/<model>/ (or --work-dir)"
                                   "; compile, bench, report and demo pick it up.")
    p.add_argument("model", metavar="MODEL", help=model_help)
    p.add_argument("--chip", default="host", help=chip_help)
    p.add_argument("--trials", type=int, required=True, help="total trial budget (> 0)")
    p.add_argument("--work-dir", help="database directory (default tuning_logs/<chip>/<model>)")
    p.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on TVM RPC servers")
    p.add_argument("--rpc-key", metavar="KEY", help="device key of the RPC servers")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--stock", action="store_true",
                   help="tune the stock-TVM-fused graph instead (DecomposeOpsForInference + "
                        "FuseOps + FuseTIR), into tuning_logs/<chip>/<model>-stock: the "
                        "baseline make bench compares ours tuned against")

    p = sub.add_parser("bench", help="time every variant of MODEL on a chip that runs here",
                       description="Compile and time MODEL as: unfused, stock TVM, FoldBN only, "
                                   "FoldBN+FuseEpilogue (default schedule), tuned (when "
                                   "tuning_logs/ has it) and ONNX Runtime, side by side; "
                                   "kernels, bytes, registers and errors too.")
    p.add_argument("model", metavar="MODEL", help=model_help)
    p.add_argument("--chip", help=chip_help + "; must run here")
    p.add_argument("--repeat", type=int, default=20, help="timed runs per variant (median)")

    p = sub.add_parser("report", help="comparison report across chips: report.md/.html + plots",
                       description="Write report.md, a self-contained report.html and PNG "
                                   "plots to --out. Chips that cannot run here get static "
                                   "columns only and 'not run: no device' for latency.")
    p.add_argument("--chips", help="comma-separated chips: host (the default) and presets")
    p.add_argument("--models", default=",".join(BUILTIN),
                   help="comma-separated models (ONNX files or built-in names)")
    p.add_argument("--out", required=True, help="output directory, e.g. reports/NAME")
    p.add_argument("--repeat", type=int, default=10, help="timed runs per variant (median)")

    p = sub.add_parser("demo", help="fold, fuse, compare with the unfused model, small report",
                       description="On MODEL: the fold summary, BatchNorm and kernel counts "
                                   "before/after, latency unfused vs ours (tuned when "
                                   "tuning_logs/ has the host chip), max error, and a small "
                                   "report in --out.")
    p.add_argument("--model", default="resnet50", help=model_help)
    p.add_argument("--chip", help="a chip that runs here (default: host, this machine)")
    p.add_argument("--out", default="reports/demo", help="report directory (default %(default)s)")
    p.add_argument("--repeat", type=int, default=10, help="timed runs per variant (median)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    runtime.set_threads()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(message)s"
    )
    commands = {"fold": _fold, "compile": _compile, "tune": _tune, "bench": _bench,
                "report": _report, "demo": _demo}
    try:
        commands[args.command](args)
    except (BNFoldError, OSError) as err:
        print(f"{PROG}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug or a TVM failure: one line unless --verbose
        if args.verbose:
            raise
        print(f"{PROG}: internal error: {type(err).__name__}: {_one_line(err)} "
              "(run with -v for the traceback)", file=sys.stderr)
        return 1
    return 0


def _one_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def _run_chip(name: str | None) -> chips.Chip:
    """A chip that runs here: ``name`` or this machine's."""
    chip = chips.get(name) if name else chips.host_chip()
    if not (chip.runs_here and chip.kind == "cpu"):
        raise BNFoldError(
            f"chip {chip.name} cannot run on this machine; run chips: "
            f"{', '.join(n for n, c in chips.PRESETS.items() if c.runs_here) or 'none'} "
            f"(`{PROG} report --chips {chip.name}` gives its static columns)")
    return chip


def _positive(value: int, what: str) -> int:
    if value <= 0:
        raise BNFoldError(f"{what} must be > 0, got {value}")
    return value


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def _fold_summary(fold: FoldBN) -> str:
    """Counts per action, with the reasons of what did not fold."""
    groups = Counter((r.action, r.reason) for r in fold.report)
    parts = [f"{n} {action}" + (f" ({reason})" if reason else "")
             for (action, reason), n in sorted(groups.items())]
    return f"{len(fold.report)} BatchNorms: " + "; ".join(parts)


def _fold(args) -> None:
    mod = load_onnx(get_model(args.model))
    fold = FoldBN()
    start = time.perf_counter()
    fold(mod)
    seconds = time.perf_counter() - start
    for record in fold.report:
        print(f"  {record}")
    print(f"{args.model}: {_fold_summary(fold)} ({seconds:.2f} s)")


def _fold_fuse(model: str, chip: chips.Chip, fast_math: bool = False) -> tvm.IRModule:
    mod = load_onnx(get_model(model))
    with chip.target:
        return FuseEpilogue(chip, fast_math=fast_math)(FoldBN()(mod))


def _compile(args) -> None:
    chip = chips.get(args.chip)
    output = Path(args.output)
    if not output.parent.is_dir():
        raise BNFoldError(f"output directory does not exist: {output.parent}")
    mod = _fold_fuse(args.model, chip, args.fast_math)
    name = report.model_name(args.model)
    ex = bench.build_tuned(mod, chip, name)
    tuned = ex is not None
    if ex is None:
        ex = tvm.compile(mod, target=chip.target)
    try:
        ex.export_library(str(output), **_cross_compile(chip))
    except BNFoldError:
        raise
    except Exception as err:  # a cross compiler (aarch64) or nvcc (CUDA) may be missing
        raise BNFoldError(f"cannot export the {chip.name} library to {output}: "
                          f"{_one_line(err)}") from err
    schedules = f"tuned schedules from {tuning.find_database(chip, name)}" if tuned else \
        "default schedules (no tuning database)"
    elsewhere = "" if chip.runs_here else f"; {chip.name} code does not run on this machine"
    fast = ", fast math" if args.fast_math else ""
    print(f"wrote {output} ({chip.name}, {bench.kernel_count(mod)} kernels, {schedules}"
          f"{fast}{elsewhere})")


def _cross_compile(chip: chips.Chip) -> dict:
    """export_library options: a cross compiler for a CPU chip with another target triple."""
    triple = chip.target_config.get("mtriple")
    if chip.kind != "cpu" or not triple:
        return {}
    compiler = shutil.which(f"{triple}-g++")
    if compiler is None:
        raise BNFoldError(f"exporting for {chip.name} needs the cross compiler {triple}-g++, "
                          f"which is not installed (Debian: apt-get install g++-{triple})")
    from tvm.support import cc

    return {"fcompile": cc.cross_compiler(compiler)}


def _tune(args) -> None:
    chip = chips.get(args.chip)
    _positive(args.trials, "--trials")
    if bool(args.rpc_tracker) != bool(args.rpc_key):
        raise BNFoldError("--rpc-tracker and --rpc-key go together")
    if args.rpc_tracker:
        rpc.parse_tracker(args.rpc_tracker)
    name = report.model_name(args.model) + ("-stock" if args.stock else "")
    work_dir = tuning.database_dir(chip, args.work_dir, name)
    if args.stock:
        mod = bench.variants(load_onnx(get_model(args.model)), chip, baselines=("stock",))
        mod = mod["stock"].mod
    else:
        mod = _fold_fuse(args.model, chip)
    tuning.tune(mod, chip, str(work_dir), args.trials, quiet=args.quiet,
         rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key)
    print(f"tuning database: {work_dir}")


def _bench(args) -> None:
    chip = _run_chip(args.chip)
    _positive(args.repeat, "--repeat")
    proto = get_model(args.model)
    mod = load_onnx(proto)
    rows, _ = bench.compare(mod, report.model_name(args.model), chip, args.repeat, proto,
                            report.progress)
    peak, fma = bench.sgemm_peak(), bench.fma_peak(chip)
    bench.print_rows(rows)
    print(f"practical peak ({bench.PEAK_LABEL}): {peak:.1f} GFLOP/s")
    print(f"FMA peak of {chip.name} ({bench.FMA_LABEL}): {fma:.1f} GFLOP/s")
    bench.print_peak(rows, bench.model_flops(mod) / 1e9, peak, fma)


def _report(args) -> None:
    _positive(args.repeat, "--repeat")
    chip_names = [c for c in (args.chips or chips.host_chip().name).split(",") if c]
    models = [m for m in args.models.split(",") if m]
    if not chip_names or not models:
        raise BNFoldError("--chips and --models need at least one name each")
    for name in chip_names:
        chips.get(name)  # unknown chip: error before any work
    for model in models:
        get_model(model)
    report.run(chip_names, models, args.out, args.repeat)


def _demo(args) -> None:
    chip = _run_chip(args.chip)
    _positive(args.repeat, "--repeat")
    proto = get_model(args.model)
    mod = load_onnx(proto)
    name = report.model_name(args.model)
    fold = FoldBN()
    folded = fold(mod)
    print(f"{name}: {_fold_summary(fold)}")
    before, after = bench.op_counts(mod), bench.op_counts(folded)
    print(f"BatchNorms: {before['nn.batch_norm']} -> {after['nn.batch_norm']}")

    tuned = tuning.find_database(chip, name)
    print(f"\nCompiling and timing on {chip.name} ("
          + (f"tuned schedules from {tuned}" if tuned else "default schedules") + ") ...")
    results = report.collect([chip.name], [args.model], args.repeat, baselines=("unfused",))
    rows = {r["variant"]: r for r in results[0].rows}
    # The headline is the faster of the default and the tuned build (both are in the table).
    ours = min((rows[v] for v in ("ours", "tuned") if v in rows), key=lambda r: r["median_ms"])
    print(f"kernels: {rows['unfused']['kernels']} -> {ours['kernels']} (of which "
          f"{ours['layout_kernels']} layout transforms); intermediate MB: "
          f"{rows['unfused']['intermediate_mb']:.3g} -> {ours['intermediate_mb']:.3g}")
    print(f"latency (median of {args.repeat}): unfused {rows['unfused']['median_ms']:.3g} ms, "
          f"ours ({bench.VARIANTS[ours['variant']]}) {ours['median_ms']:.3g} ms: "
          f"{ours['speedup_vs_unfused']:.2f}x")
    print(f"max abs error vs unfused: {ours['max_abs_err']:.2e}\n")
    bench.print_rows(results[0].rows)
    paths = report.write(results, args.out, title=f"tvm-bnfold demo: {name} on {chip.name}")
    print(f"\nreport: {paths['md']} and {paths['html']}")


if __name__ == "__main__":
    sys.exit(main())
