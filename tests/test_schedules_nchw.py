"""schedules.nchw: a flattened output stays in bounds, a GEMV splits its reduction, a blocked
pool reads its padding through a predicate."""

from __future__ import annotations

import re

import pytest
import tvm

from _kernels import (
    CHIPS,
    case_kernel,
)
from tvm_bnfold import chips, schedules
from tvm_bnfold.schedules.tiles import Knobs


@pytest.mark.parametrize("chip", CHIPS)
def test_a_flattened_output_is_cached_and_written_within_its_bounds(chip):
    """The register-tile cache of an output whose rows are flattened spans the output, not the
    tiles' relaxed region: cached after the tiling it had rows past the last (18 for a 3x3 map),
    and its write-back stored them beyond the output, where parallel chunks raced (a data race
    at two threads, heap corruption past the buffer's end; one thread hid both)."""
    func = case_kernel("sum_of_stack")
    assert schedules.analyze(func).pointwise and not schedules.analyze(func).epilogue
    for mode in schedules.EPILOGUE_MODES:
        script = schedules.schedule(func, chip, epilogue=mode).script()
        locals_ = re.findall(r"sblock_alloc_buffer\(\(([\d, ]+)\), scope=\"local\"\)", script)
        assert locals_ == ["1, 64, 9"], (mode, locals_)


@pytest.mark.parametrize("chip", CHIPS)
def test_a_gemv_splits_its_reduction_across_the_cores(chip):
    """One output row: each core sums a contiguous slab of the reduction (rfactor), the
    partial sums are added up per vector; two rows, or a reduction the cores do not divide,
    keep the column tiles."""
    knobs = Knobs.of(chips.get(chip), "float32")
    split = schedules.schedule(case_kernel("gemv_bias"), chip).script()
    assert schedules.is_gemv(schedules.analyze(case_kernel("gemv_bias")), knobs.cores)
    assert f"T.parallel({knobs.cores})" in split and "_rf = " in split
    for case in ("matmul_bias", "gemv_odd_reduction"):
        assert not schedules.is_gemv(schedules.analyze(case_kernel(case)), knobs.cores)
        assert "_rf = " not in schedules.schedule(case_kernel(case), chip).script()


def _allocations(func: tvm.tirx.PrimFunc) -> int:
    return func.script().count("alloc_buffer") - func.script().count('scope="local"')


@pytest.mark.parametrize("chip", CHIPS)
def test_a_blocked_pool_reads_its_padding_through_a_predicate(chip):
    """The blocked pool's vectors (channel blocks) are never padded: no padded or
    de-interleaved copy, one parallel nest; NCHW pools, whose vectors run along the padded
    width, keep their copies."""
    blocked = schedules.schedule(case_kernel("max_pool_blocked"), chip)
    assert _allocations(blocked) == 0 and blocked.script().count("T.parallel") == 1
    stride2 = schedules.schedule(case_kernel("max_pool_stride2"), chip)
    assert _allocations(stride2) == 2  # pad, phases
    assert _allocations(schedules.schedule(case_kernel("max_pool_stride1"), chip)) == 1  # pad
