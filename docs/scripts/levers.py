"""Ours vs ONNX Runtime alone, then beside a busy core: one thread-pool setting per process.

    python docs/scripts/levers.py MODEL PIN SPIN ROUNDS   # e.g. resnet50 0 default 12

PIN 1 pins each TVM worker to one core; SPIN sets TVM_THREAD_POOL_SPIN_COUNT ("default": TVM's).
Prints one JSON line (docs/benchmarks.md, 2026-12-07)."""

import json
import os
import sys

model, pin, spin, rounds = sys.argv[1], sys.argv[2] == "1", sys.argv[3], int(sys.argv[4])
if spin != "default":
    os.environ["TVM_THREAD_POOL_SPIN_COUNT"] = spin  # read when the pool's workers start

import tvm  # noqa: E402

from tvm_bnfold import FoldBN, FuseEpilogue, bench, chips, load_onnx, runtime  # noqa: E402
from tvm_bnfold.models import get_model, random_inputs  # noqa: E402

chip = chips.host_chip()
proto = get_model(model)
mod = load_onnx(proto)
with chip.target:
    ours = FuseEpilogue()(FoldBN()(mod))
inputs = list(random_inputs(mod).values())
runtime.set_threads(pin=pin)
run_ours, _ = bench.tvm_runner(tvm.compile(ours, chip.target), inputs, chip.target)
run_ort, _ = bench.onnxruntime_runner(proto, inputs)
alone = bench.interleaved({"ours": run_ours, "ort": run_ort}, rounds)
with bench.busy_neighbour():
    busy = bench.interleaved({"ours": run_ours, "ort": run_ort}, rounds, warmup=0)
print(json.dumps(dict(
    model=model, pin=pin, spin=spin, ours_ms=alone["ours"][0] * 1e3, ort_ms=alone["ort"][0] * 1e3,
    ratio_alone=alone["ort"][0] / alone["ours"][0], ours_busy_ms=busy["ours"][0] * 1e3,
    ort_busy_ms=busy["ort"][0] * 1e3, ratio_busy=busy["ort"][0] / busy["ours"][0])))
