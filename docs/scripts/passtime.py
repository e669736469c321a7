"""FuseEpilogue's pass time per model, cold (no spill verdict cached) and warm (the verdicts of
the cold run), on this machine's chip, each model in its own process.

    python docs/scripts/passtime.py MODEL[,MODEL...] [BATCH]

Models: the built-in ones and the corpus (tvm_bnfold.corpus.MODELS), at their native sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


def one(name: str, batch: int) -> None:
    os.environ["TVM_BNFOLD_CACHE"] = tempfile.mkdtemp()  # before tvm_bnfold reads it
    from tvm_bnfold import FoldBN, FuseEpilogue, chips, corpus, models

    proto = corpus.MODELS[name]() if name in corpus.MODELS else models.get_model(name)
    if batch != 1:
        proto = models.with_batch(proto, batch)
    mod = FoldBN()(models.load_onnx(proto))
    chip = chips.host_chip()
    times = []
    for _ in ("cold", "warm"):
        start = time.perf_counter()
        with chip.target:
            FuseEpilogue()(mod)
        times.append(time.perf_counter() - start)
    print(f"| {name} | {batch} | {times[0]:.1f} | {times[1]:.1f} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[3] == "--one":
        one(sys.argv[1], int(sys.argv[2]))
        sys.exit()
    batch = sys.argv[2] if len(sys.argv) > 2 else "1"
    print("| model | batch | cold s | warm s |\n|---|---|---|---|", flush=True)
    for model in sys.argv[1].split(","):
        subprocess.run([sys.executable, __file__, model, batch, "--one"], check=True,
                       stderr=subprocess.DEVNULL)
