"""A model with the default schedules, once per blocked-tile accumulator target, against ONNX
Runtime: medians of interleaved rounds in one process (docs/benchmarks.md, 2026-12-07).

    python docs/scripts/accumulators.py MODEL TARGETS ROUNDS   # e.g. resnet50 base,28 10

MODEL: a built-in or corpus model; TARGETS: comma-separated values of
``Knobs.target_accumulators`` ("base": the chip's own). Prints one line of medians and ratios.
"""

import dataclasses
import statistics
import sys
import time

from tvm_bnfold import FoldBN, FuseEpilogue, bench, chips, load_onnx, runtime
from tvm_bnfold.models import get_model, random_inputs
from tvm_bnfold.schedules import tiles

name, targets, rounds = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
runtime.set_threads()
chip = chips.host_chip()
proto = get_model(name)
mod = load_onnx(proto)
inputs = list(random_inputs(proto).values())
chip_knobs = tiles.Knobs.of
runs = {}
for target in targets:
    def knobs(chip, dtype, target=target):
        base = chip_knobs(chip, dtype)
        return base if target == "base" else dataclasses.replace(
            base, target_accumulators=int(target))

    tiles.Knobs.of = staticmethod(knobs)
    with chip.target:
        fused = FuseEpilogue(chip)(FoldBN()(mod))
    tiles.Knobs.of = chip_knobs
    runs[target], _ = bench.tvm_runner(fused, inputs, chip.target)
runs["ort"], _ = bench.onnxruntime_runner(proto, inputs)


def mean_ms(run, n=5):
    run(), run()
    start = time.perf_counter()
    for _ in range(n):
        run()
    return (time.perf_counter() - start) / n * 1e3


times = {k: [] for k in runs}
for _ in range(rounds):
    for k, run in runs.items():
        times[k].append(mean_ms(run))
med = {k: statistics.median(t) for k, t in times.items()}
print(name, chip.name, " ".join(f"{k}={m:.2f}ms" for k, m in med.items()), "ORT/ours:",
      " ".join(f"{k}={med['ort'] / med[k]:.3f}" for k in targets))
