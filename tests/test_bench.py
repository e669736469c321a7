"""The measurements behind the reports: kernel counts and intermediate bytes on a small graph."""

import numpy as np
from tvm import relax

from _util import function, tensor_var
from tvm_bnfold.bench import intermediate_bytes, kernel_count
from tvm_bnfold.fuse_epilogue import fuse_graph

R = relax.op


def _two_convs():
    """x -> conv -> +b -> relu -> conv: 4 ops; fused, 2 kernels."""
    rng = np.random.default_rng(0)
    w1, w2 = (relax.const(rng.normal(size=(4, 4, 1, 1)).astype("float32")) for _ in range(2))
    b = relax.const(rng.normal(size=(1, 4, 1, 1)).astype("float32"))

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.add(bb.emit(R.nn.conv2d(x, w1)), b))))
        return R.nn.conv2d(y, w2)

    return function([tensor_var("x", (1, 4, 8, 8))], body)


def test_kernel_count_unfused_and_fused():
    mod = _two_convs()
    assert kernel_count(mod) == 4
    assert kernel_count(fuse_graph(mod)) == 2


def test_intermediate_bytes_counts_one_write_and_each_read():
    tensor = 4 * 8 * 8 * 4  # one (1, 4, 8, 8) float32 tensor
    # Unfused: conv -> add -> relu -> conv hands over 3 tensors, each written once and read once.
    assert intermediate_bytes(relax.transform.LegalizeOps()(_two_convs())) == 3 * 2 * tensor
    # Fused: only the relu output goes from the first kernel to the second.
    assert intermediate_bytes(fuse_graph(_two_convs())) == 2 * tensor
