"""FoldBN on small graphs: structure (op counts), numerics vs the unfolded module compiled by TVM,
the cases it must not fold, fp16, immutability, idempotence, and a hypothesis property test."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import relax

from _util import (
    assert_close,
    batch_norm,
    bn_params,
    constants,
    function,
    layout_shape,
    run,
    tensor_var,
)
from tvm_bnfold import FoldBN
from tvm_bnfold.bench import op_counts

CONV_OPS = {1: relax.op.nn.conv1d, 2: relax.op.nn.conv2d, 3: relax.op.nn.conv3d}
CONV_T_OPS = {1: relax.op.nn.conv1d_transpose, 2: relax.op.nn.conv2d_transpose}
SPATIAL = {1: "W", 2: "HW", 3: "DHW"}


def conv_bn_module(
    dims: int = 2,
    data_layout: str = "NCHW",
    kernel_layout: str = "OIHW",
    groups: int = 1,
    cin: int = 4,
    cout: int = 6,
    bias: bool = True,
    transpose: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    **bn_kwargs,
):
    """x -> conv (+ bias as the ONNX importer writes it: add(conv, reshape(b))) -> BN -> relu."""
    rng = np.random.default_rng(seed)
    x_shape = layout_shape(data_layout, {"N": 1, "C": cin})
    w_sizes = {"I": cin, "O": cout // groups} if transpose else {"O": cout, "I": cin // groups}
    w_shape = layout_shape(kernel_layout, {**w_sizes, **dict.fromkeys(SPATIAL[dims], 3)})
    weight = rng.normal(0, 1 / np.sqrt(np.prod(w_shape) / w_shape[0]), w_shape).astype(dtype)
    axis = data_layout.index("C")
    op = (CONV_T_OPS if transpose else CONV_OPS)[dims]

    def body(bb, x):
        y = bb.emit(op(x, relax.const(weight), groups=groups, data_layout=data_layout,
                       kernel_layout=kernel_layout, padding=1))
        if bias:
            b = relax.const(rng.normal(0, 1, cout).astype(dtype))
            shape = [1] * len(data_layout)
            shape[axis] = cout
            y = bb.emit(relax.op.add(y, bb.emit(relax.op.reshape(b, shape))))
        bn = bb.emit(batch_norm(y, bn_params(rng, cout, dtype), axis, **bn_kwargs))
        bb.emit(bn[1])  # the importer's dead reads of the batch statistics
        return relax.op.nn.relu(bb.emit(bn[0]))

    x = rng.normal(0, 1, x_shape).astype(dtype)
    return function([tensor_var("x", x_shape, dtype)], body), x


def check_folds(mod, *inputs, into: int = 1, tol: float = 1e-5):
    """Fold; assert the BN is gone, producers are not duplicated, numerics match."""
    fold = FoldBN()
    folded = fold(mod)
    before, after = op_counts(mod), op_counts(folded)
    assert after["nn.batch_norm"] == 0
    assert [r.action for r in fold.report] == ["folded"] * before["nn.batch_norm"]
    assert sum(len(r.into) for r in fold.report) == into
    for op in ("nn.conv1d", "nn.conv2d", "nn.conv3d", "nn.conv2d_transpose", "matmul"):
        assert after[op] == before[op]
    assert_close(run(folded, *inputs), run(mod, *inputs), tol)
    return folded, fold.report


CONV_CASES = [
    (1, "NCW", "OIW"), (1, "NWC", "WIO"),
    (2, "NCHW", "OIHW"), (2, "NHWC", "HWIO"), (2, "NHWC", "OHWI"), (2, "NCHW", "HWIO"),
    (3, "NCDHW", "OIDHW"), (3, "NDHWC", "DHWIO"),
]


@pytest.mark.parametrize(("dims", "data_layout", "kernel_layout"), CONV_CASES)
@pytest.mark.parametrize("groups", [1, 2, 4], ids=["dense", "grouped", "depthwise"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_conv_layouts_and_groups(dims, data_layout, kernel_layout, groups, bias):
    cout = 4 if groups == 4 else 6
    mod, x = conv_bn_module(dims, data_layout, kernel_layout, groups, cout=cout, bias=bias)
    folded, report = check_folds(mod, x)
    counts = op_counts(folded)
    # conv + one add (the folded bias) + relu: no multiply, no leftover reshape of the bias.
    assert counts["add"] == 1 and counts["multiply"] == 0 and counts["reshape"] == 0
    assert report[0].into[0].startswith(f"conv{dims}d")


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_conv_transpose_groups(dims, groups):
    layout = {1: ("NCW", "IOW"), 2: ("NCHW", "IOHW")}[dims]
    mod, x = conv_bn_module(dims, *layout, groups=groups, cin=6, cout=6, transpose=True)
    check_folds(mod, x)


def _dense_module(form: str, seed=0, batch_shape=(3,)):
    """matmul forms of the ONNX importer: Gemm -> matmul(x, permute_dims(W)) + b; MatMul."""
    rng = np.random.default_rng(seed)
    k, n = 5, 7
    x = rng.normal(size=(*batch_shape, k)).astype("float32")
    w = rng.normal(size=(n, k) if form == "gemm" else (k, n)).astype("float32")

    def body(bb, xv):
        if form == "gemm":
            y = bb.emit(relax.op.matmul(xv, bb.emit(relax.op.permute_dims(relax.const(w)))))
            y = bb.emit(relax.op.add(y, relax.const(rng.normal(size=n).astype("float32"))))
        else:
            y = bb.emit(relax.op.matmul(xv, relax.const(w)))
        bn = bb.emit(batch_norm(y, bn_params(rng, n), axis=-1))
        return bn[0]

    return function([tensor_var("x", x.shape)], body), x


@pytest.mark.parametrize("form", ["gemm", "matmul"])
@pytest.mark.parametrize("batch_shape", [(3,), (2, 3)])
def test_dense(form, batch_shape):
    mod, x = _dense_module(form, batch_shape=batch_shape)
    folded, _ = check_folds(mod, x)
    assert op_counts(folded)["permute_dims"] == 0  # the transposed weight became one constant


def test_onnx_conv_with_bias_folds_through_the_bias_add():
    """Conv(W, B) -> BatchNormalization -> Relu imported from ONNX: one conv + one add left."""
    from onnx import TensorProto, helper, numpy_helper

    from tvm_bnfold import load_onnx

    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(a.astype("float32"), n) for n, a in [
        ("W", rng.normal(size=(8, 3, 3, 3))), ("B", rng.normal(size=8)),
        ("g", rng.uniform(0.5, 1.5, 8)), ("b", rng.normal(size=8)),
        ("m", rng.normal(size=8)), ("v", rng.uniform(0.5, 2, 8))]]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"],
                              epsilon=1e-3),
             helper.make_node("Relu", ["y"], ["r"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 8, 8, 8])], inits)
    mod = load_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    x = rng.normal(size=(1, 3, 8, 8)).astype("float32")
    folded, _ = check_folds(mod, x)
    assert op_counts(folded) == {"nn.conv2d": 1, "add": 1, "nn.relu": 1}


def test_no_foldable_producer_becomes_one_multiply_and_one_add():
    rng = np.random.default_rng(6)

    def body(bb, x):
        bn = bb.emit(batch_norm(bb.emit(relax.op.nn.relu(x)), bn_params(rng, 4), 1))
        return bn[0]

    mod = function([tensor_var("x", (2, 4, 5, 5))], body)
    fold = FoldBN()
    out = fold(mod)
    assert op_counts(out) == {"nn.relu": 1, "multiply": 1, "add": 1}
    assert fold.report[0].action == "scale-shift"
    assert "nn.relu" in fold.report[0].reason
    x = rng.normal(size=(2, 4, 5, 5)).astype("float32")
    assert_close(run(out, x), run(mod, x))


def _two_convs(bb, x, rng, couts=(3, 5)):
    outs = []
    for c in couts:
        w = relax.const(rng.normal(0, 0.3, (c, 4, 3, 3)).astype("float32"))
        y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
        b = relax.const(rng.normal(size=(1, c, 1, 1)).astype("float32"))
        outs.append(bb.emit(relax.op.add(y, b)))
    return outs


def test_concat_of_convs_folds_each_channel_slice():
    rng = np.random.default_rng(7)

    def body(bb, x):
        cat = bb.emit(relax.op.concat(_two_convs(bb, x, rng), axis=1))
        return bb.emit(batch_norm(cat, bn_params(rng, 8), 1))[0]

    mod = function([tensor_var("x", (1, 4, 6, 6))], body)
    folded, _report = check_folds(mod, rng.normal(size=(1, 4, 6, 6)).astype("float32"), into=2)
    assert op_counts(folded) == {"nn.conv2d": 2, "add": 2, "concat": 1}


def test_add_of_convs_scales_both_and_shifts_one():
    rng = np.random.default_rng(8)

    def body(bb, x):
        a, b = _two_convs(bb, x, rng, couts=(5, 5))
        return bb.emit(batch_norm(bb.emit(relax.op.add(a, b)), bn_params(rng, 5), 1))[0]

    mod = function([tensor_var("x", (1, 4, 6, 6))], body)
    folded, _ = check_folds(mod, rng.normal(size=(1, 4, 6, 6)).astype("float32"), into=2)
    assert op_counts(folded) == {"nn.conv2d": 2, "add": 3}


@pytest.mark.parametrize(
    ("bn_kwargs", "eps"), [({"center": False}, 1e-5), ({"scale": False}, 1e-5), ({}, 0.5)]
)
def test_center_scale_and_own_epsilon_are_honoured(bn_kwargs, eps):
    mod, x = conv_bn_module(epsilon=eps, **bn_kwargs)
    check_folds(mod, x)


# --- must NOT fold -----------------------------------------------------------------------------


def _single_bn(make_params, axis=1, producer="conv", channels=4, **bn_kwargs):
    """x -> conv/relu -> BN, with BN params made by ``make_params(rng)``."""
    rng = np.random.default_rng(9)
    shape = (1, 4, channels if axis == 2 else 5, 5)
    w = relax.const(rng.normal(0, 0.5, (4, 4, 1, 1)).astype("float32"))

    def body(bb, x, *extra):
        y = bb.emit(relax.op.nn.conv2d(x, w) if producer == "conv" else relax.op.nn.relu(x))
        params = make_params(rng, extra)
        return bb.emit(batch_norm(y, params, axis, **bn_kwargs))[0]

    return shape, body, rng


def _keeps_bn(mod, inputs, reason: str, action="kept", caplog=None):
    fold = FoldBN()
    with caplog.at_level(logging.INFO, logger="tvm_bnfold.fold_bn"):
        out = fold(mod)
    (record,) = fold.report
    assert record.action == action
    assert reason in record.reason
    assert reason in caplog.text
    assert op_counts(out)["nn.batch_norm"] == (1 if action == "kept" else 0)
    assert op_counts(out)["nn.conv2d"] == op_counts(mod)["nn.conv2d"]
    assert_close(run(out, *inputs), run(mod, *inputs))
    return out


def test_training_mode_is_kept():
    shape, body, _ = _single_bn(lambda rng, _: bn_params(rng, 4), training=True)
    mod = function([tensor_var("x", shape)], body)
    fold = FoldBN()
    out = fold(mod)
    assert fold.report[0].action == "kept" and "training" in fold.report[0].reason
    tvm.ir.assert_structural_equal(out, mod)


def test_non_constant_statistics_are_kept(caplog):
    shape, body, rng = _single_bn(lambda rng, extra: [extra[0], *bn_params(rng, 4)[1:]])
    mod = function([tensor_var("x", shape), tensor_var("gamma", (4,))], body)
    x, g = rng.normal(size=shape).astype("float32"), rng.uniform(0.5, 1, 4).astype("float32")
    _keeps_bn(mod, [x, g], "gamma not constant", caplog=caplog)


@pytest.mark.parametrize(("index", "value", "reason"), [
    (3, np.nan, "var is not finite at channel 1"),
    (0, np.inf, "gamma is not finite at channel 1"),
    (3, -1.0, "var + eps <= 0 at channel 1"),
])
def test_bad_statistics_are_kept(caplog, index, value, reason):
    def params(rng, _):
        p = bn_params(rng, 4)
        p[index][1] = value
        return p

    shape, body, _rng = _single_bn(params)
    mod = function([tensor_var("x", shape)], body)
    fold = FoldBN()
    with caplog.at_level(logging.WARNING):
        out = fold(mod)
    assert fold.report[0].action == "kept" and reason in fold.report[0].reason
    assert reason in caplog.text
    tvm.ir.assert_structural_equal(out, mod)


def test_non_constant_weight_is_not_folded(caplog):
    rng = np.random.default_rng(10)

    def body(bb, x, w):
        y = bb.emit(relax.op.nn.conv2d(x, w))
        return bb.emit(batch_norm(y, bn_params(rng, 4), 1))[0]

    mod = function([tensor_var("x", (1, 4, 5, 5)), tensor_var("w", (4, 4, 1, 1))], body)
    x, w = (rng.normal(size=s).astype("float32") for s in ((1, 4, 5, 5), (4, 4, 1, 1)))
    _keeps_bn(mod, [x, w], "weight of lv is not a constant", "scale-shift", caplog)


def test_producer_with_two_consumers_is_never_duplicated(caplog):
    rng = np.random.default_rng(11)
    w = relax.const(rng.normal(0, 0.5, (4, 4, 1, 1)).astype("float32"))

    def body(bb, x):
        y = bb.emit(relax.op.nn.conv2d(x, w))
        bn = bb.emit(batch_norm(y, bn_params(rng, 4), 1))[0]
        return relax.op.add(bb.emit(bn), y)  # the conv output is needed unscaled as well

    mod = function([tensor_var("x", (1, 4, 5, 5))], body)
    out = _keeps_bn(mod, [rng.normal(size=(1, 4, 5, 5)).astype("float32")],
                    "producer output lv has 2 consumers", "scale-shift", caplog)
    assert op_counts(out)["nn.conv2d"] == 1


def test_bn_axis_other_than_output_channels_is_not_folded(caplog):
    shape, body, rng = _single_bn(lambda rng, _: bn_params(rng, 4), axis=2, channels=4)
    mod = function([tensor_var("x", shape)], body)
    _keeps_bn(mod, [rng.normal(size=shape).astype("float32")],
              "BatchNorm axis 2 is not the output channels", "scale-shift", caplog)


def test_concat_with_an_unfoldable_part_is_not_folded(caplog):
    rng = np.random.default_rng(12)

    def body(bb, x):
        (a,) = _two_convs(bb, x, rng, couts=(4,))
        cat = bb.emit(relax.op.concat([a, bb.emit(relax.op.nn.relu(x))], axis=1))
        return bb.emit(batch_norm(cat, bn_params(rng, 8), 1))[0]

    mod = function([tensor_var("x", (1, 4, 6, 6))], body)
    _keeps_bn(mod, [rng.normal(size=(1, 4, 6, 6)).astype("float32")],
              "not a conv/matmul/concat/add", "scale-shift", caplog)


# --- precision, safety, idempotence ----------------------------------------------------------


def test_fp16_extreme_statistics_fold_like_fp32():
    """fp16 model, running_var 1e-8 .. 6e4 (fp16's range) and gamma ~1e-4: no inf/nan, and the
    folded fp16 model matches the folded fp32 model within fp16 tolerance."""
    rng = np.random.default_rng(13)
    c = 8
    params = [rng.uniform(0.5e-4, 2e-4, c), rng.normal(0, 1e-3, c), rng.normal(0, 1, c),
              np.logspace(-8, np.log10(6e4), c)]
    w = rng.normal(0, 0.3, (c, 4, 3, 3))
    x = rng.normal(size=(1, 4, 6, 6))
    outs = {}
    for dtype in ("float16", "float32"):
        def body(bb, xv, dtype=dtype):
            y = bb.emit(relax.op.nn.conv2d(xv, relax.const(w.astype(dtype)), padding=1))
            return bb.emit(batch_norm(y, [p.astype(dtype) for p in params], 1))[0]

        mod = function([tensor_var("x", x.shape, dtype)], body)
        fold = FoldBN()
        folded = fold(mod)
        assert fold.report[0].action == "folded", fold.report
        for const in constants(folded):
            assert np.isfinite(const).all()
        outs[dtype] = run(folded, x.astype(dtype)).astype("float32")
    assert np.isfinite(outs["float16"]).all()
    np.testing.assert_allclose(outs["float16"], outs["float32"], rtol=1e-2, atol=1e-2)


def test_caller_module_and_arrays_are_not_mutated():
    mod, _x = conv_bn_module()
    script, arrays = mod.script(show_meta=True), constants(mod)
    folded = FoldBN()(mod)
    assert op_counts(folded)["nn.batch_norm"] == 0 < op_counts(mod)["nn.batch_norm"]
    assert mod.script(show_meta=True) == script
    for before, after in zip(arrays, constants(mod), strict=True):
        assert before.tobytes() == after.tobytes()


def test_second_run_is_a_no_op():
    mod, _ = conv_bn_module()
    once = FoldBN()(mod)
    fold = FoldBN()
    twice = fold(once)
    tvm.ir.assert_structural_equal(twice, once)
    assert fold.report == []


def test_composes_in_sequential():
    mod, x = conv_bn_module()
    seq = tvm.transform.Sequential([FoldBN(), relax.transform.FoldConstant()])
    out = seq(mod)
    assert op_counts(out)["nn.batch_norm"] == 0
    assert_close(run(out, x), run(mod, x))


# --- property test ---------------------------------------------------------------------------


@st.composite
def conv_configs(draw):
    transpose = draw(st.booleans())
    dims = draw(st.sampled_from([1, 2] if transpose else [1, 2, 3]))
    if transpose:
        layouts = ("NC" + SPATIAL[dims], "IO" + SPATIAL[dims])
    else:
        layouts = draw(st.sampled_from([c[1:] for c in CONV_CASES if c[0] == dims]))
    groups = draw(st.sampled_from([1, 2]))
    return dict(
        dims=dims, data_layout=layouts[0], kernel_layout=layouts[1], groups=groups,
        cin=2 * draw(st.integers(1, 3)), cout=2 * draw(st.integers(1, 3)),
        bias=draw(st.booleans()), transpose=transpose,
        epsilon=draw(st.sampled_from([1e-5, 1e-3, 0.1])),
        dtype=draw(st.sampled_from(["float32", "float32", "float16"])),
        seed=draw(st.integers(0, 2**16)),
    )


@given(config=conv_configs())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_random_convs_fold_exactly(config):
    """fp32 within 1e-5; fp16 within its own rounding (both graphs round differently)."""
    mod, x = conv_bn_module(**config)
    check_folds(mod, x, tol=1e-5 if config["dtype"] == "float32" else 2e-2)
