"""blocked_layout and the blocked conv schedule: numerics of every conv form against the NCHW
module compiled by TVM, where layout transforms remain, the clip raising and channel padding
(and the cases they must leave alone), the injective schedule, the register check and the
tuning design spaces of blocked convs."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import relax, s_tir, te, topi

from _util import assert_close, function, run, tensor_var
from tvm_bnfold import FuseEpilogue, chips, conv_schedule
from tvm_bnfold.bench import kernel_count, layout_kernel_count, op_counts
from tvm_bnfold.blocked_layout import CONV_BLOCK, DEPTHWISE_BLOCK, to_blocked
from tvm_bnfold.fuse_epilogue import choose_schedule, fuse_graph

R = relax.op
HERE = [c for c in ("avx512", "avx2") if chips.get(c).runs_here]
pytestmark = pytest.mark.skipif(not HERE, reason="neither avx512 nor avx2 runs here")
CHIP = chips.get(HERE[-1])  # avx2 where it runs: 8-channel blocks keep the shapes small
B = CHIP.lanes()


def _w(rng, *shape, scale=0.3):
    return relax.const(rng.normal(0, scale, shape).astype("float32"))


def conv_module(cin, cout, hw=9, k=3, stride=1, pad=1, dilation=1, groups=1, act="relu",
                residual=False, seed=0):
    """x -> conv2d -> + bias [-> + residual] -> act, NCHW."""
    rng = np.random.default_rng(seed)
    w = _w(rng, cout, cin // groups, k, k)
    b = _w(rng, 1, cout, 1, 1, scale=0.5)
    out = (hw + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    params = [tensor_var("x", (1, cin, hw, hw))]
    if residual:
        params.append(tensor_var("r", (1, cout, out, out)))

    def body(bb, x, *res):
        y = bb.emit(R.nn.conv2d(x, w, strides=stride, padding=pad, dilation=dilation,
                                groups=groups))
        y = bb.emit(R.add(y, b))
        if residual:
            y = bb.emit(R.add(y, res[0]))
        return {"relu": R.nn.relu, "relu6": lambda v: R.clip(v, 0, 6),
                "none": lambda v: v}[act](y)

    inputs = [rng.normal(size=[int(d) for d in p.ty.shape.values]).astype("float32")
              for p in params]
    return function(params, body), inputs


def fused(mod, chip=CHIP, **kwargs):
    fuse = FuseEpilogue(chip, **{"blocked": True, **kwargs})
    with chip.target:
        return fuse(mod), fuse.report


def kernel_names(mod) -> list[str]:
    return [g.name_hint for g, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]


# --------------------------------------------------------------------------------------------
# Numerics of the blocked convs (FuseEpilogue: layout, legalization, default schedule)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chip", HERE)
@pytest.mark.parametrize("case", [
    dict(cin=2 * 8, cout=2 * 8),
    dict(cin=16, cout=32, k=1, pad=0),
    dict(cin=16, cout=16, stride=2),
    dict(cin=16, cout=16, k=1, pad=0, stride=2),
    dict(cin=16, cout=16, dilation=2, pad=2),
    dict(cin=32, cout=16, k=5, pad=2, act="relu6"),
    dict(cin=16, cout=16, residual=True),
    dict(cin=16, cout=16, act="none"),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_blocked_conv_matches_nchw(chip, case):
    chip = chips.get(chip)
    mod, inputs = conv_module(**case)
    out, report = fused(mod, chip)
    assert any(CONV_BLOCK in n for n in kernel_names(out))
    (record,) = report
    assert record.decision in ("register", "cache") and record.spill_moves == 0
    assert_close(run(out, *inputs), run(mod, *inputs))


@pytest.mark.parametrize("chip", HERE)
@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_conv_is_blocked_and_exact(chip, stride):
    chip = chips.get(chip)
    mod, inputs = conv_module(32, 32, hw=14, groups=32, stride=stride, act="relu6")
    out, report = fused(mod, chip)
    assert any(DEPTHWISE_BLOCK in n for n in kernel_names(out))
    assert report[0].ops[0] == "depthwise_conv2d"
    assert_close(run(out, *inputs), run(mod, *inputs))


def test_grouped_conv_ends_the_region_and_says_why():
    """groups=2 has no blocked compute here: the conv runs in NCHW, the numbers stay."""
    mod, inputs = conv_module(2 * B, 2 * B, groups=2)
    blocked, records = to_blocked(mod, B)
    assert not any(CONV_BLOCK in n or DEPTHWISE_BLOCK in n for n in kernel_names(blocked))
    (record,) = records
    assert (record.op, record.count) == ("relax.nn.conv2d", 1)
    assert "groups=2" in str(record) and "region ends" in str(record)
    assert_close(run(blocked, *inputs), run(mod, *inputs))


def test_fp16_blocked_conv():
    rng = np.random.default_rng(3)
    w = relax.const(rng.normal(0, 0.2, (B, B, 3, 3)).astype("float16"))
    mod = function([tensor_var("x", (1, B, 8, 8), "float16")],
                   lambda bb, x: R.nn.relu(bb.emit(R.nn.conv2d(x, w, padding=1))))
    x = rng.normal(size=(1, B, 8, 8)).astype("float16")
    out, _ = fused(mod)
    assert any(CONV_BLOCK in n for n in kernel_names(out))
    np.testing.assert_allclose(run(out, x).astype("float32"), run(mod, x).astype("float32"),
                               rtol=1e-2, atol=1e-2)


def test_blocked_false_keeps_nchw():
    mod, inputs = conv_module(16, 16)
    out, _ = fused(mod, blocked=False)
    assert layout_kernel_count(out) == 0
    assert not any("NCHWc" in n for n in kernel_names(out))
    assert_close(run(out, *inputs), run(mod, *inputs))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cin=st.sampled_from([B, 2 * B, 3 * B, 12]),
    cout=st.sampled_from([B, 2 * B, 24]),
    k=st.sampled_from([1, 3]),
    stride=st.sampled_from([1, 2]),
    depthwise=st.booleans(),
    act=st.sampled_from(["relu", "relu6", "none"]),
    hw=st.integers(5, 12),
)
def test_property_blocked_conv_matches_nchw(cin, cout, k, stride, depthwise, act, hw):
    """Any of these convs, blocked or not (12 and 24 channels do not divide 16), depthwise or
    not, through FuseEpilogue equals the NCHW module."""
    if depthwise:
        cout = cin
    mod, inputs = conv_module(cin, cout, hw=hw, k=k, stride=stride, pad=k // 2,
                              groups=cin if depthwise else 1, act=act)
    out, _ = fused(mod, measure=False)
    assert_close(run(out, *inputs), run(mod, *inputs))


# --------------------------------------------------------------------------------------------
# Graph level: where layout transforms remain
# --------------------------------------------------------------------------------------------


def chain_module(c=2 * 8, mid=2 * 8, hw=8, seed=0):
    """x -> conv -> relu -> conv -> + x-path residual -> relu -> conv(1x1): three convs."""
    rng = np.random.default_rng(seed)
    w1, w2, w3 = _w(rng, mid, c, 3, 3), _w(rng, mid, mid, 3, 3), _w(rng, c, mid, 1, 1)
    b1, b2 = _w(rng, 1, mid, 1, 1), _w(rng, 1, mid, 1, 1)

    def body(bb, x):
        y1 = bb.emit(R.nn.relu(bb.emit(R.add(bb.emit(R.nn.conv2d(x, w1, padding=1)), b1))))
        y2 = bb.emit(R.add(bb.emit(R.nn.conv2d(y1, w2, padding=1)), b2))
        y3 = bb.emit(R.nn.relu(bb.emit(R.add(y2, y1))))
        return R.nn.conv2d(y3, w3)

    x = rng.normal(size=(1, c, hw, hw)).astype("float32")
    return function([tensor_var("x", x.shape)], body), x


def test_a_conv_chain_has_transforms_only_at_its_ends():
    mod, x = chain_module(c=2 * B, mid=2 * B)
    out, report = fused(mod)
    assert len(report) == 3 and all(r.ops[0] == "conv2d" for r in report)
    assert layout_kernel_count(out) == 2  # x into the blocked layout, the result out of it
    assert kernel_count(out) == 5
    assert_close(run(out, x), run(mod, x))


@pytest.mark.parametrize("second", [B, B // 2])
def test_a_channel_concat_of_convs(second):
    """Two convs concatenated along the channels (a YOLO / Inception join), then a conv and a
    global average pool: blocked where the channel counts allow, always the same numbers."""
    rng = np.random.default_rng(11)
    w1, w2, w3 = _w(rng, B, B, 3, 3), _w(rng, second, B, 1, 1), _w(rng, B, B + second, 1, 1)

    def body(bb, x):
        a = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w1, padding=1))))
        b = bb.emit(R.nn.conv2d(x, w2))
        y = bb.emit(R.nn.conv2d(bb.emit(R.concat([a, b], axis=1)), w3))
        return R.mean(y, axis=[2, 3], keepdims=True)

    mod = function([tensor_var("x", (1, B, 6, 6))], body)
    x = rng.normal(size=(1, B, 6, 6)).astype("float32")
    out, _ = fused(mod)
    assert_close(run(out, x), run(mod, x))


def test_channel_padding_keeps_a_region_blocked():
    """mid = 1.5 blocks (24 channels on avx512, as in MobileNetV2): the producing convs get zero
    filters, the consumer zero weights; no transform inside the chain, the same numbers."""
    mod, x = chain_module(c=2 * B, mid=B + B // 2)
    out, _ = fused(mod)
    assert layout_kernel_count(out) == 2
    assert all("NCHWc" in n for n in kernel_names(out) if n.startswith("fused_"))
    assert_close(run(out, x), run(mod, x))


def test_a_padded_tensor_read_by_another_op_gets_a_slice():
    """The 12-channel conv output also feeds a max pool and is returned: both read exactly the
    12 real channels."""
    rng = np.random.default_rng(2)
    w1, w2 = _w(rng, 12, B, 3, 3), _w(rng, B, 12, 1, 1)

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w1, padding=1))))
        z = bb.emit(R.nn.conv2d(y, w2))
        return relax.Tuple([z, bb.emit(R.nn.max_pool2d(y, 2, 2)), y])

    mod = function([tensor_var("x", (1, B, 8, 8))], body)
    x = rng.normal(size=(1, B, 8, 8)).astype("float32")
    blocked, _ = to_blocked(mod, B)
    shapes = [[int(d) for d in f.shape.values] for f in blocked["main"].ret_ty.fields]
    assert shapes == [[1, B, 8, 8], [1, 12, 4, 4], [1, 12, 8, 8]]
    for got, want in zip(_run_tuple(blocked, x), _run_tuple(mod, x), strict=True):
        assert_close(got, want)


def test_a_padded_region_ending_in_the_output_binding():
    """The function returns relu(conv(y) + y) of 12 channels directly: the output binding reads
    a slice, the padded region stays inside the dataflow block."""
    rng = np.random.default_rng(9)
    w1, w2 = _w(rng, 12, B, 3, 3), _w(rng, 12, 12, 1, 1)

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w1, padding=1))))
        return R.nn.relu(bb.emit(R.add(bb.emit(R.nn.conv2d(y, w2)), y)))

    mod = function([tensor_var("x", (1, B, 6, 6))], body)
    x = rng.normal(size=(1, B, 6, 6)).astype("float32")
    blocked, _ = to_blocked(mod, B)
    assert [int(d) for d in blocked["main"].ret_ty.shape.values] == [1, 12, 6, 6]
    assert_close(run(blocked, x), run(mod, x))


def test_a_region_through_an_unsafe_op_is_not_padded():
    """exp is not on the list of ops that keep a padded channel finite: the 12-channel tensors
    stay unpadded (NCHW between layout transforms), the numbers stay."""
    rng = np.random.default_rng(4)
    w1, w2 = _w(rng, 12, B, 3, 3), _w(rng, B, 12, 1, 1)

    def body(bb, x):
        y = bb.emit(R.exp(bb.emit(R.nn.conv2d(x, w1, padding=1))))
        return R.nn.conv2d(y, w2)

    mod = function([tensor_var("x", (1, B, 8, 8))], body)
    x = rng.normal(size=(1, B, 8, 8)).astype("float32")
    blocked, _ = to_blocked(mod, B)
    assert not any("NCHWc" in n for n in kernel_names(blocked))  # 12 channels: plain NCHW
    assert_close(run(blocked, x), run(mod, x))


def stem_module(pool=True, also_returned=False, seed=8):
    """RGB x -> conv (3 -> 2 blocks) -> + bias -> relu [-> max pool] -> conv [, the relu]."""
    rng = np.random.default_rng(seed)
    w1, b1, w2 = _w(rng, 2 * B, 3, 3, 3), _w(rng, 1, 2 * B, 1, 1), _w(rng, 2 * B, 2 * B, 1, 1)

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.add(bb.emit(R.nn.conv2d(x, w1, strides=2, padding=1)),
                                            b1))))
        z = bb.emit(R.nn.max_pool2d(y, 3, 2, 1)) if pool else y
        out = bb.emit(R.nn.conv2d(z, w2))
        return relax.Tuple([out, y]) if also_returned else out

    x = rng.normal(size=(1, 3, 16, 16)).astype("float32")
    return function([tensor_var("x", x.shape)], body), x


@pytest.mark.parametrize("pool", [True, False])
def test_an_rgb_stem_writes_the_blocked_layout_itself(pool):
    """ConvertLayout leaves a 3-channel conv in NCHW; the stem then writes NCHW{b}c through its
    epilogue and max pool: the only layout transform left is the one back at the end."""
    mod, x = stem_module(pool)
    out, report = fused(mod)
    assert layout_kernel_count(out) == 1
    stem = next(r for r in report if r.ops[0] == "conv2d" and "add" in " ".join(r.ops))
    assert stem.spill_moves == 0
    assert_close(run(out, x), run(mod, x))


def test_a_stem_chain_with_a_second_tensor_stays_nchw():
    """conv(x) + x-sized tensor: the chain has two tensor operands, the stem is not rewritten
    (one of them would stay NCHW), and the numbers stay."""
    rng = np.random.default_rng(10)
    w1, w2 = _w(rng, 2 * B, 3, 3, 3), _w(rng, 2 * B, 2 * B, 1, 1)
    params = [tensor_var("x", (1, 3, 8, 8)), tensor_var("r", (1, 2 * B, 8, 8))]

    def body(bb, x, r):
        y = bb.emit(R.nn.relu(bb.emit(R.add(bb.emit(R.nn.conv2d(x, w1, padding=1)), r))))
        return R.nn.conv2d(y, w2)

    mod = function(params, body)
    inputs = [rng.normal(size=(1, 3, 8, 8)).astype("float32"),
              rng.normal(size=(1, 2 * B, 8, 8)).astype("float32")]
    blocked, _ = to_blocked(mod, B)
    assert_close(run(blocked, *inputs), run(mod, *inputs))


def test_a_stem_whose_output_is_used_twice_stays_nchw():
    mod, x = stem_module(pool=False, also_returned=True)
    blocked, _ = to_blocked(mod, B)
    assert layout_kernel_count(blocked) >= 2  # the stem's output is transformed, not written
    for got, want in zip(_run_tuple(blocked, x), _run_tuple(mod, x), strict=True):
        assert_close(got, want)


def _run_tuple(mod, x):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return [t.numpy() for t in vm["main"](tvm.runtime.tensor(x))]


# --------------------------------------------------------------------------------------------
# Step 1: the importer's clip kernels
# --------------------------------------------------------------------------------------------


def _clip_module(fn):
    """x -> conv -> call_tir(fn(y, 0.0)) as the ONNX importer emits Clip."""
    rng = np.random.default_rng(5)
    w = _w(rng, B, B, 1, 1)

    def body(bb, x):
        y = bb.emit(R.nn.conv2d(x, w))
        return bb.emit_te(fn, y, relax.const(np.float32(0.0)))

    mod = function([tensor_var("x", (1, B, 4, 4))], body)
    return mod, rng.normal(size=(1, B, 4, 4)).astype("float32")


def test_importer_clip_is_raised_to_relax_maximum():
    """It then runs in the blocked layout, fused into the conv's kernel."""
    mod, x = _clip_module(topi.maximum)
    assert op_counts(mod)["call_tir"] == 1
    with CHIP.target:
        graph = fuse_graph(mod, B)
    assert any(CONV_BLOCK in n and "maximum" in n for n in kernel_names(graph))
    assert_close(run(graph, x), run(mod, x))


def test_a_look_alike_kernel_is_not_raised():
    """max(y, s) + 1 is not topi's maximum: it stays its own call_tir in NCHW (ConvertLayout
    brings the tensor back for it), and the numbers stay."""
    mod, x = _clip_module(lambda y, s: te.compute(
        y.shape, lambda *i: te.max(y(*i), s()) + 1.0, name="T_maximum"))
    with CHIP.target:
        graph = fuse_graph(mod, B)
    assert not any(CONV_BLOCK in n and "maximum" in n for n in kernel_names(graph))
    assert layout_kernel_count(graph) == 2  # x in, and the conv's result back to NCHW
    assert_close(run(graph, x), run(mod, x))


# --------------------------------------------------------------------------------------------
# Injective kernels, the register check and the tuning spaces
# --------------------------------------------------------------------------------------------


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
            scheduled = conv_schedule.schedule_injective(func, CHIP)
            assert scheduled is not None and scheduled.attrs["tirx.is_scheduled"]
            graph = graph.clone()
            graph.update_func(gvar, scheduled)
    assert_close(run(graph, x), x * (x > 0))


def test_injective_schedule_leaves_reductions_alone():
    mod, _ = conv_module(B, B)
    (func,) = [f for f in fuse_graph(mod).functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert conv_schedule.schedule_injective(func, CHIP) is None


def test_a_scalar_kernel_is_left_alone():
    a = te.placeholder((), "float32", "a")
    func = te.create_prim_func([a, te.compute((), lambda: a() + 1.0, name="b")])
    assert conv_schedule.schedule_injective(func, CHIP) is None


def _blocked_kernel(cin=2 * B, cout=4 * B, hw=14, **kwargs):
    mod, _ = conv_module(cin, cout, hw=hw, **kwargs)
    with CHIP.target:
        graph = fuse_graph(mod, B)
    (gvar,) = [g for g, f in graph.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc) and CONV_BLOCK in g.name_hint]
    return graph[gvar], conv_schedule.analyze(graph[gvar])


def test_blocked_tiles_fit_the_budget_and_an_oversized_one_is_rejected():
    func, anchor = _blocked_kernel()
    assert anchor.blocked and (anchor.rows_axis, anchor.hrow_axis, anchor.vec_axis) == (3, 1, 4)
    tiles = conv_schedule.candidate_tiles(anchor, CHIP)
    budget = conv_schedule.register_budget(anchor, CHIP)
    assert budget == CHIP.vector_regs  # a blocked tile's estimate counts every register
    assert all(conv_schedule.live_vector_registers(anchor, t, CHIP) <= budget for t in tiles)
    huge = conv_schedule.Tile(vec=B, rows=14, hrows=4, lanes=B, block_rows=14)
    _, record = choose_schedule(func, anchor, CHIP, tiles=[huge, *tiles])
    need = conv_schedule.live_vector_registers(anchor, huge, CHIP)
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
    anchor = conv_schedule.analyze(func)
    best = conv_schedule.candidate_tiles(anchor, avx2)[0]
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
    anchor = conv_schedule.analyze(func)
    assert all(28 % t.rows == 0 for t in conv_schedule.candidate_tiles(anchor, avx512))


def _conv_kernel(chip, **case):
    """(module, inputs, blocked graph, its conv kernel's GlobalVar) of ``conv_module(**case)``
    in ``chip``'s channel blocks."""
    mod, inputs = conv_module(**case)
    with chip.target:
        graph = fuse_graph(mod, chip.lanes()).clone()
    (gvar,) = [g for g in graph.functions if CONV_BLOCK in g.name_hint]
    return mod, inputs, graph, gvar


def _tile(chip, rows: int, hrows: int = 1) -> conv_schedule.Tile:
    b = chip.lanes()
    return conv_schedule.Tile(vec=b, rows=rows, hrows=hrows, lanes=b, block_rows=rows)


@pytest.mark.parametrize("epilogue", ["register", "cache", "separate"])
@pytest.mark.parametrize("shape", [(3, 2), (4, 1), (7, 2)])
def test_a_tail_tile_is_exact(epilogue, shape):
    """Column tiles that leave a tail of 1, 2 or 3 columns (10 = 3 * 3 + 1 = 4 * 2 + 2 =
    7 + 3), at every epilogue level."""
    mod, inputs, graph, gvar = _conv_kernel(CHIP, cin=2 * B, cout=2 * B, hw=10, residual=True)
    scheduled = conv_schedule.schedule(graph[gvar], CHIP, _tile(CHIP, *shape), epilogue)
    graph.update_func(gvar, scheduled)
    assert_close(run(graph, *inputs), run(mod, *inputs))


@pytest.mark.parametrize(("cout", "hw", "serial"), [(4 * B, 8, True), (B, 2, False)])
def test_column_tiles_run_serially_in_each_parallel_chunk(cout, hw, serial):
    """Parallel over (block group, output row), the column tiles of a row serial inside the
    chunk; with fewer than two such chunks per core the column tiles are chunks too."""
    mod, inputs, graph, gvar = _conv_kernel(CHIP, cin=2 * B, cout=cout, hw=hw, residual=True)
    anchor = conv_schedule.analyze(graph[gvar])
    scheduled = conv_schedule.schedule(graph[gvar], CHIP, _tile(CHIP, hw // 2))
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
    stores = conv_schedule._nodes(mod["main"].body, tvm.tirx.BufferStore)
    found = ["if_then_else" not in str(st.value) for st in stores if "local" in st.buffer.name]
    return sum(found), len(found)


AVX512 = chips.get("avx512")  # 32 vector registers: a dense conv's kernel columns unrolled


@pytest.mark.parametrize(("stride", "pad", "dilation"), [(1, 1, 1), (2, 1, 1), (1, 2, 2)])
def test_a_3x3_conv_reads_its_padding_through_a_predicate(stride, pad, dilation):
    """No padded copy of the input: the serial column tiles and the kernel rows are split
    into border and interior parts, and the interior reads without a predicate."""
    b = AVX512.lanes()
    mod, inputs, graph, gvar = _conv_kernel(AVX512, cin=2 * b, cout=2 * b, hw=16, stride=stride,
                                            pad=pad, dilation=dilation, residual=True)
    cols = conv_schedule.analyze(graph[gvar]).spatial[3]
    scheduled = conv_schedule.schedule(graph[gvar], AVX512, _tile(AVX512, cols // 4))
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
    *_, graph, gvar = _conv_kernel(chip, cin=2 * b, cout=2 * b, hw=16, k=k, pad=k // 2)
    assert _padded_copies(conv_schedule.schedule(graph[gvar], chip, _tile(chip, rows))) == 1


def test_the_stem_keeps_its_padded_copy():
    mod, _ = stem_module(pool=False)
    with AVX512.target:
        graph = fuse_graph(mod, AVX512.lanes())
    (stem,) = [f for g, f in graph.functions.items() if CONV_BLOCK in g.name_hint
               and conv_schedule.analyze(f).reduction[-1] == 3]  # RGB: fewer than a vector
    assert _padded_copies(conv_schedule.schedule(stem, AVX512)) == 1


@pytest.mark.parametrize("epilogue", ["register", "cache", "separate"])
def test_every_epilogue_level_of_a_blocked_conv_is_exact(epilogue):
    mod, inputs = conv_module(2 * B, 2 * B, hw=10, residual=True)
    with CHIP.target:
        graph = fuse_graph(mod, B)
    graph = graph.clone()
    for gvar, func in list(graph.functions.items()):
        if isinstance(func, tvm.tirx.PrimFunc) and CONV_BLOCK in gvar.name_hint:
            anchor = conv_schedule.analyze(func)
            tile = conv_schedule.candidate_tiles(anchor, CHIP)[0]
            graph.update_func(gvar, conv_schedule.schedule(func, CHIP, tile, epilogue))
    assert_close(run(graph, *inputs), run(mod, *inputs))


def test_design_spaces_sample_the_tile_and_stay_exact():
    func, anchor = _blocked_kernel(hw=8)
    spaces = conv_schedule.design_spaces(s_tir.Schedule(func), CHIP)
    sampled = [s for s in spaces if conv_schedule.sampled_tile(s, anchor, CHIP) is not None]
    assert len(sampled) == 2  # epilogue on the register tile, on the stored tile
    # The rest: one fixed schedule per candidate tile with a tail (16-register chips) and level.
    tails = [t for t in conv_schedule.candidate_tiles(anchor, CHIP) if anchor.spatial[3] % t.rows]
    assert len(spaces) == 2 * (1 + len(tails))
    x = np.random.default_rng(7).normal(size=[int(d) for d in func.params[0].ty.shape])
    args = [x.astype("float32")] + [
        np.random.default_rng(i).normal(size=[int(d) for d in p.ty.shape]).astype("float32")
        for i, p in enumerate(func.params[1:-1])]
    reference = _run_prim(func, args)
    for space in sampled:
        assert anchor.spatial[3] % conv_schedule.sampled_tile(space, anchor, CHIP).rows == 0
    for space in spaces:
        assert_close(_run_prim(space.mod["main"], args), reference)
    unblocked_mod, _ = conv_module(B, B, hw=6, k=1, pad=0)
    (nchw,) = [f for f in fuse_graph(unblocked_mod).functions.values()
               if isinstance(f, tvm.tirx.PrimFunc)]
    assert conv_schedule.design_spaces(s_tir.Schedule(nchw), CHIP) is None


def _run_prim(func, args):
    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         target=CHIP.target)
    out_param = func.params[-1]
    out = tvm.runtime.tensor(np.zeros([int(d) for d in out_param.ty.shape], "float32"))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()
