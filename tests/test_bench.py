"""The measurements behind the reports: kernel counts and intermediate bytes on a small graph."""

import io
import os
import re
import time

import numpy as np
import pytest
import tvm
from tvm import relax

from _util import function, tensor_var
from tvm_bnfold import chips
from tvm_bnfold.bench import (
    COLUMNS,
    NOT_RUN,
    WARMUP,
    cell,
    fast_math_rows,
    fma_kernel,
    fma_peak,
    interleaved,
    intermediate_bytes,
    kernel_count,
    model_flops,
    parameter_bytes,
    sgemm_peak,
    variants,
)
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


def test_parameter_bytes_and_flops():
    mod = _two_convs()
    assert parameter_bytes(mod) == (2 * 4 * 4 + 4) * 4  # two 4x4x1x1 weights and a bias
    assert model_flops(mod) == 2 * 2 * (4 * 8 * 8) * 4  # two 1x1 convs: 4 MACs per output


def test_cells_say_not_run_instead_of_a_number():
    row = {"median_ms": None, "p90_ms": None, "latency": NOT_RUN, "kernels": 5}
    cells = {key: cell(row, key, fmt) for key, _, fmt in COLUMNS}
    assert cells["median_ms"] == NOT_RUN
    assert cells["p90_ms"] == cells["max_abs_err"] == "-"
    assert cells["kernels"] == "5"
    assert cell({"median_ms": 1234.56}, "median_ms", COLUMNS[0][2]) == "1234.6"


def test_sgemm_peak_is_positive():
    assert sgemm_peak(n=128, repeat=2) > 0


@pytest.mark.parametrize("name", [n for n in ("avx512", "avx2") if chips.get(n).runs_here])
def test_fma_peak_kernel_is_one_fma_per_step_and_computes_every_step(name):
    """The peak kernel is what it claims: one vector FMA per accumulator per step in the asm
    (not a multiply and an add), and every step runs (three steps of acc * 0.5 + 0.25)."""
    chip = chips.get(name)
    lanes, accumulators = chip.lanes(), chip.vector_regs // 2
    ex = tvm.compile(tvm.IRModule({"main": fma_kernel(lanes, accumulators, 3, 2)}),
                     target=chip.target)
    asm = ex.mod.inspect_source("asm")
    assert len(re.findall(r"vfmadd\w+ps", asm)) >= accumulators
    x = tvm.runtime.tensor(np.full(lanes, 0.5, np.float32))
    y = tvm.runtime.tensor(np.full(lanes, 0.25, np.float32))
    out = tvm.runtime.tensor(np.zeros((2, accumulators, lanes), np.float32))
    ex.jit()["main"](x, y, out)
    expected = np.arange(accumulators, dtype=np.float32)[:, None].repeat(lanes, axis=1)
    for _ in range(3):
        expected = expected * np.float32(0.5) + np.float32(0.25)
    np.testing.assert_array_equal(out.numpy(), np.stack([expected] * 2))
    assert fma_peak(chip, iters=1 << 12, repeat=2) > 0


def test_nchw_variant_only_where_ours_blocks():
    """CUDA compiles NCHW, so its 'nchw' variant would be 'ours' twice."""
    mod = _two_convs()
    for chip, expected in (("avx2", {"nchw", "ours"}), ("cuda-sm80", {"ours"})):
        found = variants(mod, chips.get(chip), schedule_baselines=False, measure=False,
                         baselines=("nchw",))
        assert set(found) == expected, chip


def test_interleaved_times_every_callable_in_each_round():
    order = []
    timed = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3)
    assert set(timed) == {"a", "b"}
    assert all(0 <= median <= p90 for median, p90 in timed.values())
    runs = WARMUP + 1
    assert order == (["a"] * runs + ["b"] * runs) * 3  # a, b, a, b, ... not a, a, a, b, b, b


def test_busy_neighbour_spins_on_one_core_while_the_block_runs():
    from tvm_bnfold.bench import busy_neighbour

    cpu = min(os.sched_getaffinity(0))
    with busy_neighbour(cpu) as proc:
        assert proc.is_alive() and os.sched_getaffinity(proc.pid) == {cpu}
        start = time.process_time()
        time.sleep(0.3)
        with open(f"/proc/{proc.pid}/stat") as stat:
            user_ticks = int(stat.read().rsplit(")", 1)[1].split()[11])
        assert user_ticks > 0  # it burns CPU, not this process
        assert time.process_time() - start < 0.1
    assert not proc.is_alive()


def test_fast_math_rows_time_exact_and_fast_epilogues_side_by_side():
    chip = chips.get(next(n for n in ("avx512", "avx2") if chips.PRESETS[n].runs_here))
    rows = fast_math_rows(chip, repeat=1, channels=16, size=8)
    assert [r[0] for r in rows] == ["sigmoid", "silu", "tanh"]
    for act, exact, fast, (d_exact, d_fast), diff in rows:
        assert exact > 0 and fast > 0 and diff < 1e-5, act
        assert d_exact == "separate"  # libm calls spill the register tile (the check measures it)
        if chip.name == "avx512":
            assert d_fast == "register", act


def test_corpus_table_has_each_runtime_and_the_geomean():
    from tvm_bnfold.bench import print_corpus

    rows = [dict(model="a", chip="avx2", kernels=5, stock_kernels=7, layout_kernels=0,
                 max_rel_err=1e-6, ours_ms=2.0, stock_ms=3.0, onnxruntime_ms=4.0),
            dict(model="b", chip="avx2", kernels=9, stock_kernels=9, layout_kernels=1,
                 max_rel_err=2e-6, ours_ms=4.0, stock_ms=4.0, onnxruntime_ms=2.0,
                 openvino_ms=1.0)]
    out = io.StringIO()
    print_corpus(rows, out)
    lines = out.getvalue().splitlines()
    assert lines[2].split("|")[1:-1] == [" a ", " 2 ", " - ", " 3 ", " 4 ", " - ", " 2.00x ",
                                         " - ", " 5 (7) ", " 0 ", " 1.0e-06 "]
    assert "| 0.50x | 0.25x | 9 (9) | 1 |" in lines[3]
    assert lines[-1] == "geomean ours vs ONNX Runtime: 1.00x over 2 models"
