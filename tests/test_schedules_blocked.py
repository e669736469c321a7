"""schedules.blocked: column tiles serial in each parallel chunk, the padding read through a
predicate where it pays and a padded copy where it does not."""

from __future__ import annotations

import pytest
import tvm
from tvm import s_tir

from _kernels import (
    AVX512,
    CHIP,
    HERE,
    B,
    blocked_tile,
    conv_kernel,
    stem_module,
)
from _util import assert_close, run
from tvm_bnfold import chips, schedules
from tvm_bnfold.blocked_layout import CONV_BLOCK
from tvm_bnfold.fuse_epilogue import fuse_graph
from tvm_bnfold.schedules.anchor import nodes

pytestmark = pytest.mark.skipif(not HERE, reason="neither avx512 nor avx2 runs here")


@pytest.mark.parametrize(("cout", "hw", "serial"), [(4 * B, 8, True), (B, 2, False)])
def test_column_tiles_run_serially_in_each_parallel_chunk(cout, hw, serial):
    """Parallel over (block group, output row), the column tiles of a row serial inside the
    chunk; with fewer than two such chunks per core the column tiles are chunks too."""
    mod, inputs, graph, gvar = conv_kernel(CHIP, cin=2 * B, cout=cout, hw=hw, residual=True)
    anchor = schedules.analyze(graph[gvar])
    scheduled = schedules.schedule(graph[gvar], CHIP, blocked_tile(CHIP, hw // 2))
    chunks = (cout // B) * hw  # batch 1, one block per group, one chunk per output row
    sch = s_tir.Schedule(scheduled)
    outer = sch.get(sch.get_loops(sch.get_sblock(anchor.block + "_update"))[0])
    assert outer.kind == tvm.tirx.ForKind.PARALLEL
    assert int(outer.extent) == (chunks if serial else chunks * 2)
    assert serial == (chunks >= 2 * int(CHIP.target_config["num-cores"]))
    graph.update_func(gvar, scheduled)
    assert_close(run(graph, *inputs), run(mod, *inputs))


def _padded_copies(func: tvm.tirx.PrimFunc) -> int:
    script = func.script()
    return script.count("alloc_buffer") - script.count('scope="local"')


def _unpredicated_updates(func: tvm.tirx.PrimFunc) -> tuple[int, int]:
    """(updates of the register tile with no predicate, all updates) after LoopPartition."""
    passes = [s_tir.transform.LowerInitBlock(), s_tir.transform.ConvertBlocksToOpaque(),
              s_tir.transform.CompactBufferAllocation(), s_tir.transform.LowerOpaqueBlock(),
              tvm.tirx.transform.FlattenBuffer(), s_tir.transform.LoopPartition()]
    mod = tvm.ir.transform.Sequential(passes)(tvm.IRModule({"main": func}))
    stores = nodes(mod["main"].body, tvm.tirx.BufferStore)
    found = ["if_then_else" not in str(st.value) for st in stores if "local" in st.buffer.name]
    return sum(found), len(found)


@pytest.mark.parametrize(("stride", "pad", "dilation"), [(1, 1, 1), (2, 1, 1), (1, 2, 2)])
def test_a_3x3_conv_reads_its_padding_through_a_predicate(stride, pad, dilation):
    """No padded copy of the input: the serial column tiles and the kernel rows are split
    into border and interior parts, and the interior reads without a predicate."""
    b = AVX512.lanes()
    mod, inputs, graph, gvar = conv_kernel(AVX512, cin=2 * b, cout=2 * b, hw=16, stride=stride,
                                            pad=pad, dilation=dilation, residual=True)
    cols = schedules.analyze(graph[gvar]).spatial[3]
    scheduled = schedules.schedule(graph[gvar], AVX512, blocked_tile(AVX512, cols // 4))
    assert _padded_copies(scheduled) == 0
    interior, updates = _unpredicated_updates(scheduled)
    assert 0 < interior < updates
    if AVX512.runs_here:
        graph.update_func(gvar, scheduled)
        assert_close(run(graph, *inputs), run(mod, *inputs))


@pytest.mark.parametrize(("chip", "k", "rows"), [
    ("avx512", 3, 3),  # a tail tile: its hints would split the unrolled loops at the border
    ("avx512", 5, 4),  # 5x5: its border tiles spilled
    ("avx2", 3, 4),  # 16 registers: the kernel columns stay rolled
])
def test_other_dense_convs_keep_their_padded_copy(chip, k, rows):
    chip = chips.get(chip)
    b = chip.lanes()
    *_, graph, gvar = conv_kernel(chip, cin=2 * b, cout=2 * b, hw=16, k=k, pad=k // 2)
    assert _padded_copies(schedules.schedule(graph[gvar], chip, blocked_tile(chip, rows))) == 1


def test_the_stem_keeps_its_padded_copy():
    mod, _ = stem_module(pool=False)
    with AVX512.target:
        graph = fuse_graph(mod, AVX512.lanes())
    (stem,) = [f for g, f in graph.functions.items() if CONV_BLOCK in g.name_hint
               and schedules.analyze(f).reduction[-1] == 3]  # RGB: fewer than a vector
    assert _padded_copies(schedules.schedule(stem, AVX512)) == 1
