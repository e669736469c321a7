"""schedules.injective: layout transforms get a parallel vectorized schedule; reductions and
scalars are left alone."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te

from _kernels import (
    CHIP,
    HERE,
    B,
    R,
    conv_module,
)
from _util import assert_close, function, run, tensor_var
from tvm_bnfold import schedules
from tvm_bnfold.fuse_epilogue import fuse_graph

pytestmark = pytest.mark.skipif(not HERE, reason="neither avx512 nor avx2 runs here")


@pytest.mark.parametrize("shape", [(1, 3 * B, 6, 10), (1, 2 * B, 1, 1)])
def test_layout_transforms_get_a_parallel_vectorized_schedule(shape):
    mod = function([tensor_var("x", shape)], lambda bb, x: R.layout_transform(
        bb.emit(R.nn.relu(bb.emit(R.layout_transform(
            x, lambda n, ch, h, w: (n, ch // B, h, w, ch % B))))),
        lambda n, co, h, w, ci: (n, co * B + ci, h, w)))
    x = np.random.default_rng(6).normal(size=shape).astype("float32")
    graph = fuse_graph(mod)
    for gvar, func in graph.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc):
            scheduled = schedules.schedule_injective(func, CHIP)
            assert scheduled is not None and scheduled.attrs["tirx.is_scheduled"]
            graph = graph.clone()
            graph.update_func(gvar, scheduled)
    assert_close(run(graph, x), x * (x > 0))


def test_injective_schedule_leaves_reductions_alone():
    mod, _ = conv_module(B, B)
    (func,) = [f for f in fuse_graph(mod).functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert schedules.schedule_injective(func, CHIP) is None


def test_a_scalar_kernel_is_left_alone():
    a = te.placeholder((), "float32", "a")
    func = te.create_prim_func([a, te.compute((), lambda: a() + 1.0, name="b")])
    assert schedules.schedule_injective(func, CHIP) is None
