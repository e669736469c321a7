"""Measurements: op counts of a module and the `make bench` entry point.

``python -m tvm_bnfold.bench`` (``make bench``) times FoldBN on the built-in models (median of
repeated runs in one process) and checks the folded models against the unfolded ones compiled
by TVM.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import numpy as np
import tvm
from tvm import relax

from .fold_bn import FoldBN
from .models import BUILTIN, load_onnx, random_inputs


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(BUILTIN))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-numerics", action="store_true",
                        help="skip compiling both graphs with TVM to compare outputs")
    args = parser.parse_args(argv)
    print(f"{'model':<12} {'BN before':>9} {'BN after':>8} {'convs':>11} "
          f"{'FoldBN median':>13} {'max rel err':>11}")
    for name in args.models.split(","):
        mod = load_onnx(BUILTIN[name]())
        seconds, folded, _ = time_fold(mod, args.repeat)
        before, after = op_counts(mod), op_counts(folded)
        err = "-"
        if not args.no_numerics:
            inputs = list(random_inputs(mod).values())
            ref, out = run_once(mod, inputs), run_once(folded, inputs)
            err = f"{np.abs(out - ref).max() / np.abs(ref).max():.2e}"
        print(f"{name:<12} {before['nn.batch_norm']:>9} {after['nn.batch_norm']:>8} "
              f"{conv_count(before):>5}->{conv_count(after):<5} {seconds:>12.3f}s {err:>11}")


if __name__ == "__main__":
    main()
