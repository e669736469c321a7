"""Where a model's time goes: each kernel of the compiled model next to ONNX Runtime's nodes,
matched layer by layer (``make profile``, or ``python -m tvm_bnfold.profile MODEL --chip C``).

TVM side: FoldBN + FuseEpilogue with the tuned schedules of ``tuning_logs/`` where present,
each kernel call timed through the Relax VM's instrument hook. ONNX Runtime side: its own
profiler, all graph optimizations. A conv is keyed by (input channels, input height, output
channels, kernel size) on both sides, so that blocked and NCHW layouts meet; any other kernel
keeps its own name. Times are means per inference in ms; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import tvm
from tvm import relax

from . import chips, runtime
from .bench import onnxruntime_session
from .errors import BNFoldError
from .fold_bn import FoldBN
from .fuse_epilogue import FuseEpilogue
from .models import BUILTIN, get_model, load_onnx, random_inputs
from .tuning import build

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
#: Our kernel name (its first op, ``fused_`` dropped) -> the ONNX Runtime node it matches.
_ORT_NAMES = {"max_pool2d": "MaxPool", "avg_pool2d": "AveragePool", "mean": "GlobalAveragePool",
              "softmax": "Softmax", "matmul": "Gemm", "reshape": "Flatten"}


def conv_key(in_shape, weight_shape) -> tuple[int, int, int, int]:
    """(input channels, input height, output channels, kernel height) of a conv, from NCHW /
    OIHW shapes or their blocked forms (NCHW{b}c, OIHW{b}i{b}o)."""
    channels = in_shape[1] * (in_shape[4] if len(in_shape) == 5 else 1)
    outputs = weight_shape[0] * (weight_shape[5] if len(weight_shape) == 6 else 1)
    return int(channels), int(in_shape[2]), int(outputs), int(weight_shape[2])


def layer_keys(mod: tvm.IRModule) -> dict[str, list]:
    """Kernel name -> the layer key of each of its calls in ``main`` (conv_key for a conv
    kernel, else the kernel's name)."""
    keys: dict[str, list] = defaultdict(list)

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(_CALL_TIR):
            name, args = expr.args[0].name_hint, expr.args[1].fields
            if "conv2d" in name:
                shapes = [[int(d) for d in a.ty.shape.values] for a in args[:2]]
                keys[name].append(conv_key(*shapes))
            else:
                first = name.removeprefix("fused_").rstrip("0123456789_")
                keys[name].append(next(
                    (v for k, v in _ORT_NAMES.items() if first.startswith(k)), name))

    relax.analysis.post_order_visit(mod["main"], visit)
    return keys


def tvm_layers(mod: tvm.IRModule, ex, inputs: list[np.ndarray], runs: int = 10) -> dict:
    """Layer key -> mean ms per inference of the built ``ex`` of ``mod`` (after FuseEpilogue);
    a kernel called for several layers splits its time evenly among them."""
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(x) for x in inputs]
    for _ in range(3):
        vm["main"](*args)
    total: dict[str, float] = defaultdict(float)
    start = [0.0]

    def instrument(func, name, before_run, ret_value, *call_args):
        if before_run:
            start[0] = time.perf_counter()
        else:
            total[name] += time.perf_counter() - start[0]
        return 0

    vm.set_instrument(instrument)
    for _ in range(runs):
        vm["main"](*args)
    keys = layer_keys(mod)
    layers: dict = defaultdict(float)
    for name, seconds in total.items():
        calls = keys.get(name, ["VM builtins" if name.startswith("vm.builtin.") else name])
        for key in calls:
            layers[key] += seconds / runs / len(calls) * 1e3
    return dict(layers)


def ort_layers(model: onnx.ModelProto, inputs: list[np.ndarray], threads: int,
               runs: int = 10) -> dict:
    """Layer key -> mean ms per inference of ONNX Runtime's nodes (its profiler)."""
    with tempfile.TemporaryDirectory() as tmp:
        session = onnxruntime_session(model, threads, profile_prefix=str(Path(tmp) / "ort"))
        if session is None:
            raise BNFoldError("profile compares with ONNX Runtime: pip install onnxruntime")
        feed = {i.name: x for i, x in zip(session.get_inputs(), inputs, strict=True)}
        for _ in range(runs):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    layers: dict = defaultdict(float)
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        op, shapes = event["args"]["op_name"], event["args"]["input_type_shape"]
        key = conv_key(shapes[0]["float"], shapes[1]["float"]) if op == "Conv" else op
        layers[key] += event["dur"] / 1e3 / runs
    return dict(layers)


def compare(model: onnx.ModelProto, chip, threads: int, runs: int = 10,
            name: str | None = None) -> list[tuple]:
    """(layer key, ours ms, ONNX Runtime ms) for every layer, largest deficit of ours first."""
    chip = chips.get(chip)
    mod = load_onnx(model)
    inputs = list(random_inputs(mod).values())
    with chip.target:
        fused = FuseEpilogue(chip)(FoldBN()(mod))
    ours = tvm_layers(fused, build(fused, chip, model=name), inputs, runs)
    theirs = ort_layers(model, inputs, threads, runs)
    keys = set(ours) | set(theirs)
    rows = [(k, ours.get(k, 0.0), theirs.get(k, 0.0)) for k in keys]
    return sorted(rows, key=lambda r: r[2] - r[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help=f"an ONNX file or a built-in model ({', '.join(BUILTIN)})")
    parser.add_argument("--chip", help="a chip that runs here (default: host, this machine)")
    parser.add_argument("--threads", type=int, default=chips.usable_cores())
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)
    runtime.set_threads(args.threads)
    name = args.model if args.model in BUILTIN else None
    chip = chips.get(args.chip) if args.chip else chips.host_chip()
    rows = compare(get_model(args.model), chip, args.threads, args.runs, name)
    print(f"{args.model} on {chip.name}, {args.threads} thread(s), mean ms per inference "
          f"over {args.runs} runs; conv layers keyed (in channels, in height, out channels, k)")
    print(f"{'layer':<36} {'ours':>8} {'ORT':>8} {'ours-ORT':>9}")
    for key, a, b in rows:
        print(f"{key!s:<36} {a:8.3f} {b:8.3f} {a - b:+9.3f}")
    total_a, total_b = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{'total':<36} {total_a:8.3f} {total_b:8.3f} {total_a - total_b:+9.3f}")


if __name__ == "__main__":
    main()
