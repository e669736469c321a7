"""conv_schedule: numerics of every epilogue placement against the unscheduled kernel, the
register-tile structure, tile ordering, register estimates, and the kernels it must refuse."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

from _util import function, tensor_var
from tvm_bnfold import BNFoldError, chips
from tvm_bnfold import conv_schedule as cs
from tvm_bnfold.register_pressure import static_budget

R = relax.op
PIPELINE = tvm.transform.Sequential([
    relax.transform.LegalizeOps(),
    relax.transform.AnnotateTIROpPattern(),
    relax.transform.FoldConstant(),
    relax.transform.FuseOps(),
    relax.transform.FuseTIR(),
])


# --------------------------------------------------------------------------------------------
# Small Relax graphs -> one fused kernel each
# --------------------------------------------------------------------------------------------


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
def _kernel(case: str) -> tvm.tirx.PrimFunc:
    """The one anchor kernel of a case after the project's fusion pipeline."""
    mod = PIPELINE(CASES[case][0]())
    funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    anchored = [f for f in funcs if cs.analyze(f) is not None]
    assert len(anchored) == 1, [f.attrs for f in funcs]
    return anchored[0]


def _host_target(chip: chips.Chip) -> tvm.target.Target:
    """The chip's target when this host executes its code, else the host's own CPU (the
    schedule, with the chip's lanes and tiles, is the same; LLVM splits the wider vectors)."""
    host = tvm.target.Target(
        {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": 2}
    )
    needs = {"avx512": "avx512f", "avx2": "avx2"}.get(chip.name)
    if needs is None or tvm.target.codegen.llvm_cpu_has_features(needs, host):
        return chip.target
    return host


def _run(func: tvm.tirx.PrimFunc, target, args: list[np.ndarray]) -> np.ndarray:
    lib = tvm.tirx.build(func.with_attr("global_symbol", "main"), target=target)
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib(*tensors)
    return tensors[-1].numpy()


@functools.cache
def _inputs(case: str) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        rng.normal(0, 2, [int(d) for d in p.ty.shape]).astype(str(p.ty.dtype))
        for p in _kernel(case).params
    ]


@functools.cache
def _reference(case: str) -> np.ndarray:
    return _run(_kernel(case), "llvm", list(_inputs(case)))


# --------------------------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", cs.EPILOGUE_MODES)
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("case", CASES)
def test_scheduled_kernel_matches_the_unscheduled_one(case, chip, mode):
    chip = chips.get(chip)
    func = _kernel(case)
    scheduled = cs.schedule(func, chip, epilogue=mode)
    assert scheduled.attrs["tirx.is_scheduled"]
    out = _run(scheduled, _host_target(chip), list(_inputs(case)))
    np.testing.assert_allclose(out, _reference(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chip", CHIPS)
def test_a_flattened_output_is_cached_and_written_within_its_bounds(chip):
    """The register-tile cache of an output whose rows are flattened spans the output, not the
    tiles' relaxed region: cached after the tiling it had rows past the last (18 for a 3x3 map),
    and its write-back stored them beyond the output, where parallel chunks raced (a data race
    at two threads, heap corruption past the buffer's end; one thread hid both)."""
    func = _kernel("sum_of_stack")
    assert cs.analyze(func).pointwise and not cs.analyze(func).epilogue
    for mode in cs.EPILOGUE_MODES:
        script = cs.schedule(func, chip, epilogue=mode).script()
        locals_ = re.findall(r"sblock_alloc_buffer\(\(([\d, ]+)\), scope=\"local\"\)", script)
        assert locals_ == ["1, 64, 9"], (mode, locals_)


@pytest.mark.parametrize("chip", CHIPS)
def test_every_candidate_tile_is_correct(chip):
    func = _kernel("conv3x3_residual")
    anchor = cs.analyze(func)
    for tile in cs.candidate_tiles(anchor, chip):
        out = _run(cs.schedule(func, chip, tile), _host_target(chips.get(chip)),
                   list(_inputs("conv3x3_residual")))
        np.testing.assert_allclose(out, _reference("conv3x3_residual"), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_analyze_names_the_kernel(case):
    anchor = cs.analyze(_kernel(case))
    assert anchor.kind == CASES[case][1]
    assert anchor.flops > 0 and anchor.dtype == "float32"


def test_epilogue_operands_and_constants():
    plain = cs.analyze(_kernel("conv3x3_bias_relu"))
    residual = cs.analyze(_kernel("conv3x3_residual"))
    clip = cs.analyze(_kernel("depthwise_clip"))
    assert (plain.epilogue_operands, plain.epilogue_constants) == (1, 1)  # bias; relu's 0
    assert (residual.epilogue_operands, residual.epilogue_constants) == (2, 1)
    assert (clip.epilogue_operands, clip.epilogue_constants) == (1, 2)  # bias; 0 and 6
    assert plain.spatial == (1, 16, 10, 12) and plain.reduction == (8, 3, 3)
    assert plain.block == "conv2d_nchw" and len(plain.epilogue) == 2


def test_strides_and_pointwise_rows():
    assert cs.analyze(_kernel("conv1x1_stride2")).vec_stride == 2
    assert cs.analyze(_kernel("conv1x1_stride2")).pointwise
    assert cs.analyze(_kernel("conv1x1_tail")).pointwise
    assert not cs.analyze(_kernel("conv3x3_bias_relu")).pointwise
    assert not cs.analyze(_kernel("depthwise_clip")).shared_input


@pytest.mark.parametrize("chip", CHIPS)
def test_a_gemv_splits_its_reduction_across_the_cores(chip):
    """One output row: each core sums a contiguous slab of the reduction (rfactor), the
    partial sums are added up per vector; two rows, or a reduction the cores do not divide,
    keep the column tiles."""
    knobs = cs._Knobs.of(chips.get(chip), "float32")
    split = cs.schedule(_kernel("gemv_bias"), chip).script()
    assert cs.is_gemv(cs.analyze(_kernel("gemv_bias")), knobs.cores)
    assert f"T.parallel({knobs.cores})" in split and "_rf = " in split
    for case in ("matmul_bias", "gemv_odd_reduction"):
        assert not cs.is_gemv(cs.analyze(_kernel(case)), knobs.cores)
        assert "_rf = " not in cs.schedule(_kernel(case), chip).script()


def _allocations(func: tvm.tirx.PrimFunc) -> int:
    return func.script().count("alloc_buffer") - func.script().count('scope="local"')


@pytest.mark.parametrize("chip", CHIPS)
def test_a_blocked_pool_reads_its_padding_through_a_predicate(chip):
    """The blocked pool's vectors (channel blocks) are never padded: no padded or
    de-interleaved copy, one parallel nest; NCHW pools, whose vectors run along the padded
    width, keep their copies."""
    blocked = cs.schedule(_kernel("max_pool_blocked"), chip)
    assert _allocations(blocked) == 0 and blocked.script().count("T.parallel") == 1
    assert _allocations(cs.schedule(_kernel("max_pool_stride2"), chip)) == 2  # pad, phases
    assert _allocations(cs.schedule(_kernel("max_pool_stride1"), chip)) == 1  # pad


def _prim_funcs(mod: tvm.IRModule) -> dict[str, tvm.tirx.PrimFunc]:
    return {
        gv.name_hint: f for gv, f in PIPELINE(mod).functions.items()
        if isinstance(f, tvm.tirx.PrimFunc)
    }


def test_kernels_without_a_single_anchor_are_left_alone():
    funcs = _prim_funcs(function(
        [tensor_var("x", (2, 8, 6))],
        lambda bb, x: R.reshape(bb.emit(R.nn.softmax(x, axis=-1)), (16, 6)),
    ))
    assert funcs and all(cs.analyze(f) is None for f in funcs.values())
    softmax = next(f for name, f in funcs.items() if "softmax" in name)
    with pytest.raises(BNFoldError, match="reduction blocks"):
        cs.schedule(softmax, chips.get("avx2"))


def test_an_already_scheduled_kernel_is_left_alone():
    scheduled = cs.schedule(_kernel("conv3x3_bias_relu"), chips.get("avx2"))
    assert cs.analyze(scheduled) is None


def test_bad_mode_tile_and_chip_are_clear_errors():
    func = _kernel("conv3x3_bias_relu")
    with pytest.raises(BNFoldError, match="unknown epilogue mode"):
        cs.schedule(func, chips.get("avx2"), epilogue="inline")
    with pytest.raises(BNFoldError, match="does not fit"):
        cs.schedule(func, chips.get("avx2"), cs.Tile(vec=8, rows=5, lanes=8))
    with pytest.raises(BNFoldError, match="multiple of the chip's 8 lanes"):
        cs.schedule(func, chips.get("avx2"), cs.Tile(vec=16, rows=2, lanes=16))
    with pytest.raises(BNFoldError, match="CPU schedule"):
        cs.schedule(func, chips.get("cuda-sm80"))


# --------------------------------------------------------------------------------------------
# Structure: where the epilogue runs
# --------------------------------------------------------------------------------------------


def _loops(sch: tvm.s_tir.Schedule, block: str) -> list:
    return [sch.get(lp) for lp in sch.get_loops(sch.get_sblock(block))]


def _shared_loops(sch: tvm.s_tir.Schedule, a: str, b: str) -> list:
    shared = []
    for x, y in zip(_loops(sch, a), _loops(sch, b), strict=False):
        if not x.same_as(y):
            break
        shared.append(x)
    return shared


def _written_buffers(func: tvm.tirx.PrimFunc) -> list:
    blocks: list = []
    tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, blocks.append), order="post")
    return [w.source for b in blocks for w in b.writes]


@pytest.mark.parametrize("chip", CHIPS)
def test_register_mode_applies_the_epilogue_to_the_register_tile(chip):
    func = _kernel("conv3x3_residual")
    anchor = cs.analyze(func)
    scheduled = cs.schedule(func, chip, epilogue="register")
    sch = tvm.s_tir.Schedule(scheduled)
    update, last = f"{anchor.block}_update", anchor.epilogue[-1]
    # The epilogue sits under the register-tile loop, inside the parallel loop, next to the
    # reduction: it shares every loop of the update block down to the tile.
    shared = _shared_loops(sch, update, last)
    assert len(shared) >= 2 and shared[0].kind == tvm.tirx.ForKind.PARALLEL
    assert shared[-1].kind == tvm.tirx.ForKind.SERIAL
    # The accumulators are a local cache; the output is written once, by the epilogue, and no
    # global intermediate of the conv output is left.
    acc = sch.get(sch.get_sblock(update)).writes[0].source
    assert acc.scope() == "local"
    written = _written_buffers(scheduled)
    output = scheduled.params[-1]
    assert sum(b.same_as(output) for b in written) == 1
    same_shape = {b.name: b.scope() for b in written if b.shape == output.ty.shape}
    assert sorted(same_shape.values()) == ["global", "local"]  # the output and the tile
    # Vector lanes of the chip on the innermost loops.
    lanes = chips.get(chip).lanes()
    inner = _loops(sch, last)[-1]
    assert inner.kind == tvm.tirx.ForKind.VECTORIZED and int(inner.extent) == lanes


def test_cache_mode_runs_the_epilogue_per_cache_block():
    func = _kernel("conv3x3_residual")
    anchor = cs.analyze(func)
    sch = tvm.s_tir.Schedule(cs.schedule(func, chips.get("avx2"), epilogue="cache"))
    shared = _shared_loops(sch, f"{anchor.block}_update", anchor.epilogue[-1])
    assert len(shared) == 1 and shared[0].kind == tvm.tirx.ForKind.PARALLEL
    writeback = f"{sch.get(sch.get_sblock(f'{anchor.block}_update')).writes[0].source.name}"
    assert writeback.endswith("_local")


def test_separate_mode_runs_the_epilogue_after_the_whole_conv():
    func = _kernel("conv3x3_residual")
    anchor = cs.analyze(func)
    sch = tvm.s_tir.Schedule(cs.schedule(func, chips.get("avx2"), epilogue="separate"))
    assert _shared_loops(sch, f"{anchor.block}_update", anchor.epilogue[-1]) == []
    assert _loops(sch, anchor.epilogue[-1])[0].kind == tvm.tirx.ForKind.PARALLEL


# --------------------------------------------------------------------------------------------
# Register tiles
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("case", ["conv3x3_residual", "conv1x1_tail", "depthwise_clip"])
def test_candidate_tiles_are_largest_first_and_fit(case, chip):
    anchor = cs.analyze(_kernel(case))
    tiles = cs.candidate_tiles(anchor, chip)
    acc = [t.accumulators for t in tiles]
    assert len(tiles) >= 2 and acc == sorted(acc, reverse=True) and acc[-1] < acc[0]
    assert len(set(tiles)) == len(tiles)
    lanes = chips.get(chip).lanes()
    assert all(t.vec % lanes == 0 and t.lanes == lanes for t in tiles)
    assert all(cs.live_vector_registers(anchor, t, chip) <= static_budget(chip) for t in tiles)


def test_live_registers_grow_with_the_tile_and_the_epilogue():
    anchor, avx2 = cs.analyze(_kernel("conv3x3_bias_relu")), chips.get("avx2")
    small, large = cs.Tile(vec=8, rows=1, lanes=8), cs.Tile(vec=16, rows=4, hrows=2, lanes=8)
    assert large.accumulators == 16 and small.accumulators == 1
    assert cs.live_vector_registers(anchor, large, avx2) > cs.live_vector_registers(
        anchor, small, avx2)
    residual = dataclasses.replace(anchor, epilogue_operands=anchor.epilogue_operands + 1)
    clip = dataclasses.replace(anchor, epilogue_constants=anchor.epilogue_constants + 1)
    for more in (residual, clip):
        assert cs.live_vector_registers(more, large, avx2) == cs.live_vector_registers(
            anchor, large, avx2) + 1
    # The real residual kernel needs one register more than the plain one.
    with_residual = cs.analyze(_kernel("conv3x3_residual"))
    assert cs.live_vector_registers(with_residual, large, avx2) == cs.live_vector_registers(
        anchor, large, avx2) + 1
