"""schedules.spaces: the design spaces of a blocked conv sample its tile and stay exact."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import s_tir

from _kernels import (
    CHIP,
    HERE,
    B,
    blocked_kernel,
    conv_module,
)
from _util import assert_close
from tvm_bnfold import schedules
from tvm_bnfold.fuse_epilogue import fuse_graph

pytestmark = pytest.mark.skipif(not HERE, reason="neither avx512 nor avx2 runs here")


def test_design_spaces_sample_the_tile_and_stay_exact():
    func, anchor = blocked_kernel(hw=8)
    spaces = schedules.design_spaces(s_tir.Schedule(func), CHIP)
    sampled = [s for s in spaces if schedules.sampled_tile(s, anchor, CHIP) is not None]
    assert len(sampled) == 2  # epilogue on the register tile, on the stored tile
    # The rest: one fixed schedule per candidate tile with a tail (16-register chips) and level.
    tails = [t for t in schedules.candidate_tiles(anchor, CHIP) if anchor.spatial[3] % t.rows]
    assert len(spaces) == 2 * (1 + len(tails))
    x = np.random.default_rng(7).normal(size=[int(d) for d in func.params[0].ty.shape])
    args = [x.astype("float32")] + [
        np.random.default_rng(i).normal(size=[int(d) for d in p.ty.shape]).astype("float32")
        for i, p in enumerate(func.params[1:-1])]
    reference = _run_prim(func, args)
    for space in sampled:
        assert anchor.spatial[3] % schedules.sampled_tile(space, anchor, CHIP).rows == 0
    for space in spaces:
        assert_close(_run_prim(space.mod["main"], args), reference)
    unblocked_mod, _ = conv_module(B, B, hw=6, k=1, pad=0)
    (nchw,) = [f for f in fuse_graph(unblocked_mod).functions.values()
               if isinstance(f, tvm.tirx.PrimFunc)]
    assert schedules.design_spaces(s_tir.Schedule(nchw), CHIP) is None


def _run_prim(func, args):
    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         target=CHIP.target)
    out_param = func.params[-1]
    out = tvm.runtime.tensor(np.zeros([int(d) for d in out_param.ty.shape], "float32"))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()
