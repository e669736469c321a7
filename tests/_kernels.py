"""Kernels the schedule tests share: small Relax graphs fused into one kernel each (NCHW), and
convs in the blocked layout of a chip that runs here."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm
from tvm import relax

from _util import function, tensor_var
from tvm_bnfold import chips, schedules
from tvm_bnfold.blocked_layout import CONV_BLOCK
from tvm_bnfold.fuse_epilogue import fuse_graph

R = relax.op


PIPELINE = tvm.transform.Sequential([
    relax.transform.LegalizeOps(),
    relax.transform.AnnotateTIROpPattern(),
    relax.transform.FoldConstant(),
    relax.transform.FuseOps(),
    relax.transform.FuseTIR(),
])


def _const(rng, shape, scale=0.3):
    return relax.const(rng.normal(0, scale, shape).astype("float32"))


def _scalar(v: float) -> relax.Expr:
    return relax.const(np.float32(v))


def _conv(x_shape, cout, kernel, stride=1, padding=0, groups=1, act=None, residual=False):
    """x -> conv2d (+ bias) [+ residual] [-> act] as a Relax module."""
    rng = np.random.default_rng(0)
    w = _const(rng, (cout, x_shape[1] // groups, kernel, kernel))
    b = _const(rng, (1, cout, 1, 1), 0.5)
    out_h = (x_shape[2] + 2 * padding - kernel) // stride + 1
    out_w = (x_shape[3] + 2 * padding - kernel) // stride + 1
    params = [tensor_var("x", x_shape)]
    if residual:
        params.append(tensor_var("r", (x_shape[0], cout, out_h, out_w)))

    def body(bb, x, *res):
        y = bb.emit(R.nn.conv2d(x, w, strides=stride, padding=padding, groups=groups))
        y = bb.emit(R.add(y, b))
        if residual:
            y = bb.emit(R.add(y, res[0]))
        if act == "relu":
            return R.nn.relu(y)
        if act == "clip":  # ReLU6 as the ONNX importer writes it: maximum, then minimum
            return R.minimum(bb.emit(R.maximum(y, _scalar(0))), _scalar(6))
        if act == "silu":  # an epilogue DAG: y is read twice
            return R.multiply(y, bb.emit(R.sigmoid(y)))
        return y

    return function(params, body)


def _matmul(m, k, n):
    rng = np.random.default_rng(1)
    w, b = _const(rng, (k, n)), _const(rng, (n,), 0.5)
    return function(
        [tensor_var("x", (m, k))], lambda bb, x: R.add(bb.emit(R.matmul(x, w)), b)
    )


def _sum_of_stack():
    """The stock form of ONNX's Sum of two maps: sum(stack([a, b])), a pointwise reduction
    straight into the function output (3x3: a vector tail on avx2 and avx512)."""
    params = [tensor_var("a", (1, 64, 3, 3)), tensor_var("b", (1, 64, 3, 3))]
    return function(params, lambda bb, a, b: R.sum(bb.emit(R.stack([a, b])), axis=[0]))


def _conv1d():
    rng = np.random.default_rng(2)
    w, b = _const(rng, (8, 4, 3)), _const(rng, (1, 8, 1), 0.5)
    return function(
        [tensor_var("x", (1, 4, 30))],
        lambda bb, x: R.nn.relu(bb.emit(R.add(bb.emit(R.nn.conv1d(x, w, padding=1)), b))),
    )


def _conv3d():
    rng = np.random.default_rng(3)
    w, b = _const(rng, (4, 2, 3, 3, 3)), _const(rng, (1, 4, 1, 1, 1), 0.5)
    return function(
        [tensor_var("x", (1, 2, 5, 6, 10))],
        lambda bb, x: R.add(bb.emit(R.nn.conv3d(x, w, padding=1)), b),
    )


def _max_pool(x_shape, stride, layout="NCHW"):
    """x -> 3x3 max pool with padding 1 (ResNet's, at ``stride``) in ``layout``."""
    return function([tensor_var("x", x_shape)], lambda bb, x: R.nn.max_pool2d(
        x, 3, stride, 1, layout=layout, out_layout=layout))


# name -> (module, expected kind); odd widths exercise the vector tails.


CASES = {
    "conv3x3_bias_relu": (lambda: _conv((1, 8, 10, 12), 16, 3, padding=1, act="relu"), "conv2d"),
    "conv3x3_residual": (
        lambda: _conv((1, 8, 9, 20), 16, 3, padding=1, act="relu", residual=True), "conv2d"),
    "conv1x1_stride2": (lambda: _conv((1, 8, 12, 22), 24, 1, stride=2), "conv2d"),
    "conv1x1_tail": (lambda: _conv((1, 16, 7, 7), 32, 1, act="relu"), "conv2d"),
    "conv1x1_on_1x1_map": (lambda: _conv((1, 16, 1, 1), 24, 1, act="clip"), "conv2d"),
    "conv7x7_stride2_pad3": (
        lambda: _conv((1, 3, 22, 38), 16, 7, stride=2, padding=3, act="relu"), "conv2d"),
    "depthwise_clip": (
        lambda: _conv((1, 16, 14, 14), 16, 3, padding=1, groups=16, act="clip"),
        "depthwise_conv2d"),
    "depthwise_stride2_clip": (
        lambda: _conv((1, 24, 15, 15), 24, 3, stride=2, padding=1, groups=24, act="clip"),
        "depthwise_conv2d"),
    "grouped": (lambda: _conv((1, 8, 9, 11), 12, 3, padding=1, groups=2), "group_conv2d"),
    "conv_silu_dag": (lambda: _conv((1, 4, 6, 40), 8, 3, padding=1, act="silu"), "conv2d"),
    "matmul_bias": (lambda: _matmul(2, 40, 24), "matmul"),
    "gemv_bias": (lambda: _matmul(1, 160, 130), "matmul"),  # split over the cores
    "gemv_odd_reduction": (lambda: _matmul(1, 161, 130), "matmul"),  # not split
    "conv1d": (_conv1d, "conv1d"),
    "conv3d": (_conv3d, "conv3d"),
    "max_pool_stride2": (lambda: _max_pool((1, 8, 15, 22), 2), "reduction"),
    "max_pool_stride1": (lambda: _max_pool((1, 8, 9, 20), 1), "reduction"),
    "max_pool_blocked": (lambda: _max_pool((1, 2, 15, 14, 16), 2, "NCHW16c"), "reduction"),
    "sum_of_stack": (_sum_of_stack, "reduction"),
}


CHIPS = [pytest.param(chips.get(n), id=n) for n in ("avx512", "avx2")]


@functools.cache
def case_kernel(case: str) -> tvm.tirx.PrimFunc:
    """The one anchor kernel of a case after the project's fusion pipeline."""
    mod = PIPELINE(CASES[case][0]())
    funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    anchored = [f for f in funcs if schedules.analyze(f) is not None]
    assert len(anchored) == 1, [f.attrs for f in funcs]
    return anchored[0]


def host_target(chip: chips.Chip) -> tvm.target.Target:
    """The chip's target when this host executes its code, else the host's own CPU (the
    schedule, with the chip's lanes and tiles, is the same; LLVM splits the wider vectors)."""
    host = tvm.target.Target(
        {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": 2}
    )
    needs = {"avx512": "avx512f", "avx2": "avx2"}.get(chip.name)
    if needs is None or tvm.target.codegen.llvm_cpu_has_features(needs, host):
        return chip.target
    return host


def run_func(func: tvm.tirx.PrimFunc, target, args: list[np.ndarray]) -> np.ndarray:
    lib = tvm.tirx.build(func.with_attr("global_symbol", "main"), target=target)
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib(*tensors)
    return tensors[-1].numpy()


@functools.cache
def case_inputs(case: str) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        rng.normal(0, 2, [int(d) for d in p.ty.shape]).astype(str(p.ty.dtype))
        for p in case_kernel(case).params
    ]


@functools.cache
def case_reference(case: str) -> np.ndarray:
    return run_func(case_kernel(case), "llvm", list(case_inputs(case)))


HERE = [c for c in ("avx512", "avx2") if chips.get(c).runs_here]


#: avx2 where it runs: 8-channel blocks keep the shapes small.
CHIP = chips.get(HERE[-1] if HERE else "avx2")


B = CHIP.lanes()


AVX512 = chips.get("avx512")  # 32 vector registers: a dense conv's kernel columns unrolled


def weight(rng, *shape, scale=0.3):
    return relax.const(rng.normal(0, scale, shape).astype("float32"))


def conv_module(cin, cout, hw=9, k=3, stride=1, pad=1, dilation=1, groups=1, act="relu",
                residual=False, seed=0):
    """x -> conv2d -> + bias [-> + residual] -> act, NCHW."""
    rng = np.random.default_rng(seed)
    w = weight(rng, cout, cin // groups, k, k)
    b = weight(rng, 1, cout, 1, 1, scale=0.5)
    out = (hw + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    params = [tensor_var("x", (1, cin, hw, hw))]
    if residual:
        params.append(tensor_var("r", (1, cout, out, out)))

    def body(bb, x, *res):
        y = bb.emit(R.nn.conv2d(x, w, strides=stride, padding=pad, dilation=dilation,
                                groups=groups))
        y = bb.emit(R.add(y, b))
        if residual:
            y = bb.emit(R.add(y, res[0]))
        return {"relu": R.nn.relu, "relu6": lambda v: R.clip(v, 0, 6),
                "none": lambda v: v}[act](y)

    inputs = [rng.normal(size=[int(d) for d in p.ty.shape.values]).astype("float32")
              for p in params]
    return function(params, body), inputs


def stem_module(pool=True, also_returned=False, seed=8):
    """RGB x -> conv (3 -> 2 blocks) -> + bias -> relu [-> max pool] -> conv [, the relu]."""
    rng = np.random.default_rng(seed)
    w1, b1 = weight(rng, 2 * B, 3, 3, 3), weight(rng, 1, 2 * B, 1, 1)
    w2 = weight(rng, 2 * B, 2 * B, 1, 1)

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.add(bb.emit(R.nn.conv2d(x, w1, strides=2, padding=1)),
                                            b1))))
        z = bb.emit(R.nn.max_pool2d(y, 3, 2, 1)) if pool else y
        out = bb.emit(R.nn.conv2d(z, w2))
        return relax.Tuple([out, y]) if also_returned else out

    x = rng.normal(size=(1, 3, 16, 16)).astype("float32")
    return function([tensor_var("x", x.shape)], body), x


def blocked_kernel(cin=2 * B, cout=4 * B, hw=14, **kwargs):
    mod, _ = conv_module(cin, cout, hw=hw, **kwargs)
    with CHIP.target:
        graph = fuse_graph(mod, B)
    (gvar,) = [g for g, f in graph.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc) and CONV_BLOCK in g.name_hint]
    return graph[gvar], schedules.analyze(graph[gvar])


def conv_kernel(chip, **case):
    """(module, inputs, blocked graph, its conv kernel's GlobalVar) of ``conv_module(**case)``
    in ``chip``'s channel blocks."""
    mod, inputs = conv_module(**case)
    with chip.target:
        graph = fuse_graph(mod, chip.lanes()).clone()
    (gvar,) = [g for g in graph.functions if CONV_BLOCK in g.name_hint]
    return mod, inputs, graph, gvar


def blocked_tile(chip, rows: int, hrows: int = 1) -> schedules.Tile:
    b = chip.lanes()
    return schedules.Tile(vec=b, rows=rows, hrows=hrows, lanes=b, block_rows=rows)
