"""Canonicalize: the importer's forms become plain ops, exactly; and the blocked layout's graph
steps that real models need (region ends, 1x1 transforms as views, constants packed in numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from _util import assert_close, constants, function, run, tensor_var
from tvm_bnfold.bench import op_counts
from tvm_bnfold.blocked_layout import pack, to_blocked
from tvm_bnfold.canonicalize import Canonicalize

R = relax.op


def _c(array) -> relax.Expr:
    return relax.const(np.asarray(array, np.float32))


@pytest.mark.parametrize(("reduce", "binary"), [(R.sum, "add"), (R.max, "maximum"),
                                                 (R.min, "minimum")])
def test_stack_and_reduce_of_three_becomes_pairwise(reduce, binary):
    shape = (1, 4, 3, 3)
    params = [tensor_var(n, shape) for n in "abc"]

    def body(bb, *xs):
        copies = [bb.emit(R.broadcast_to(x, shape)) for x in xs]
        return reduce(bb.emit(R.stack(copies, axis=0)), axis=[0])

    mod = function(params, body)
    out = Canonicalize()(mod)
    counts = op_counts(out)
    assert counts[binary] == 2 and not counts["stack"] and not counts["broadcast_to"]
    rng = np.random.default_rng(0)
    inputs = [rng.normal(size=shape).astype("float32") for _ in params]
    assert_close(run(out, *inputs), run(mod, *inputs))


@pytest.mark.parametrize(("shapes", "pairwise"), [
    ([(1, 4, 1, 1), (1, 1, 3, 3), (1, 4, 3, 3)], True),  # pairwise broadcasting reaches S
    ([(1, 4, 1, 1), (1, 4, 1, 1)], False),  # only the broadcast_to makes them (1, 4, 3, 3)
])
def test_pairwise_only_where_it_has_the_stacked_shape(shapes, pairwise):
    params = [tensor_var(n, s) for n, s in zip("abc", shapes, strict=False)]

    def body(bb, *xs):
        copies = [bb.emit(R.broadcast_to(x, (1, 4, 3, 3))) for x in xs]
        return R.sum(bb.emit(R.stack(copies, axis=0)), axis=[0])

    mod = function(params, body)
    out = Canonicalize()(mod)
    assert (op_counts(out)["stack"] == 0) == pairwise
    rng = np.random.default_rng(5)
    inputs = [rng.normal(size=s).astype("float32") for s in shapes]
    assert_close(run(out, *inputs), run(mod, *inputs))


def test_clip_rank3_constant_and_dropout():
    x = tensor_var("x", (1, 8, 4, 4))
    scale = np.linspace(0.5, 1.5, 8, dtype=np.float32).reshape(8, 1, 1)

    def body(bb, x):
        y = bb.emit(R.multiply(x, _c(scale)))  # Caffe's Scale: a (C, 1, 1) constant
        y = bb.emit(R.clip(y, 0, 6))
        return relax.TupleGetItem(bb.emit(R.nn.dropout(y, 0.5)), 0)

    mod = function([x], body)
    out = Canonicalize()(mod)
    counts = op_counts(out)
    assert not counts["clip"] and not counts["nn.dropout"]
    assert counts["maximum"] == counts["minimum"] == 1
    shapes = [[int(d) for d in c.value.shape] for c in _constants(out) if c.value.ndim]
    assert shapes == [[1, 8, 1, 1]]
    data = np.random.default_rng(1).normal(0, 4, (1, 8, 4, 4)).astype("float32")
    np.testing.assert_array_equal(run(out, data), np.clip(data * scale, 0, 6))


def test_the_importers_clip_bounds_are_folded_in_numpy():
    """ONNX Clip with min / max inputs imports as ``where(isnan(c), -inf, c)`` per bound: two
    ops on constants that FoldConstant would compile with LLVM. Canonicalize folds them."""
    from onnx import TensorProto, helper

    from tvm_bnfold.models import load_onnx

    bounds = [helper.make_tensor(n, TensorProto.FLOAT, [], [v]) for n, v in (("lo", 0.0),
                                                                              ("hi", 6.0))]
    graph = helper.make_graph(
        [helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], "clip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 3, 3])], bounds)
    mod = load_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    assert op_counts(mod)["isnan"] == op_counts(mod)["where"] == 2  # the importer's form
    out = Canonicalize()(mod)
    assert not op_counts(out)["isnan"] and not op_counts(out)["where"]
    data = np.random.default_rng(2).normal(0, 5, (1, 4, 3, 3)).astype("float32")
    np.testing.assert_array_equal(run(out, data), np.clip(data, 0, 6))


def test_gemms_transposed_weight_and_reshaped_bias_are_folded_in_numpy():
    """ONNX Gemm (transB) imports as ``matmul(x, permute_dims(W))``, a bias as a reshape of a
    constant: both fold here, exactly, and the caller's constants stay as they were."""
    from onnx import TensorProto, helper, numpy_helper

    from tvm_bnfold.models import load_onnx

    rng = np.random.default_rng(3)
    w, b = rng.normal(size=(300, 517)).astype("float32"), rng.normal(size=300).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1),
         helper.make_node("Reshape", ["b", "s"], ["b4"]),
         helper.make_node("Reshape", ["g", "s4"], ["g4"]),
         helper.make_node("Add", ["g4", "b4"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 517])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 300, 1, 1])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
         numpy_helper.from_array(np.array([1, 300, 1, 1], np.int64), "s"),
         numpy_helper.from_array(np.array([2, 300, 1, 1], np.int64), "s4")])
    mod = load_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    before = [c.copy() for c in constants(mod)]
    out = Canonicalize()(mod)
    counts = op_counts(out)
    assert not counts["permute_dims"] and counts["reshape"] == 1, counts  # g's reshape stays
    folded = {c.shape: c for c in constants(out)}
    np.testing.assert_array_equal(folded[(517, 300)], w.T)
    np.testing.assert_array_equal(folded[(1, 300, 1, 1)], b.reshape(1, 300, 1, 1))
    assert all(np.array_equal(a, c) for a, c in zip(before, constants(mod), strict=True))
    data = rng.normal(size=(2, 517)).astype("float32")
    assert_close(run(out, data), run(mod, data))


def test_constant_values_are_a_read_only_view():
    from tvm_bnfold.fold_bn import constant, values

    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = values(constant(array))
    np.testing.assert_array_equal(view, array)
    with pytest.raises(ValueError):
        view[0, 0] = 1.0  # a constant of a module is never written through
    assert values(constant(np.float32(2.5))).shape == ()


@pytest.mark.parametrize("shape", [(1,), (1, 1, 1, 1)])
def test_a_one_element_constant_is_a_scalar_and_the_model_still_blocks(shape):
    """PP-LCNet's written-out HardSwish (ocr_rec) multiplies by (1,) constants; as (1, 1, 1, 1)
    ConvertLayout failed inside TVM and the whole model stayed in NCHW."""
    rng = np.random.default_rng(2)
    w = _c(rng.normal(0, 0.3, (16, 16, 1, 1)))
    x = tensor_var("x", (1, 16, 5, 5))
    wide = np.full((2, 1, 1, 1, 1), 0.5, np.float32)  # higher rank than x: stays as it is

    def body(bb, x):
        y = bb.emit(R.nn.conv2d(x, w))
        y = bb.emit(R.add(bb.emit(R.multiply(y, _c(np.full(shape, 0.25)))), _c([3.0])))
        return R.nn.conv2d(y, w)

    mod = function([x], body)
    out = Canonicalize()(mod)
    assert sorted(c.value.ndim for c in _constants(out)) == [0, 0, 4, 4]
    data = rng.normal(0, 2, (1, 16, 5, 5)).astype("float32")
    assert_close(run(out, data), run(mod, data))
    blocked, records = to_blocked(out, 8, {})
    assert not [r for r in records if "not applied" in str(r)], records
    assert_close(run(blocked, data), run(mod, data))
    higher = function([x], lambda bb, x: R.multiply(x, _c(wide)))
    (kept,) = _constants(Canonicalize()(higher))
    assert kept.value.shape == (2, 1, 1, 1, 1)


def test_a_multiply_or_divide_by_ones_is_its_input_and_nothing_else_is():
    """ocr_rec's SiLU is x * sigmoid(x * 1.0): the multiply by 1.0 goes. Ones that broadcast x
    to a larger shape, 1 / x and x * 2 stay."""
    x = tensor_var("x", (1, 16, 4, 4))
    ones = np.ones((1, 16, 1, 1), np.float32)

    def body(bb, x):
        y = bb.emit(R.sigmoid(bb.emit(R.multiply(x, _c(1.0)))))
        y = bb.emit(R.multiply(bb.emit(R.divide(y, _c(ones))), bb.emit(R.multiply(_c(ones), x))))
        kept = [R.multiply(x, _c(np.ones((2, 16, 4, 4)))), R.divide(_c(1.0), x),
                R.multiply(x, _c(2.0))]
        return relax.Tuple([y, *[bb.emit(k) for k in kept]])

    mod = function([x], body)
    counts = op_counts(Canonicalize()(mod))
    assert counts["multiply"] == 3 and counts["divide"] == 1  # y * x and the three kept
    data = np.random.default_rng(3).normal(0, 2, (1, 16, 4, 4)).astype("float32")
    data[0, 0, 0, :3] = [-0.0, np.inf, np.nan]
    out = relax.VirtualMachine(tvm.compile(Canonicalize()(mod), "llvm"), tvm.cpu())["main"](
        tvm.runtime.tensor(data))
    ref = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())["main"](
        tvm.runtime.tensor(data))
    for got, want in zip(out, ref, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())  # bit for bit, NaN included


def _constants(mod):
    found = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: found.append(e) if isinstance(e, tvm.ir.expr.GenericConst) else None)
    return found


@pytest.mark.parametrize("shape", [(16, 24, 3, 3), (8, 8, 1, 1), (32, 1, 5, 5)])
def test_pack_is_the_layout_transform(shape):
    """Constants packed in numpy equal TVM's own layout_transform of them."""
    index_map = tvm.tirx.IndexMap.from_func(lambda o, i, h, w: (o // 8, i, h, w, o % 8))
    array = np.random.default_rng(2).normal(size=shape).astype("float32")
    want = index_map.map_tensor(tvm.runtime.tensor(array)).numpy()
    np.testing.assert_array_equal(pack(array, index_map), want)


def test_pack_refuses_what_it_cannot_prove_a_bijection():
    array = np.zeros((6, 4), np.float32)
    padded = tvm.tirx.IndexMap.from_func(lambda i, j: (i // 4, j, i % 4))  # 6 = 4 + 2: padding
    assert pack(array, padded) is None
    assert pack(np.zeros((8, 4), np.float32), padded, pad_value=0.0) is None


def test_a_five_d_reshape_ends_the_region_with_a_record():
    """A channel shuffle (the 5-D reshape ConvertLayout crashed on) between two convs: each conv
    is blocked, the shuffle runs in NCHW, and the record says where and why."""
    rng = np.random.default_rng(3)
    w1 = _c(rng.normal(0, 0.3, (16, 16, 1, 1)))
    w2 = _c(rng.normal(0, 0.3, (16, 16, 1, 1)))

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w1))))
        y = bb.emit(R.reshape(y, (1, 2, 8, 4, 4)))
        y = bb.emit(R.reshape(bb.emit(R.permute_dims(y, [0, 2, 1, 3, 4])), (1, 16, 4, 4)))
        return R.nn.conv2d(y, w2)

    mod = function([tensor_var("x", (1, 16, 4, 4))], body)
    blocked, records = to_blocked(mod, 8)
    assert {r.op for r in records} >= {"relax.reshape"}
    assert all("region ends" in str(r) for r in records)
    x = rng.normal(size=(1, 16, 4, 4)).astype("float32")
    assert_close(run(blocked, x), run(mod, x))


def test_a_pooled_map_leaves_the_blocked_layout_as_a_view():
    rng = np.random.default_rng(4)
    w = _c(rng.normal(0, 0.3, (16, 16, 3, 3)))

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w, padding=1))))
        return R.reshape(bb.emit(R.mean(y, axis=[2, 3], keepdims=True)), (1, 16))

    mod = function([tensor_var("x", (1, 16, 6, 6))], body)
    blocked, _ = to_blocked(mod, 8)
    names = [g.name_hint for g in blocked.functions]
    assert sum("layout_transform" in n for n in names) == 1  # only the input's, no way back
    x = rng.normal(size=(1, 16, 6, 6)).astype("float32")
    assert_close(run(blocked, x), run(mod, x))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_flattened_map_before_a_classifier_is_a_view_of_the_blocked_layout(batch):
    """VGG's head: the flatten of the last pooled map reads the blocked layout as it is, the
    classifier's weight rows permuted to match (exact); where the flatten has a second use
    (two classifiers), the map goes back to NCHW first."""
    rng = np.random.default_rng(6)
    w = _c(rng.normal(0, 0.3, (16, 16, 3, 3)))
    fc = [_c(rng.normal(0, 0.1, (16 * 3 * 3, 10))) for _ in range(2)]

    def head(classifiers):
        def body(bb, x):
            y = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w, padding=1))))
            y = bb.emit(R.nn.max_pool2d(y, pool_size=2, strides=2))
            flat = bb.emit(R.reshape(y, (batch, 16 * 3 * 3)))
            outs = [bb.emit(R.matmul(flat, f)) for f in fc[:classifiers]]
            return outs[0] if classifiers == 1 else R.add(*outs)
        return function([tensor_var("x", (batch, 16, 6, 6))], body)

    x = rng.normal(size=(batch, 16, 6, 6)).astype("float32")
    for classifiers, transforms in ((1, 1), (2, 2)):
        mod = head(classifiers)
        blocked, _ = to_blocked(mod, 8)
        names = [g.name_hint for g in blocked.functions]
        assert sum("layout_transform" in n for n in names) == transforms
        assert_close(run(blocked, x), run(mod, x))
