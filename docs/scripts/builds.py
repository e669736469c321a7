"""Compare commits side by side: build the default pipeline of models at one commit into a
directory of ``.so`` files, then time several such directories against ONNX Runtime in one
process (docs/benchmarks.md, 2026-12-07).

    python docs/scripts/builds.py export MODELS DIR      # e.g. resnet50,vgg19 /tmp/before
    python docs/scripts/builds.py time MODELS DIR1,DIR2 ROUNDS

``export`` prints FuseEpilogue's pass time per model (set TVM_BNFOLD_CACHE to an empty
directory for a cold one); ``time`` prints medians of interleaved rounds, each directory's
speed-up over the first, ONNX Runtime / each, and each output's max relative error against the
first directory's.
"""

import os
import sys
import time

import numpy as np
import tvm
from tvm import relax

from tvm_bnfold import FoldBN, FuseEpilogue, bench, chips, load_onnx, runtime
from tvm_bnfold.models import get_model, random_inputs


def export(names: list[str], out: str) -> None:
    chip = chips.host_chip()
    os.makedirs(out, exist_ok=True)
    for name in names:
        mod = FoldBN()(load_onnx(get_model(name)))
        start = time.perf_counter()
        with chip.target:
            fused = FuseEpilogue(chip)(mod)
        seconds = time.perf_counter() - start
        tvm.compile(fused, target=chip.target).export_library(f"{out}/{name}.so")
        print(f"{name}: FuseEpilogue {seconds:.1f} s", flush=True)


def compare(names: list[str], dirs: list[str], rounds: int) -> None:
    runtime.set_threads()
    for name in names:
        proto = get_model(name)
        inputs = list(random_inputs(load_onnx(proto)).values())
        runs, outs = {}, {}
        for d in dirs:
            vm = relax.VirtualMachine(tvm.runtime.load_module(f"{d}/{name}.so"), tvm.cpu())
            args = [tvm.runtime.tensor(x) for x in inputs]
            runs[d] = lambda vm=vm, args=args: vm["main"](*args)
            outs[d] = runs[d]().numpy()
        runs["onnxruntime"] = bench.onnxruntime_runner(proto, inputs)[0]
        timed = {k: v[0] for k, v in bench.interleaved(runs, rounds).items()}
        ref = outs[dirs[0]]
        cells = [f"{k} {v * 1e3:.2f} ms" for k, v in timed.items()]
        cells += [f"{d} / {dirs[0]} {timed[dirs[0]] / timed[d]:.3f}x" for d in dirs[1:]]
        cells += [f"onnxruntime / {d} {timed['onnxruntime'] / timed[d]:.2f}x" for d in dirs]
        cells += [f"err {d} {np.abs(outs[d] - ref).max() / np.abs(ref).max():.1e}" for d in dirs]
        print(f"{name}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "export":
        export(sys.argv[2].split(","), sys.argv[3])
    else:
        compare(sys.argv[2].split(","), sys.argv[3].split(","), int(sys.argv[4]))
