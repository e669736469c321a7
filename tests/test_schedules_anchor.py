"""schedules.anchor: what analyze reads off a kernel (kind, epilogue operands and constants,
strides, pointwise rows, the roles of a blocked conv)."""

from __future__ import annotations

import pytest

from _kernels import (
    CASES,
    case_kernel,
)
from tvm_bnfold import schedules


@pytest.mark.parametrize("case", CASES)
def test_analyze_names_the_kernel(case):
    anchor = schedules.analyze(case_kernel(case))
    assert anchor.kind == CASES[case][1]
    assert anchor.flops > 0 and anchor.dtype == "float32"


def test_epilogue_operands_and_constants():
    plain = schedules.analyze(case_kernel("conv3x3_bias_relu"))
    residual = schedules.analyze(case_kernel("conv3x3_residual"))
    clip = schedules.analyze(case_kernel("depthwise_clip"))
    assert (plain.epilogue_operands, plain.epilogue_constants) == (1, 1)  # bias; relu's 0
    assert (residual.epilogue_operands, residual.epilogue_constants) == (2, 1)
    assert (clip.epilogue_operands, clip.epilogue_constants) == (1, 2)  # bias; 0 and 6
    assert plain.spatial == (1, 16, 10, 12) and plain.reduction == (8, 3, 3)
    assert plain.block == "conv2d_nchw" and len(plain.epilogue) == 2


def test_strides_and_pointwise_rows():
    assert schedules.analyze(case_kernel("conv1x1_stride2")).vec_stride == 2
    assert schedules.analyze(case_kernel("conv1x1_stride2")).pointwise
    assert schedules.analyze(case_kernel("conv1x1_tail")).pointwise
    assert not schedules.analyze(case_kernel("conv3x3_bias_relu")).pointwise
    assert not schedules.analyze(case_kernel("depthwise_clip")).shared_input
