"""A model with FuseEpilogue's blocked layout forced on and off, against ONNX Runtime, timed
interleaved in one process (docs/benchmarks.md, 2026-12-07).

    python docs/scripts/layouts.py MODELS ROUNDS      # e.g. vgg19,densenet121 10
"""

import sys

from tvm_bnfold import FoldBN, FuseEpilogue, bench, chips, load_onnx
from tvm_bnfold.models import get_model, random_inputs

chip = chips.host_chip()
for name in sys.argv[1].split(","):
    proto = get_model(name)
    mod = load_onnx(proto)
    inputs = list(random_inputs(mod).values())
    folded = FoldBN()(mod)
    runs = {}
    for label, blocked in (("blocked", True), ("nchw", False)):
        with chip.target:
            out = FuseEpilogue(chip, blocked=blocked)(folded)
        runs[label] = bench.tvm_runner(out, inputs, chip.target)[0]
        print(f"{name} {label}: {bench.kernel_count(out)} kernels, "
              f"{bench.layout_kernel_count(out)} layout transforms", flush=True)
    runs["onnxruntime"] = bench.onnxruntime_runner(proto, inputs)[0]
    t = {k: v[0] for k, v in bench.interleaved(runs, int(sys.argv[2])).items()}
    print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t.items())
          + f"; nchw / blocked {t['nchw'] / t['blocked']:.2f}x", flush=True)
