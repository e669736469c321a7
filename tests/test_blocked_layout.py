"""blocked_layout: numerics of every conv form in the blocked layout against the NCHW module
compiled by TVM, where layout transforms remain, the clip raising and channel padding (and the
cases they must leave alone). The schedules of blocked convs are tested in test_schedules_*."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import relax, te, topi

from _kernels import CHIP, HERE, B, R, conv_module, stem_module, weight
from _util import assert_close, function, run, tensor_var
from tvm_bnfold import FuseEpilogue, chips
from tvm_bnfold.bench import kernel_count, layout_kernel_count, op_counts
from tvm_bnfold.blocked_layout import CONV_BLOCK, DEPTHWISE_BLOCK, _CancelTransforms, to_blocked
from tvm_bnfold.fuse_epilogue import fuse_graph

pytestmark = pytest.mark.skipif(not HERE, reason="neither avx512 nor avx2 runs here")


def fused(mod, chip=CHIP, **kwargs):
    fuse = FuseEpilogue(chip, **{"blocked": True, **kwargs})
    with chip.target:
        return fuse(mod), fuse.report


def kernel_names(mod) -> list[str]:
    return [g.name_hint for g, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]


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


def chain_module(c=2 * 8, mid=2 * 8, hw=8, seed=0):
    """x -> conv -> relu -> conv -> + x-path residual -> relu -> conv(1x1): three convs."""
    rng = np.random.default_rng(seed)
    w1, w2, w3 = weight(rng, mid, c, 3, 3), weight(rng, mid, mid, 3, 3), weight(rng, c, mid, 1, 1)
    b1, b2 = weight(rng, 1, mid, 1, 1), weight(rng, 1, mid, 1, 1)

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
    w1, w2 = weight(rng, B, B, 3, 3), weight(rng, second, B, 1, 1)
    w3 = weight(rng, B, B + second, 1, 1)

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
    w1, w2 = weight(rng, 12, B, 3, 3), weight(rng, B, 12, 1, 1)

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
    w1, w2 = weight(rng, 12, B, 3, 3), weight(rng, 12, 12, 1, 1)

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
    w1, w2 = weight(rng, 12, B, 3, 3), weight(rng, B, 12, 1, 1)

    def body(bb, x):
        y = bb.emit(R.exp(bb.emit(R.nn.conv2d(x, w1, padding=1))))
        return R.nn.conv2d(y, w2)

    mod = function([tensor_var("x", (1, B, 8, 8))], body)
    x = rng.normal(size=(1, B, 8, 8)).astype("float32")
    blocked, _ = to_blocked(mod, B)
    assert not any("NCHWc" in n for n in kernel_names(blocked))  # 12 channels: plain NCHW
    assert_close(run(blocked, x), run(mod, x))


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
    w1, w2 = weight(rng, 2 * B, 3, 3, 3), weight(rng, 2 * B, 2 * B, 1, 1)
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


def _clip_module(fn):
    """x -> conv -> call_tir(fn(y, 0.0)) as the ONNX importer emits Clip."""
    rng = np.random.default_rng(5)
    w = weight(rng, B, B, 1, 1)

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


def test_a_head_conv_reads_the_blocked_layout_in_its_own_kernel():
    """A conv whose output channels the block does not divide (a 1000-class head) after a
    blocked region gathers its blocked input in its own kernel: ConvertLayout's transform back
    to NCHW cancels against it, so the only layout transform left is the model input's."""
    rng = np.random.default_rng(3)
    w1, w2 = weight(rng, 2 * B, B, 3, 3), weight(rng, B + 2, 2 * B, 1, 1)

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w1, padding=1))))
        return R.nn.relu(bb.emit(R.nn.conv2d(y, w2)))

    x = rng.normal(size=(1, B, 7, 7)).astype("float32")
    mod = function([tensor_var("x", x.shape)], body)
    out, report = fused(mod)
    assert layout_kernel_count(out) == 1
    head = [r for r in report if "conv2d_of_blocked" in r.kernel]
    assert len(head) == 1 and head[0].decision == "register"
    assert_close(run(out, x), run(mod, x))


def _transform_pair(first, second, shape=(1, 2 * B, 5, 5)):
    x = tensor_var("x", shape)
    return function([x], lambda bb, x: R.nn.relu(bb.emit(R.layout_transform(
        bb.emit(R.layout_transform(x, first)), second))))


def test_a_transform_and_its_inverse_cancel_and_nothing_else_does():
    blocked = lambda n, c, h, w: (n, c // B, h, w, c % B)  # noqa: E731
    swap = lambda n, c, h, w: (n, c, w, h)  # noqa: E731
    same = lambda n, c, h, w: (n, c, h, w)  # noqa: E731
    inverse = lambda n, o, h, w, i: (n, o * B + i, h, w)  # noqa: E731

    def transforms(mod):
        return relax.transform.LegalizeOps()(_CancelTransforms()(mod)).script().count(
            "layout_transform")

    assert transforms(_transform_pair(blocked, inverse)) == 0
    assert transforms(_transform_pair(swap, swap)) == 0
    assert transforms(_transform_pair(swap, same)) > 0  # not the identity: kept
    mod = _transform_pair(blocked, inverse)
    assert_close(run(_CancelTransforms()(mod), x := np.ones((1, 2 * B, 5, 5), "float32")),
                 run(mod, x))


def test_a_dense_block_after_an_rgb_stem_is_blocked_through_its_concats():
    """DenseNet: the stem's pooled map is the first input of a chain of concats, and
    ConvertLayout gives a concat its first input's layout (the stem's NCHW), so every conv of
    the block read a transform and every concat a transform back. The whole block moves to
    the blocked layout: the only transform left is the result's."""
    rng = np.random.default_rng(12)
    w0, w1 = weight(rng, 2 * B, 3, 3, 3), weight(rng, B, 2 * B, 1, 1)
    w2, w3 = weight(rng, B, 3 * B, 1, 1), weight(rng, B, 4 * B, 1, 1)
    scale, shift = weight(rng, 1, 3 * B, 1, 1), weight(rng, 1, 3 * B, 1, 1)

    def body(bb, x):
        stem = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w0, padding=1))))
        pool = bb.emit(R.nn.max_pool2d(stem, 3, 2, 1))
        c1 = bb.emit(R.concat([pool, bb.emit(R.nn.conv2d(bb.emit(R.nn.relu(pool)), w1))], 1))
        y = bb.emit(R.nn.relu(bb.emit(R.add(bb.emit(R.multiply(c1, scale)), shift))))
        c2 = bb.emit(R.concat([c1, bb.emit(R.nn.conv2d(y, w2))], axis=1))
        return R.nn.conv2d(c2, w3)

    x = rng.normal(size=(1, 3, 16, 16)).astype("float32")
    mod = function([tensor_var("x", x.shape)], body)
    out, _ = fused(mod)
    assert layout_kernel_count(out) == 1
    assert_close(run(out, x), run(mod, x))


def test_an_nchw_region_stays_where_moving_it_needs_more_transforms():
    """relu(x) and the concat after it are returned in NCHW: blocked, each would need a
    transform back and x one in, for the one transform of the conv's result they save."""
    rng = np.random.default_rng(13)
    w = weight(rng, B, B, 3, 3)

    def body(bb, x):
        y = bb.emit(R.nn.relu(x))
        return relax.Tuple([y, bb.emit(R.concat([y, bb.emit(R.nn.conv2d(x, w, padding=1))],
                                                axis=1))])

    x = rng.normal(size=(1, B, 6, 6)).astype("float32")
    mod = function([tensor_var("x", x.shape)], body)
    blocked, _ = to_blocked(mod, B)
    assert layout_kernel_count(blocked) == 2  # x in, the conv's result out
    for got, want in zip(_run_tuple(blocked, x), _run_tuple(mod, x), strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("method", ["nearest_neighbor", "linear"])
def test_a_resize_between_blocked_convs_runs_blocked(method):
    """A feature pyramid's upsampling between convs: TOPI's blocked resize, so the region goes
    on through it (transforms only at the model's ends) and no region end is recorded."""
    rng = np.random.default_rng(14)
    w1, w2 = weight(rng, 2 * B, B, 3, 3), weight(rng, B, 2 * B, 1, 1)

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w1, padding=1))))
        return R.nn.conv2d(bb.emit(R.image.resize2d(y, (10, 10), method=method)), w2)

    x = rng.normal(size=(1, B, 5, 5)).astype("float32")
    mod = function([tensor_var("x", x.shape)], body)
    out, _ = fused(mod)
    assert not to_blocked(mod, B)[1]  # no region ends
    assert layout_kernel_count(out) == 2
    assert_close(run(out, x), run(mod, x))
