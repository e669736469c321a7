"""schedules (the entry point): numerics of every kernel, chip and epilogue mode against the
unscheduled kernel, where each mode puts the epilogue, and the kernels and inputs it must refuse."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi

from _kernels import (
    CASES,
    CHIP,
    CHIPS,
    PIPELINE,
    B,
    R,
    blocked_tile,
    case_inputs,
    case_kernel,
    case_reference,
    conv_kernel,
    conv_module,
    host_target,
    run_func,
)
from _util import assert_close, function, run, tensor_var
from tvm_bnfold import BNFoldError, chips, schedules
from tvm_bnfold.blocked_layout import CONV_BLOCK
from tvm_bnfold.fuse_epilogue import fuse_graph


@pytest.mark.parametrize("mode", schedules.EPILOGUE_MODES)
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("case", CASES)
def test_scheduled_kernel_matches_the_unscheduled_one(case, chip, mode):
    chip = chips.get(chip)
    func = case_kernel(case)
    scheduled = schedules.schedule(func, chip, epilogue=mode)
    assert scheduled.attrs["tirx.is_scheduled"]
    out = run_func(scheduled, host_target(chip), list(case_inputs(case)))
    np.testing.assert_allclose(out, case_reference(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chip", CHIPS)
def test_every_candidate_tile_is_correct(chip):
    func = case_kernel("conv3x3_residual")
    anchor = schedules.analyze(func)
    for tile in schedules.candidate_tiles(anchor, chip):
        out = run_func(schedules.schedule(func, chip, tile), host_target(chips.get(chip)),
                   list(case_inputs("conv3x3_residual")))
        np.testing.assert_allclose(out, case_reference("conv3x3_residual"), rtol=1e-5, atol=1e-5)


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
    assert funcs and all(schedules.analyze(f) is None for f in funcs.values())
    softmax = next(f for name, f in funcs.items() if "softmax" in name)
    with pytest.raises(BNFoldError, match="reduction blocks"):
        schedules.schedule(softmax, chips.get("avx2"))


def test_an_already_scheduled_kernel_is_left_alone():
    scheduled = schedules.schedule(case_kernel("conv3x3_bias_relu"), chips.get("avx2"))
    assert schedules.analyze(scheduled) is None


def test_bad_mode_tile_and_chip_are_clear_errors():
    func = case_kernel("conv3x3_bias_relu")
    with pytest.raises(BNFoldError, match="unknown epilogue mode"):
        schedules.schedule(func, chips.get("avx2"), epilogue="inline")
    with pytest.raises(BNFoldError, match="does not fit"):
        schedules.schedule(func, chips.get("avx2"), schedules.Tile(vec=8, rows=5, lanes=8))
    with pytest.raises(BNFoldError, match="multiple of the chip's 8 lanes"):
        schedules.schedule(func, chips.get("avx2"), schedules.Tile(vec=16, rows=2, lanes=16))
    with pytest.raises(BNFoldError, match="CPU schedule"):
        schedules.schedule(func, chips.get("cuda-sm80"))


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
    func = case_kernel("conv3x3_residual")
    anchor = schedules.analyze(func)
    scheduled = schedules.schedule(func, chip, epilogue="register")
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
    func = case_kernel("conv3x3_residual")
    anchor = schedules.analyze(func)
    sch = tvm.s_tir.Schedule(schedules.schedule(func, chips.get("avx2"), epilogue="cache"))
    shared = _shared_loops(sch, f"{anchor.block}_update", anchor.epilogue[-1])
    assert len(shared) == 1 and shared[0].kind == tvm.tirx.ForKind.PARALLEL
    writeback = f"{sch.get(sch.get_sblock(f'{anchor.block}_update')).writes[0].source.name}"
    assert writeback.endswith("_local")


def test_separate_mode_runs_the_epilogue_after_the_whole_conv():
    func = case_kernel("conv3x3_residual")
    anchor = schedules.analyze(func)
    sch = tvm.s_tir.Schedule(schedules.schedule(func, chips.get("avx2"), epilogue="separate"))
    assert _shared_loops(sch, f"{anchor.block}_update", anchor.epilogue[-1]) == []
    assert _loops(sch, anchor.epilogue[-1])[0].kind == tvm.tirx.ForKind.PARALLEL


@pytest.mark.parametrize("epilogue", ["register", "cache", "separate"])
def test_every_epilogue_level_of_a_blocked_conv_is_exact(epilogue):
    mod, inputs = conv_module(2 * B, 2 * B, hw=10, residual=True)
    with CHIP.target:
        graph = fuse_graph(mod, B)
    graph = graph.clone()
    for gvar, func in list(graph.functions.items()):
        if isinstance(func, tvm.tirx.PrimFunc) and CONV_BLOCK in gvar.name_hint:
            anchor = schedules.analyze(func)
            tile = schedules.candidate_tiles(anchor, CHIP)[0]
            graph.update_func(gvar, schedules.schedule(func, CHIP, tile, epilogue))
    assert_close(run(graph, *inputs), run(mod, *inputs))


@pytest.mark.parametrize("epilogue", ["register", "cache", "separate"])
@pytest.mark.parametrize("shape", [(3, 2), (4, 1), (7, 2)])
def test_a_tail_tile_is_exact(epilogue, shape):
    """Column tiles that leave a tail of 1, 2 or 3 columns (10 = 3 * 3 + 1 = 4 * 2 + 2 =
    7 + 3), at every epilogue level."""
    mod, inputs, graph, gvar = conv_kernel(CHIP, cin=2 * B, cout=2 * B, hw=10, residual=True)
    scheduled = schedules.schedule(graph[gvar], CHIP, blocked_tile(CHIP, *shape), epilogue)
    graph.update_func(gvar, scheduled)
    assert_close(run(graph, *inputs), run(mod, *inputs))
