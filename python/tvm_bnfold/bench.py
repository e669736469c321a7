"""Measurements: op and kernel counts, intermediate bytes, latency, and `make bench`.

``python -m tvm_bnfold.bench`` (``make bench``) times FoldBN on the built-in models and checks
the folded models against the unfolded ones compiled by TVM; then it runs the unfused, stock-TVM
and FoldBN+FuseEpilogue variants side by side per chip (medians from one process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter

import numpy as np
import tvm
from tvm import relax

from . import chips
from .fold_bn import FoldBN
from .fuse_epilogue import FuseEpilogue, fuse_graph, schedule_kernels
from .models import BUILTIN, load_onnx, random_inputs


def use_all_cores() -> None:
    """TVM's runtime uses half the hardware threads on x86 (1 of 2 here) unless told otherwise."""
    os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))


def op_counts(mod: tvm.IRModule) -> Counter:
    """How many calls of each Relax op (``relax.`` prefix dropped) the Relax functions contain."""
    counts: Counter = Counter()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            counts[expr.op.name.removeprefix("relax.")] += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return counts


def conv_count(counts: Counter) -> int:
    return sum(n for op, n in counts.items() if op.startswith("nn.conv"))


def kernel_count(mod: tvm.IRModule) -> int:
    """Kernels ``main`` launches: its ``call_tir`` calls (after legalization)."""
    return op_counts(relax.transform.LegalizeOps()(mod))["call_tir"]


def intermediate_bytes(mod: tvm.IRModule) -> int:
    """Bytes of tensors written by one kernel and read by others: write + each read.

    ``mod`` must be legalized (every op a ``call_tir``)."""
    produced: dict = {}  # var -> bytes, for kernel outputs
    reads: Counter = Counter()
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.TupleGetItem) and value.tuple_value in produced:
                produced[binding.var] = _nbytes(binding.var)
            if not (isinstance(value, relax.Call) and value.op == _CALL_TIR):
                continue
            if isinstance(binding.var.ty, relax.TensorType):
                produced[binding.var] = _nbytes(binding.var)
            else:
                produced[binding.var] = 0  # a tuple: its fields are counted via TupleGetItem
            for arg in value.args[1].fields:
                if arg in produced:
                    reads[arg] += 1
    return sum(produced[v] * (1 + n) for v, n in reads.items())


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _nbytes(var: relax.Var) -> int:
    ty = var.ty
    return int(np.prod([int(d) for d in ty.shape.values])) * tvm.DataType(ty.dtype).bits // 8


def latency(mod: tvm.IRModule, inputs: list[np.ndarray], target, repeat: int = 10):
    """Build ``mod`` once and time ``main``: (median s, p90 s, the output) over ``repeat`` runs."""
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    args = [tvm.runtime.tensor(x) for x in inputs]
    out = vm["main"](*args).numpy()  # warm-up run, also the output
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        vm["main"](*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), float(np.percentile(times, 90)), out


def run_once(mod: tvm.IRModule, inputs: list[np.ndarray], target="llvm") -> np.ndarray:
    """Compile ``mod`` with TVM and run ``main`` once on ``inputs``."""
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()


def time_fold(mod: tvm.IRModule, repeat: int = 5) -> tuple[float, tvm.IRModule, FoldBN]:
    """Median wall time of FoldBN on ``mod`` over ``repeat`` runs; also the last result."""
    times = []
    for _ in range(repeat):
        fold = FoldBN()
        start = time.perf_counter()
        folded = fold(mod)
        times.append(time.perf_counter() - start)
    return statistics.median(times), folded, fold


# Relax passes of the stock TVM baseline: BatchNorm decomposed into multiply/add, then fused.
STOCK_TVM = (
    relax.transform.DecomposeOpsForInference(),
    relax.transform.CanonicalizeBindings(),
    relax.transform.DeadCodeElimination(),
)


def variants(mod: tvm.IRModule, chip: chips.Chip) -> dict[str, tvm.IRModule]:
    """The same model three ways, all with our default schedules on their conv/matmul kernels:
    ``unfused`` (each op its own kernel), ``stock`` (TVM's BatchNorm decomposition + fusion)
    and ``ours`` (FoldBN + FuseEpilogue)."""
    with chip.target:
        legalized = tvm.transform.Sequential(
            [relax.transform.LegalizeOps(), relax.transform.FoldConstant()])(mod)
        unfused, _ = schedule_kernels(legalized, chip)
        stock, _ = schedule_kernels(fuse_graph(tvm.transform.Sequential(STOCK_TVM)(mod)), chip)
        ours = FuseEpilogue(chip)(FoldBN()(mod))
    return {"unfused": unfused, "stock": stock, "ours": ours}


def compare(mod: tvm.IRModule, name: str, chip: chips.Chip, repeat: int) -> list[dict]:
    """Latency (median, p90), kernels, intermediate MB and error of each variant, side by side."""
    inputs = list(random_inputs(mod).values())
    rows, ref = [], None
    for variant, vmod in variants(mod, chip).items():
        median, p90, out = latency(vmod, inputs, chip.target, repeat)
        ref = out if ref is None else ref
        rows.append(dict(model=name, chip=chip.name, variant=variant, median_ms=median * 1e3,
                         p90_ms=p90 * 1e3, kernels=kernel_count(vmod),
                         intermediate_mb=intermediate_bytes(relax.transform.LegalizeOps()(vmod))
                         / 1e6, max_abs_err=float(np.abs(out - ref).max())))
    for row in rows:
        row["speedup_vs_unfused"] = rows[0]["median_ms"] / row["median_ms"]
        row["speedup_vs_stock"] = rows[1]["median_ms"] / row["median_ms"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(BUILTIN))
    parser.add_argument("--chips", default=",".join(
        n for n in ("avx512", "avx2") if chips.PRESETS[n].runs_here), help="chips that run here")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    use_all_cores()

    print("## FoldBN")
    print(f"{'model':<12} {'BN before':>9} {'BN after':>8} {'convs':>11} "
          f"{'FoldBN median':>13} {'max rel err':>11}")
    for name in models:
        mod = load_onnx(BUILTIN[name]())
        seconds, folded, _ = time_fold(mod, 5)
        before, after = op_counts(mod), op_counts(folded)
        inputs = list(random_inputs(mod).values())
        ref, out = run_once(mod, inputs), run_once(folded, inputs)
        err = np.abs(out - ref).max() / np.abs(ref).max()
        print(f"{name:<12} {before['nn.batch_norm']:>9} {after['nn.batch_norm']:>8} "
              f"{conv_count(before):>5}->{conv_count(after):<5} {seconds:>12.3f}s {err:>11.2e}")

    print("\n## FuseEpilogue (default schedules, batch 1, fp32; median of "
          f"{args.repeat} runs, one process)")
    for name in models:
        for chip_name in args.chips.split(","):
            mod = load_onnx(BUILTIN[name]())
            print_rows(compare(mod, name, chips.get(chip_name), args.repeat))


def print_rows(rows: list[dict]) -> None:
    """The variants table of :func:`compare`."""
    print(f"{'model':<12} {'chip':<7} {'variant':<8} {'median ms':>9} {'p90 ms':>7} "
          f"{'kernels':>7} {'interm. MB':>10} {'vs unfused':>10} {'vs stock':>8} {'max err':>8}")
    for r in rows:
        print(f"{r['model']:<12} {r['chip']:<7} {r['variant']:<8} {r['median_ms']:>9.1f} "
              f"{r['p90_ms']:>7.1f} {r['kernels']:>7} {r['intermediate_mb']:>10.1f} "
              f"{r['speedup_vs_unfused']:>9.2f}x {r['speedup_vs_stock']:>7.2f}x "
              f"{r['max_abs_err']:>8.1e}")


if __name__ == "__main__":
    main()
