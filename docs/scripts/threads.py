"""A model after FoldBN + FuseEpilogue at TVM's default thread pool, then at 1 and 2 threads
interleaved in the same process (docs/benchmarks.md, 2026-12-07).

    python docs/scripts/threads.py mobilenetv2
"""

import sys
import time

import numpy as np
import tvm
from tvm import relax

from tvm_bnfold import FoldBN, FuseEpilogue, chips, load_onnx, runtime
from tvm_bnfold.models import get_model, random_inputs

chip = chips.host_chip()
mod = load_onnx(get_model(sys.argv[1]))
with chip.target:
    ours = FuseEpilogue()(FoldBN()(mod))
vm = relax.VirtualMachine(tvm.compile(ours, chip.target), tvm.cpu())
args = [tvm.runtime.tensor(x) for x in random_inputs(mod).values()]


def median_ms(runs: int = 15) -> float:
    for _ in range(3):
        vm["main"](*args)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        vm["main"](*args)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


print(f"TVM's default pool: {median_ms():.2f} ms")
results: dict[int, list[float]] = {1: [], 2: []}
for _ in range(5):
    for threads in results:
        runtime.set_threads(threads)
        results[threads].append(median_ms())
print({n: round(float(np.median(v)), 2) for n, v in results.items()})
