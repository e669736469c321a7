"""schedules.tiles: candidate tiles (order, fit, the blocked tiles of 16- and 32-register chips)
and the live-register estimate the register-pressure check compares with the budget."""

from __future__ import annotations

import dataclasses

import pytest
import tvm

from _kernels import (
    CHIP,
    CHIPS,
    B,
    blocked_kernel,
    case_kernel,
    conv_module,
)
from tvm_bnfold import chips, schedules
from tvm_bnfold.blocked_layout import CONV_BLOCK
from tvm_bnfold.fuse_epilogue import choose_schedule, fuse_graph
from tvm_bnfold.register_pressure import static_budget
from tvm_bnfold.schedules import Tile
from tvm_bnfold.schedules import live_vector_registers as live


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("case", ["conv3x3_residual", "conv1x1_tail", "depthwise_clip"])
def test_candidate_tiles_are_largest_first_and_fit(case, chip):
    anchor = schedules.analyze(case_kernel(case))
    tiles = schedules.candidate_tiles(anchor, chip)
    acc = [t.accumulators for t in tiles]
    assert len(tiles) >= 2 and acc == sorted(acc, reverse=True) and acc[-1] < acc[0]
    assert len(set(tiles)) == len(tiles)
    lanes = chips.get(chip).lanes()
    assert all(t.vec % lanes == 0 and t.lanes == lanes for t in tiles)
    assert all(live(anchor, t, chip) <= static_budget(chip) for t in tiles)


def test_live_registers_grow_with_the_tile_and_the_epilogue():
    anchor, avx2 = schedules.analyze(case_kernel("conv3x3_bias_relu")), chips.get("avx2")
    small, large = Tile(vec=8, rows=1, lanes=8), Tile(vec=16, rows=4, hrows=2, lanes=8)
    assert large.accumulators == 16 and small.accumulators == 1
    assert live(anchor, large, avx2) > live(anchor, small, avx2)
    residual = dataclasses.replace(anchor, epilogue_operands=anchor.epilogue_operands + 1)
    clip = dataclasses.replace(anchor, epilogue_constants=anchor.epilogue_constants + 1)
    for more in (residual, clip):
        assert live(more, large, avx2) == live(anchor, large, avx2) + 1
    # The real residual kernel needs one register more than the plain one.
    with_residual = schedules.analyze(case_kernel("conv3x3_residual"))
    assert live(with_residual, large, avx2) == live(anchor, large, avx2) + 1


def test_blocked_tiles_fit_the_budget_and_an_oversized_one_is_rejected():
    func, anchor = blocked_kernel()
    assert anchor.blocked and (anchor.rows_axis, anchor.hrow_axis, anchor.vec_axis) == (3, 1, 4)
    tiles = schedules.candidate_tiles(anchor, CHIP)
    budget = schedules.register_budget(anchor, CHIP)
    assert budget == CHIP.vector_regs  # a blocked tile's estimate counts every register
    assert all(live(anchor, t, CHIP) <= budget for t in tiles)
    huge = schedules.Tile(vec=B, rows=14, hrows=4, lanes=B, block_rows=14)
    _, record = choose_schedule(func, anchor, CHIP, tiles=[huge, *tiles])
    need = live(anchor, huge, CHIP)
    assert f"{need} live vector registers > {budget} on {CHIP.name}" in record.rejected[0]
    assert record.decision == "register" and record.spill_moves == 0


@pytest.mark.parametrize("k", [3, 1])
def test_avx2_keeps_the_best_blocked_tile_without_spills(k):
    """16 registers: the best tile holds 12 accumulators, whose columns (3 or 6) do not divide
    28, so a tail tile is split off (divisors of 28 allow 8 at most: 2x4 ran 1.1-1.5x slower);
    all 16 registers are live and nothing spills in its loops. The kernel columns of a 3x3
    conv stay a loop (unrolled, LLVM kept the broadcasts they share live and spilled)."""
    avx2 = chips.get("avx2")
    mod, _ = conv_module(8 * 8, 8 * 8, hw=28, k=k, pad=k // 2, residual=True)
    with avx2.target:
        graph = fuse_graph(mod, avx2.lanes())
    (func,) = [f for g, f in graph.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc) and CONV_BLOCK in g.name_hint]
    anchor = schedules.analyze(func)
    best = schedules.candidate_tiles(anchor, avx2)[0]
    assert best.accumulators == 12 and 28 % best.rows
    _, record = choose_schedule(func, anchor, avx2)
    assert record.tile == str(best) and not record.rejected, record
    assert record.decision == "register" and record.spill_moves == 0
    assert record.registers <= record.budget == avx2.vector_regs


def test_a_32_register_chip_keeps_tiles_that_divide_the_columns():
    avx512 = chips.get("avx512")
    mod, _ = conv_module(4 * 16, 4 * 16, hw=28)
    with avx512.target:
        graph = fuse_graph(mod, avx512.lanes())
    (func,) = [f for g, f in graph.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc) and CONV_BLOCK in g.name_hint]
    anchor = schedules.analyze(func)
    assert all(28 % t.rows == 0 for t in schedules.candidate_tiles(anchor, avx512))
