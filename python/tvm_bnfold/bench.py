"""Measurements: op and kernel counts, bytes, latency, the variants side by side, and `make bench`.

``python -m tvm_bnfold.bench`` (``make bench``) times FoldBN on the built-in models, measures the
machine's practical peak with a large sgemm, then runs every variant (:data:`VARIANTS`) side by
side per chip that runs here (medians of interleaved rounds, one process).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.script import tirx as T

from . import chips, corpus, fuse_epilogue, runtime
from .fold_bn import FoldBN
from .fuse_epilogue import (
    FuseEpilogue,
    FusionRecord,
    blocked_by_default,
    schedule_kernels,
    tvm_fusion,
)
from .models import BUILTIN, load_onnx, random_inputs
from .tuning import build, find_database

# Variant key -> label, in table order.
VARIANTS = {
    "unfused": "unfused (each op its own kernel)",
    "stock": "stock TVM fusion",
    "foldbn": "FoldBN only",
    "nchw": "FoldBN+FuseEpilogue, NCHW (no blocked layout)",
    "ours": "FoldBN+FuseEpilogue (default schedule)",
    "tuned": "FoldBN+FuseEpilogue (tuned)",
    "stock-tuned": "stock TVM fusion (tuned, same policy)",
    "onnxruntime": "ONNX Runtime",
}
NOT_RUN = "not run: no device"


# --------------------------------------------------------------------------------------------
# Static measurements
# --------------------------------------------------------------------------------------------


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
    """Kernels ``main`` launches: its ``call_tir`` calls after legalization, less reshapes."""
    return fuse_epilogue.kernel_count(relax.transform.LegalizeOps()(mod))


def layout_kernel_count(mod: tvm.IRModule) -> int:
    """Of those, the layout transforms (kernels legalized from ``relax.layout_transform``,
    which TVM names ``te_layout_transform*``): where the blocked layout starts or ends."""
    calls: Counter = Counter()

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op == _CALL_TIR:
            calls[expr.args[0].name_hint] += 1

    relax.analysis.post_order_visit(relax.transform.LegalizeOps()(mod)["main"], visit)
    return sum(n for name, n in calls.items() if name.startswith("te_layout_transform"))


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


def _shape_bytes(shape, dtype) -> int:
    return int(np.prod([int(d) for d in shape])) * tvm.DataType(str(dtype)).bits // 8


def _nbytes(var: relax.Var) -> int:
    return _shape_bytes(var.ty.shape.values, var.ty.dtype)


def parameter_bytes(mod: tvm.IRModule) -> int:
    """Bytes of the constants (weights) the Relax functions hold, each counted once."""
    seen: dict = {}

    def visit(expr):
        if isinstance(expr, tvm.ir.expr.GenericConst):
            seen[expr] = _shape_bytes(expr.value.shape, expr.value.dtype)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return sum(seen.values())


def model_flops(mod: tvm.IRModule) -> int:
    """Multiply-add FLOPs (2 per MAC) of the conv and matmul ops of an un-legalized module."""
    total = 0

    def visit(expr):
        nonlocal total
        if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)):
            return
        name = expr.op.name
        out = [int(d) for d in expr.ty.shape.values] if hasattr(expr.ty, "shape") else []
        if name in ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d"):
            weight = [int(d) for d in expr.args[1].ty.shape.values]
            total += 2 * int(np.prod(out)) * int(np.prod(weight[1:]))
        elif name == "relax.matmul":
            total += 2 * int(np.prod(out)) * int(expr.args[0].ty.shape.values[-1])

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return total


#: What :func:`sgemm_peak` measures (numpy's OpenBLAS runs AVX2 kernels on some AVX-512
#: machines; ONNX Runtime's MLAS has AVX-512 ones: the faster of the two is the peak).
PEAK_LABEL = "2048^3 fp32 sgemm, the fastest run of numpy BLAS and ONNX Runtime MatMul"


def sgemm_peak(n: int = 2048, repeat: int = 10) -> float:
    """The machine's practical peak in GFLOP/s: the fastest of ``repeat`` runs of an n^3 fp32
    matmul by numpy (BLAS) and by ONNX Runtime (MLAS, when installed), one intra-op thread per
    core. The fastest, not the median: a peak, on a host whose speed drifts over minutes."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    runs = [lambda: a @ b]
    session = _ort_matmul(n)
    if session is not None:
        runs.append(lambda: session.run(None, {"a": a, "b": b}))
    best = min(_fastest(run, repeat) for run in runs)
    return 2 * n**3 / best / 1e9


#: What :func:`fma_peak` measures.
FMA_LABEL = "independent FMAs on every core"


def fma_summary(fma: dict[str, float]) -> str:
    """``FMA peak (...): avx512 235.0 GFLOP/s, ...`` for the peaks of :func:`fma_peak`."""
    return f"FMA peak ({FMA_LABEL}): " + ", ".join(
        f"{name} {value:.1f} GFLOP/s" for name, value in fma.items())


def fma_kernel(lanes: int, accumulators: int, iters: int, cores: int) -> tvm.tirx.PrimFunc:
    """``cores`` parallel chains of ``iters`` steps ``acc = acc * x + y`` on ``accumulators``
    independent vectors of ``lanes`` floats, accumulator ``a`` starting at ``a`` (LLVM contracts
    each step into one FMA; distinct starts keep it from merging the chains); writes the
    accumulators to ``out``. With x = y = 0.5 they converge to 1.0."""

    @T.prim_func
    def fma(x: T.Buffer((lanes,), "float32"), y: T.Buffer((lanes,), "float32"),
            out: T.Buffer((cores, accumulators, lanes), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for c in T.parallel(cores):
            acc = T.decl_buffer((accumulators, lanes), "float32", scope="local")
            for a in T.unroll(accumulators):
                for v in T.vectorized(lanes):
                    acc[a, v] = T.Cast("float32", a)
            for _ in range(iters):
                for a in T.unroll(accumulators):
                    for v in T.vectorized(lanes):
                        acc[a, v] = acc[a, v] * x[v] + y[v]
            for a in T.unroll(accumulators):
                for v in T.vectorized(lanes):
                    out[c, a, v] = acc[a, v]

    return fma


def fma_peak(chip, iters: int = 1 << 20, repeat: int = 5) -> float:
    """The chip's FMA peak on this machine in GFLOP/s: :func:`fma_kernel` on its widest vectors,
    half its vector registers as accumulators (enough independent FMAs to cover their latency),
    one chain per TVM thread; the fastest of ``repeat`` runs. No kernel of TVM's can go faster."""
    chip = chips.get(chip)
    threads = runtime.current_threads()
    lanes, accumulators = chip.lanes(), chip.vector_regs // 2
    ex = tvm.compile(tvm.IRModule({"main": fma_kernel(lanes, accumulators, iters, threads)}),
                     target=chip.target)
    run = ex.jit()["main"]
    half = tvm.runtime.tensor(np.full(lanes, 0.5, np.float32))
    out = tvm.runtime.tensor(np.zeros((threads, accumulators, lanes), np.float32))
    seconds = _fastest(lambda: run(half, half, out), repeat)
    return 2 * threads * accumulators * lanes * iters / seconds / 1e9


def _fastest(run: Callable[[], object], repeat: int) -> float:
    run()
    times = []
    for _ in range(max(repeat, 1)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def _ort_matmul(n: int):
    """An ONNX Runtime session of one n x n MatMul, or None without onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    a, b = (onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, [n, n]) for x in "ab")
    c = onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [n, n])
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["a", "b"], ["c"])],
                                   "sgemm", [a, b], [c])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = chips.usable_cores()
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------------------------
# Latency
# --------------------------------------------------------------------------------------------


def tvm_runner(mod, inputs: list[np.ndarray], target) -> tuple[Callable[[], object], np.ndarray]:
    """A callable that runs ``main`` of an IRModule (built here) or a built executable, and
    its output."""
    ex = tvm.compile(mod, target=target) if isinstance(mod, tvm.IRModule) else mod
    runtime.current_threads()  # every core, unless the caller configured the pool
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(x) for x in inputs]
    return (lambda: vm["main"](*args)), vm["main"](*args).numpy()


def onnxruntime_session(model: onnx.ModelProto, threads: int | None = None,
                        profile_prefix: str | None = None):
    """An ONNX Runtime CPU session with all graph optimizations and ``threads`` intra-op
    threads (None: one per core), profiling to ``profile_prefix`` when given; None when
    onnxruntime is not installed."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads or chips.usable_cores()
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def onnxruntime_runner(model: onnx.ModelProto, inputs: list[np.ndarray]):
    """ONNX Runtime (:func:`onnxruntime_session`, one thread per core): a callable that runs
    it and its output, or None when onnxruntime is not installed."""
    session = onnxruntime_session(model)
    if session is None:
        return None
    feed = {i.name: x for i, x in zip(session.get_inputs(), inputs, strict=True)}
    return (lambda: session.run(None, feed)), session.run(None, feed)[0]


def openvino_runner(model: onnx.ModelProto, inputs: list[np.ndarray]):
    """OpenVINO on the CPU (f32, one stream, one thread per core): a callable that runs it and
    its output, or None when openvino is not installed (an optional peer)."""
    try:
        import openvino as ov
    except ImportError:
        return None
    core = ov.Core()
    compiled = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU", {
        "INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": "1",
        "INFERENCE_NUM_THREADS": str(chips.usable_cores())})
    request = compiled.create_infer_request()
    return (lambda: request.infer(inputs)), next(iter(request.infer(inputs).values()))


def corpus_rows(chip: chips.Chip, names: list[str], repeat: int,
                progress: Callable[[str], None] | None = None, batch: int = 1) -> list[dict]:
    """The real models of :mod:`corpus` on ``chip`` (it must run here) at ``batch``
    (:func:`.models.with_batch`): ours (FoldBN + FuseEpilogue), tuned where
    ``tuning_logs/<chip>/<model>/`` exists (batch 1: the databases are tuned there), stock TVM
    fusion, ONNX Runtime and OpenVINO (when installed), timed interleaved in one process."""
    from .models import get_model, with_batch

    say = progress or (lambda _msg: None)
    rows = []
    for name in names:
        say(f"{chip.name}/{name}: building at batch {batch}")
        proto = get_model(name)
        if batch != 1:
            proto = with_batch(proto, batch)
        mod = load_onnx(proto)
        found = variants(mod, chip, baselines=("stock",))
        inputs = list(random_inputs(mod).values())
        runners = {v: tvm_runner(found[v].mod, inputs, chip.target) for v in ("ours", "stock")}
        tuned = build_tuned(found["ours"].mod, chip, name) if batch == 1 else None
        if tuned is not None:
            runners["tuned"] = tvm_runner(tuned, inputs, chip.target)
        for peer, make in (("onnxruntime", onnxruntime_runner), ("openvino", openvino_runner)):
            runner = make(proto, inputs)
            if runner is not None:
                runners[peer] = runner
        say(f"{chip.name}/{name}: timing {', '.join(runners)}")
        timed = interleaved({k: run for k, (run, _) in runners.items()}, repeat)
        ref = runners["stock"][1]
        row = dict(model=name, chip=chip.name, kernels=kernel_count(found["ours"].mod),
                   stock_kernels=kernel_count(found["stock"].mod),
                   layout_kernels=layout_kernel_count(found["ours"].mod),
                   max_rel_err=float(np.abs(runners["ours"][1] - ref).max() / np.abs(ref).max()))
        row.update({f"{k}_ms": timed[k][0] * 1e3 for k in runners})
        rows.append(row)
    return rows


def print_corpus(rows: list[dict], file=None) -> None:
    """The corpus table: latency per runtime, ours vs each peer, kernels ours / stock."""
    columns = ["ours", "tuned", "stock", "onnxruntime", "openvino"]
    out = file or sys.stdout
    print("| model | " + " | ".join(f"{c} ms" for c in columns)
          + " | ours vs ONNX Runtime | ours vs OpenVINO | kernels (stock) | layout | max rel err |",
          file=out)
    print("|---" * (len(columns) + 6) + "|", file=out)
    ratios = []
    for r in rows:
        cells = [_num(r[f"{c}_ms"]) if r.get(f"{c}_ms") else "-" for c in columns]
        vs = [f"{r[f'{p}_ms'] / r['ours_ms']:.2f}x" if r.get(f"{p}_ms") else "-"
              for p in ("onnxruntime", "openvino")]
        if r.get("onnxruntime_ms"):
            ratios.append(r["onnxruntime_ms"] / r["ours_ms"])
        print(f"| {r['model']} | " + " | ".join(cells) + f" | {vs[0]} | {vs[1]} | "
              f"{r['kernels']} ({r['stock_kernels']}) | {r['layout_kernels']} | "
              f"{r['max_rel_err']:.1e} |", file=out)
    if ratios:
        print(f"\ngeomean ours vs ONNX Runtime: {statistics.geometric_mean(ratios):.2f}x "
              f"over {len(ratios)} models", file=out)


#: Untimed runs before each timed run: the previous variant's thread pool (TVM's, ONNX
#: Runtime's) spins for a while after its last run and takes the cores from this one.
WARMUP = 2


def interleaved(runs: dict[str, Callable[[], object]], repeat: int, warmup: int = WARMUP
                ) -> dict[str, tuple]:
    """(median s, p90 s) of each callable over ``repeat`` rounds; each round times every one
    once, after ``warmup`` untimed runs of it, so that a machine that slows down or speeds
    up during the measurement (shared hosts do) weighs on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(max(repeat, 1)):
        for name, run in runs.items():
            for _ in range(warmup):
                run()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), float(np.percentile(t, 90))) for name, t in times.items()}


#: The variants timed again with a neighbour (:func:`busy_neighbour`), back to back.
CONTENDED = ("ours", "tuned", "onnxruntime")


def _spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


@contextlib.contextmanager
def busy_neighbour(cpu: int | None = None):
    """A busy-loop process pinned to one core (default: the last this process may use) while
    the block runs: the other work a deployment shares its machine with."""
    cpu = max(os.sched_getaffinity(0)) if cpu is None else cpu
    proc = multiprocessing.get_context("fork").Process(target=_spin, args=(cpu,), daemon=True)
    proc.start()
    time.sleep(0.2)  # it is spinning before the first timed run
    try:
        yield proc
    finally:
        proc.kill()
        proc.join()


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


# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------

# Relax passes of the stock TVM baseline: BatchNorm decomposed into multiply/add, then fused.
STOCK_TVM = (
    relax.transform.DecomposeOpsForInference(),
    relax.transform.CanonicalizeBindings(),
    relax.transform.DeadCodeElimination(),
)


@dataclass
class Variant:
    """One way to compile a model: the Relax module (legalized, fused as the variant does),
    its BatchNorms before legalization, and the schedule records of its conv/matmul kernels
    (None: kernels not scheduled, static graph columns only)."""

    mod: tvm.IRModule
    batch_norms: int
    records: list[FusionRecord] | None = field(default=None)


def variants(
    mod: tvm.IRModule, chip: chips.Chip, schedule_baselines: bool = True, measure: bool = True,
    baselines: tuple[str, ...] = ("unfused", "stock", "foldbn", "nchw"),
) -> dict[str, Variant]:
    """The model up to five ways: ``unfused`` (each op its own kernel), ``stock`` (TVM's BatchNorm
    decomposition + fusion), ``foldbn`` (FoldBN, then each op its own kernel), ``nchw``
    (FoldBN + FuseEpilogue without the blocked layout; only on chips where ours blocks) and
    ``ours`` (FoldBN + FuseEpilogue).
    Every conv/matmul kernel of the first three gets our default NCHW schedule (the blocked
    layout needs the BatchNorms folded: ConvertLayout cannot carry them);
    ``schedule_baselines=False`` schedules only the FuseEpilogue variants (enough for static
    columns); ``measure=False`` skips compiling candidates to count spills (static register
    check only); ``baselines`` picks which of the first four to build."""

    def legalize(m):
        return tvm.transform.Sequential(
            [relax.transform.LegalizeOps(), relax.transform.FoldConstant()])(m)

    folded = FoldBN()(mod)
    sources = {"unfused": mod, "foldbn": folded}
    if "stock" in baselines:
        sources["stock"] = tvm.transform.Sequential(STOCK_TVM)(mod)
    result = {}
    with chip.target:
        for name in baselines:
            if name == "nchw":
                if not blocked_by_default(chip):
                    continue  # ours is NCHW on this chip already
                fuse = FuseEpilogue(chip, measure, blocked=False)
                result[name] = Variant(fuse(folded), op_counts(folded)["nn.batch_norm"],
                                       fuse.report)
                continue
            source, records = sources[name], None
            graph = (tvm.transform.Sequential(tvm_fusion())(source) if name == "stock"
                     else legalize(source))
            if schedule_baselines:
                graph, records = schedule_kernels(graph, chip, measure)
            result[name] = Variant(graph, op_counts(source)["nn.batch_norm"], records)
        fuse = FuseEpilogue(chip, measure)
        result["ours"] = Variant(fuse(folded), op_counts(folded)["nn.batch_norm"], fuse.report)
    return result


#: Activations whose exact form is a libm call (sigmoid, silu = x * sigmoid(x), tanh).
LIBM_EPILOGUES = {
    "sigmoid": lambda bb, y: relax.op.sigmoid(y),
    "silu": lambda bb, y: relax.op.multiply(y, bb.emit(relax.op.sigmoid(y))),
    "tanh": lambda bb, y: relax.op.tanh(y),
}


def conv_act(act: str, channels: int = 64, size: int = 56, seed: int = 0) -> tvm.IRModule:
    """x (1, C, S, S) -> 3x3 conv (C -> C, padding 1) + bias -> ``act`` (of LIBM_EPILOGUES)."""
    rng = np.random.default_rng(seed)
    w = relax.const(rng.normal(0, 0.1, (channels, channels, 3, 3)).astype("float32"))
    b = relax.const(rng.normal(0, 0.5, (1, channels, 1, 1)).astype("float32"))
    x = relax.Var("x", relax.TensorType([1, channels, size, size], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(bb.emit(relax.op.nn.conv2d(x, w, padding=1)), b))
            out = bb.emit_output(LIBM_EPILOGUES[act](bb, y))
        bb.emit_func_output(out)
    return bb.get()


def fast_math_rows(chip: chips.Chip, repeat: int, channels: int = 64, size: int = 56) -> list:
    """(activation, libm median s, fast_math median s, decisions, max rel diff) of a conv with
    each LIBM_EPILOGUES activation, FuseEpilogue exact vs ``fast_math=True``, side by side."""
    rows = []
    for act in LIBM_EPILOGUES:
        mod = conv_act(act, channels, size)
        inputs = list(random_inputs(mod).values())
        runs, outs, decisions = {}, {}, []
        for fast in (False, True):
            fuse = FuseEpilogue(chip, fast_math=fast)
            runs[fast], outs[fast] = tvm_runner(fuse(mod), inputs, chip.target)
            decisions.append(fuse.report[0].decision)
        times = interleaved(runs, repeat)
        diff = np.abs(outs[True] - outs[False]).max() / np.abs(outs[False]).max()
        rows.append((act, times[False][0], times[True][0], decisions, float(diff)))
    return rows


def build_tuned(mod: tvm.IRModule, chip: chips.Chip, model: str):
    """The executable of ``mod`` (after FoldBN+FuseEpilogue) with the chip/model's tuned
    schedules, or None when no tuning database is there."""
    path = find_database(chip, model)
    return None if path is None else build(mod, chip, work_dir=str(path), model=model)


def _schedule_columns(records: list[FusionRecord] | None) -> dict:
    if records is None:
        return dict(max_registers=None, register_budget=None, max_spills=None, rejected=None)
    regs = [r.registers for r in records if r.registers is not None]
    spills = [r.spill_bytes if r.spill_bytes is not None else r.spill_moves for r in records]
    spills = [s for s in spills if s is not None]
    budgets = [r.budget for r in records if r.budget is not None]
    return dict(
        max_registers=max(regs, default=None),
        register_budget=max(budgets, default=None),
        max_spills=max(spills, default=None),
        # Kernels whose epilogue the register check kept off the register tile, and the
        # candidate tiles / levels it refused on the way.
        rejected=f"{sum(r.decision in ('cache', 'separate') for r in records)} "
                 f"({sum(len(r.rejected or []) for r in records)} tiles)",
    )


def compare(
    mod: tvm.IRModule,
    name: str,
    chip: chips.Chip,
    repeat: int,
    onnx_model: onnx.ModelProto | None = None,
    progress: Callable[[str], None] | None = None,
    measure: bool = True,
    baselines: tuple[str, ...] = ("unfused", "stock", "foldbn", "nchw"),
) -> tuple[list[dict], dict[str, Variant]]:
    """Every variant of ``mod`` on ``chip``, side by side: one row each (see :func:`print_rows`)
    and the variants. Latency and error only where the chip runs here (else ``latency`` is
    :data:`NOT_RUN`); the tuned row only with a tuning database; ONNX Runtime only with
    ``onnx_model``, onnxruntime installed and the chip running here. ``baselines``: which of
    unfused/stock/foldbn/nchw to include; the first is the reference for the error. With two
    cores or more, ours, tuned and ONNX Runtime are timed again beside a busy core
    (:func:`busy_neighbour`), back to back without warm-up runs: ``contended_ms``."""
    say = progress or (lambda _msg: None)
    runs = chip.runs_here and chip.kind == "cpu"
    say(f"{chip.name}/{name}: transforming (FoldBN, FuseEpilogue, baselines)")
    found = variants(mod, chip, schedule_baselines=runs, measure=measure, baselines=baselines)
    inputs = list(random_inputs(mod).values())
    rows, runners = [], {}  # runners: variant -> (callable, output), all timed together
    for variant, v in found.items():
        rows.append(dict(
            model=name, chip=chip.name, variant=variant, kernels=kernel_count(v.mod),
            layout_kernels=layout_kernel_count(v.mod), batch_norms=v.batch_norms,
            intermediate_mb=intermediate_bytes(relax.transform.LegalizeOps()(v.mod)) / 1e6,
            parameter_mb=parameter_bytes(v.mod) / 1e6, **_schedule_columns(v.records)))
        if runs:
            say(f"{chip.name}/{name}/{variant}: compiling")
            runners[variant] = tvm_runner(v.mod, inputs, chip.target)
    ours = rows[-1]
    # Tuned: ours with tuning_logs/<chip>/<model>/, and the stock graph with <model>-stock/
    # (tuned with the same budget; both keep the default schedule where it measured faster).
    tuned_sources = [("tuned", "ours", name, ours)]
    if "stock" in found:
        stock_row = next(r for r in rows if r["variant"] == "stock")
        tuned_sources.append(("stock-tuned", "stock", f"{name}-stock", stock_row))
    for variant, source, db_name, like in tuned_sources if runs else ():
        try:
            tuned = build_tuned(found[source].mod, chip, db_name)
        except Exception as err:  # e.g. a database being written by a tuning run right now
            say(f"{chip.name}/{name}/{variant}: skipped, cannot use "
                f"{find_database(chip, db_name)}: "
                + next(iter(str(err).splitlines()), type(err).__name__))
            tuned = None
        if tuned is not None:
            say(f"{chip.name}/{name}/{variant}: built with {find_database(chip, db_name)}")
            rows.append(dict(like, variant=variant))
            runners[variant] = tvm_runner(tuned, inputs, chip.target)
    if runs and onnx_model is not None:
        runner = onnxruntime_runner(onnx_model, inputs)
        if runner is not None:
            rows.append({k: None for k in ours} | dict(
                model=name, chip=chip.name, variant="onnxruntime",
                parameter_mb=parameter_bytes(mod) / 1e6))
            runners["onnxruntime"] = runner
    if runs:
        say(f"{chip.name}/{name}: timing {', '.join(runners)} in {repeat} interleaved rounds")
        timed = interleaved({k: run for k, (run, _) in runners.items()}, repeat)
        ref = runners[rows[0]["variant"]][1]
        for row in rows:
            (median, p90), out = timed[row["variant"]], runners[row["variant"]][1]
            row.update(median_ms=median * 1e3, p90_ms=p90 * 1e3,
                       max_abs_err=float(np.abs(out - ref).max()))
        contended = [k for k in CONTENDED if k in runners]
        if chips.usable_cores() > 1 and contended:
            say(f"{chip.name}/{name}: timing {', '.join(contended)} beside a busy core, "
                "back to back")
            with busy_neighbour():
                beside = interleaved({k: runners[k][0] for k in contended}, repeat, warmup=0)
            for row in rows:
                if row["variant"] in beside:
                    row["contended_ms"] = beside[row["variant"]][0] * 1e3
    refs = {r["variant"]: r.get("median_ms") for r in rows}
    for row in rows:
        if runs:
            for ref_name in ("unfused", "stock"):
                base = refs.get(ref_name)
                row[f"speedup_vs_{ref_name}"] = base / row["median_ms"] if base else None
        else:
            row.update(median_ms=None, p90_ms=None, max_abs_err=None, speedup_vs_unfused=None,
                       speedup_vs_stock=None, latency=NOT_RUN)
    return rows, found


# --------------------------------------------------------------------------------------------
# Tables and `make bench`
# --------------------------------------------------------------------------------------------

def _num(value: float) -> str:
    """Three significant digits, without exponents for large values."""
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"


# (row key, header, format: str.format pattern or callable); None values print as "-".
COLUMNS = [
    ("median_ms", "median ms", _num),
    ("p90_ms", "p90 ms", _num),
    ("contended_ms", "contended ms", _num),
    ("speedup_vs_unfused", "vs unfused", "{:.2f}x"),
    ("speedup_vs_stock", "vs stock", "{:.2f}x"),
    ("kernels", "kernels", "{}"),
    ("layout_kernels", "of which layout", "{}"),
    ("batch_norms", "BNs left", "{}"),
    ("intermediate_mb", "interm. MB", _num),
    ("parameter_mb", "param MB", _num),
    ("max_registers", "max regs", "{}"),
    ("max_spills", "max spills", "{}"),
    ("rejected", "rejected", "{}"),
    ("max_abs_err", "max abs err", "{:.1e}"),
]


def cell(row: dict, key: str, fmt: str) -> str:
    """One formatted table cell; latency cells of a chip that cannot run here say so."""
    value = row.get(key)
    if value is None:
        return row.get("latency", "-") if key == "median_ms" else "-"
    return fmt(value) if callable(fmt) else fmt.format(value)


def print_rows(rows: list[dict], file=None) -> None:
    """The variants table of :func:`compare`."""
    file = file or sys.stdout
    header = f"{'model':<12} {'chip':<9} {'variant':<11} " + " ".join(
        f"{h:>{max(len(h), 7)}}" for _, h, _ in COLUMNS)
    print(header, file=file)
    for r in rows:
        print(f"{r['model']:<12} {r['chip']:<9} {r['variant']:<11} " + " ".join(
            f"{cell(r, k, f):>{max(len(h), 7)}}" for k, h, f in COLUMNS), file=file)


def print_peak(rows: list[dict], model_gflop: float, peak: float, fma: float | None = None,
               file=None) -> None:
    """What fraction of the sgemm peak (and of the chip's FMA peak, when given) each timed
    variant reaches."""
    for r in rows:
        if r.get("median_ms"):
            achieved = model_gflop / (r["median_ms"] / 1e3)
            of_fma = f", {achieved / fma:.0%} of the FMA peak" if fma else ""
            print(f"  {r['model']} {r['chip']} {r['variant']}: {achieved:.1f} GFLOP/s = "
                  f"{achieved / peak:.0%} of the sgemm peak{of_fma}", file=file or sys.stdout)


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(BUILTIN),
                        help="comma-separated built-in models ('': the epilogue section only)")
    parser.add_argument("--chips", default="host",
                        help="comma-separated chips that run here (default: host, this machine)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--corpus", default=",".join(
        n for n in corpus.MODELS if n != "vgg19"),
        help="comma-separated real models of the corpus ('': none)")
    parser.add_argument("--corpus-batches", default="1,8",
                        help="comma-separated batch sizes of the corpus tables")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    runtime.set_threads()

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

    peak = sgemm_peak()
    print(f"\n## Practical peak ({PEAK_LABEL}): {peak:.1f} GFLOP/s")
    targets = [chips.get(c) for c in args.chips.split(",") if c]
    print(f"## Chips: {'; '.join(c.describe() for c in targets)}")
    fma = {chip.name: fma_peak(chip) for chip in targets}
    print(f"## {fma_summary(fma)}")
    print("\n## Variants (batch 1, fp32; median of "
          f"{args.repeat} interleaved rounds, one process)")
    for name in models:
        for chip in targets:
            proto = BUILTIN[name]()
            mod = load_onnx(proto)
            rows, _ = compare(mod, name, chip, args.repeat, proto)
            print_rows(rows)
            print_peak(rows, model_flops(mod) / 1e9, peak, fma[chip.name])

    names = [m for m in args.corpus.split(",") if m]
    batches = [int(b) for b in args.corpus_batches.split(",") if b]
    for chip, batch in ((c, b) for c in (targets if names else ()) for b in batches):
        print(f"\n## Real models ({chip.name}, batch {batch}, fp32, native input sizes; median "
              f"of {args.repeat} interleaved rounds)")
        print_corpus(corpus_rows(chip, names, args.repeat, progress=_progress, batch=batch))

    print("\n## Epilogues of libm functions: 3x3 conv 64->64 on 56x56 + bias + activation, "
          "FuseEpilogue exact vs fast_math=True")
    for chip in targets:
        for act, exact, fast, (d_exact, d_fast), diff in fast_math_rows(chip, args.repeat):
            print(f"{chip.name:<8} {act:<8} exact {exact * 1e3:7.3f} ms ({d_exact}), fast_math "
                  f"{fast * 1e3:7.3f} ms ({d_fast}): {exact / fast:.2f}x, max rel diff {diff:.1e}")


if __name__ == "__main__":
    main()
