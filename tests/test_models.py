"""Tests for tvm_bnfold.models: built-in models, ONNX loading and its errors."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_bnfold import models
from tvm_bnfold.errors import BNFoldError


@pytest.fixture(scope="module")
def resnet() -> onnx.ModelProto:
    return models.resnet50()


@pytest.fixture(scope="module")
def mobilenet() -> onnx.ModelProto:
    return models.mobilenetv2()


def _op_counts(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    result = collections.defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            result[name].append(node)
    return result


def _assert_conv_feeds_one_bn(model: onnx.ModelProto) -> None:
    consumers = _consumers(model)
    for conv in (n for n in model.graph.node if n.op_type == "Conv"):
        users = [n.op_type for n in consumers[conv.output[0]]]
        assert users == ["BatchNormalization"], (conv.name, users)


def _relax_op_counts(mod) -> collections.Counter:
    counts = collections.Counter()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            counts[expr.op.name] += 1

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return counts


def _tiny_model(op_type: str, domain: str = "") -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    node = helper.make_node(op_type, ["x"], ["y"], name="odd_node", domain=domain)
    opsets = [helper.make_opsetid("", 13)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    graph = helper.make_graph([node], "tiny", [x], [y])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


# --- built-in models: structure ---------------------------------------------------------------


def test_resnet50_structure(resnet):
    counts = _op_counts(resnet)
    assert counts["Conv"] == 53
    assert counts["BatchNormalization"] == 53
    assert counts["Add"] == 16
    assert "ConstantOfShape" not in counts
    assert "Sum" not in counts
    assert counts["GlobalAveragePool"] == 1 and counts["Flatten"] == 1
    _assert_conv_feeds_one_bn(resnet)
    onnx.checker.check_model(resnet)
    assert models.input_shapes(resnet) == {"data": (1, 3, 224, 224)}
    assert [o.name for o in resnet.graph.output] == ["prob"]
    bn_eps = [
        helper.get_attribute_value(a)
        for n in resnet.graph.node
        for a in n.attribute
        if n.op_type == "BatchNormalization" and a.name == "epsilon"
    ]
    assert bn_eps == [pytest.approx(1e-5)] * 53  # as in the source file


def test_mobilenetv2_structure(mobilenet):
    counts = _op_counts(mobilenet)
    assert counts["Conv"] == 52
    assert counts["BatchNormalization"] == 52
    assert counts["Add"] == 10
    assert counts["Clip"] == 35
    _assert_conv_feeds_one_bn(mobilenet)
    onnx.checker.check_model(mobilenet)
    assert models.input_shapes(mobilenet) == {"data": (1, 3, 224, 224)}

    weights = {t.name: t.dims for t in mobilenet.graph.initializer}
    depthwise = []
    for conv in (n for n in mobilenet.graph.node if n.op_type == "Conv"):
        group = next((a.i for a in conv.attribute if a.name == "group"), 1)
        out_channels, in_per_group = weights[conv.input[1]][:2]
        if group > 1:
            assert group == out_channels and in_per_group == 1, conv.name
            depthwise.append(conv.name)
        assert len(conv.input) == 2, f"{conv.name} has a bias"
    assert len(depthwise) == 17

    bounds = {
        t.name: float(numpy_helper.to_array(t))
        for t in mobilenet.graph.initializer
        if t.name.startswith("relu6_")
    }
    for clip in (n for n in mobilenet.graph.node if n.op_type == "Clip"):
        assert [bounds[i] for i in clip.input[1:]] == [0.0, 6.0]


@pytest.mark.parametrize("build", [models.resnet50, models.mobilenetv2])
def test_builtin_deterministic(build):
    def weights(model):
        return [(t.name, t.SerializeToString()) for t in model.graph.initializer]

    same = weights(build(seed=3))
    assert weights(build(seed=3)) == same
    assert weights(build(seed=4)) != same


def test_builtin_registry_and_get_model(tmp_path, mobilenet):
    assert set(models.BUILTIN) == {"resnet50", "mobilenetv2"}
    assert models.get_model(mobilenet) is mobilenet
    fetched = models.get_model("mobilenetv2")
    assert fetched.SerializeToString() == mobilenet.SerializeToString()
    path = tmp_path / "m.onnx"
    onnx.save(mobilenet, path)
    assert models.get_model(str(path)).SerializeToString() == mobilenet.SerializeToString()
    with pytest.raises(BNFoldError, match=r"'resnet18'.*resnet50, mobilenetv2"):
        models.get_model("resnet18")


# --- built-in models: numerics with ONNX Runtime ----------------------------------------------


@pytest.mark.parametrize("fixture", ["resnet", "mobilenet"])
def test_builtin_activations_bounded(fixture, request):
    ort = pytest.importorskip("onnxruntime")
    model = onnx.ModelProto()
    model.CopyFrom(request.getfixturevalue(fixture))
    bn_outputs = [n.output[0] for n in model.graph.node if n.op_type == "BatchNormalization"]
    logits = next(n.output[0] for n in model.graph.node if n.op_type == "Gemm")
    probes = [*bn_outputs, logits] if logits != model.graph.output[0].name else bn_outputs
    model.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in probes)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, models.random_inputs(model)), strict=True))

    final = outputs[model.graph.output[0].name]
    assert final.shape == (1, 1000)
    assert np.isfinite(final).all() and final.std() > 0
    # Measured (seed 0): max |logit| 1.2 (ResNet-50), 0.6 (MobileNetV2); BN outputs have
    # RMS 0.24..1.5 and max |x| <= 15 in every layer.
    assert 0.05 < np.abs(outputs[logits]).max() < 50
    for name in bn_outputs:
        rms = np.sqrt(np.mean(np.square(outputs[name])))
        assert 0.05 < rms < 10 and np.abs(outputs[name]).max() < 100, (name, rms)


# --- load_onnx --------------------------------------------------------------------------------


def test_load_onnx_resnet50_small(resnet):
    before = resnet.SerializeToString()
    mod = models.load_onnx(resnet, shapes={"data": (1, 3, 64, 64)})
    assert resnet.SerializeToString() == before

    params = mod["main"].params
    assert [p.name for p in params] == ["data"]
    assert [int(d) for d in params[0].ty.shape] == [1, 3, 64, 64]
    counts = _relax_op_counts(mod)
    assert counts["relax.nn.batch_norm"] == 53
    assert counts["relax.nn.conv2d"] == 53

    # Weights are constants (tvm.ir.GenericConst in TVM 0.27; relax.Constant is gone).
    weights = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get("relax.nn.conv2d"):
            weights.append(expr.args[1])

    relax.analysis.post_order_visit(mod["main"].body, visit)
    assert len(weights) == 53 and all(isinstance(w, tvm.ir.Constant) for w in weights)


def test_load_onnx_from_path(tmp_path, mobilenet):
    path = tmp_path / "mobilenetv2.onnx"
    onnx.save(mobilenet, path)
    for model in (path, str(path)):
        mod = models.load_onnx(model)
        assert _relax_op_counts(mod)["relax.nn.batch_norm"] == 52
        assert [int(d) for d in mod["main"].params[0].ty.shape] == [1, 3, 224, 224]


def test_load_onnx_missing_file(tmp_path):
    path = tmp_path / "nowhere.onnx"
    with pytest.raises(BNFoldError, match=r"not found: .*nowhere\.onnx"):
        models.load_onnx(path)


@pytest.mark.parametrize(
    "content",
    [b"hello, this is text\n", bytes(range(256)) * 4, b""],
    ids=["text", "bytes", "empty"],
)
def test_load_onnx_not_onnx(tmp_path, content):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(content)
    with pytest.raises(BNFoldError, match=r"garbage\.onnx is not an ONNX model"):
        models.load_onnx(path)


@pytest.mark.parametrize(("op_type", "domain"), [("Celu", ""), ("FooBar", "com.example")])
def test_load_onnx_unsupported_op(op_type, domain):
    with pytest.raises(BNFoldError, match=rf"{op_type} \(node 'odd_node'\)"):
        models.load_onnx(_tiny_model(op_type, domain))


def test_load_onnx_unsupported_op_without_precheck(monkeypatch):
    monkeypatch.setattr(models, "_check_ops", lambda proto: None)
    with pytest.raises(BNFoldError, match="Celu"):
        models.load_onnx(_tiny_model("Celu"))


def test_an_importer_error_is_a_bnfold_error_naming_it():
    """TVM's importer raises ValueError where shapes do not broadcast (its message prints the
    whole operator first): one line saying what is wrong, the original chained."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    c = numpy_helper.from_array(np.ones(4, np.float32), "c")
    graph = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "g", [x], [y], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(BNFoldError, match=r"importer cannot import.*ValueError.*broadcastable"
                       ) as caught:
        models.load_onnx(model)
    assert isinstance(caught.value.__cause__, ValueError)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400

def test_load_onnx_bad_shapes():
    model = _tiny_model("Relu")
    with pytest.raises(BNFoldError, match=r"'image'.*not graph inputs.*'x'"):
        models.load_onnx(model, shapes={"image": (1, 4)})
    with pytest.raises(BNFoldError, match=r"input 'x'"):
        models.load_onnx(model, shapes={"x": (1, 4, 4)})
    mod = models.load_onnx(model, shapes={"x": (2, 4)})
    assert [int(d) for d in mod["main"].params[0].ty.shape] == [2, 4]


def test_random_inputs():
    model = _tiny_model("Relu")
    first = models.random_inputs(model, seed=1)
    assert list(first) == ["x"] and first["x"].shape == (1, 4) and first["x"].dtype == np.float32
    np.testing.assert_array_equal(models.random_inputs(model, seed=1)["x"], first["x"])
    from_mod = models.random_inputs(models.load_onnx(model), seed=1)
    np.testing.assert_array_equal(from_mod["x"], first["x"])


def test_static_shape_arithmetic_folds_for_the_importer():
    """Reshape(x, Concat(Slice(Shape(x)), [-1])), and a Reshape target 0 ("this dim"): TVM's
    importer needs the targets constant and misreads 0; the fold makes both plain numbers."""
    node = helper.make_node
    const = lambda name, v: node("Constant", [], [name], value=numpy_helper.from_array(  # noqa: E731
        np.array(v, np.int64)))
    nodes = [
        node("Relu", ["x"], ["r"]),
        node("Shape", ["r"], ["s"]),
        const("st", [0]), const("en", [2]),
        node("Slice", ["s", "st", "en"], ["head"]),
        const("tail", [-1]),
        node("Concat", ["head", "tail"], ["target"], axis=0),
        node("Reshape", ["r", "target"], ["y"]),
        const("zero", [0, 0, 4, -1]),
        node("Reshape", ["y", "zero"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "shapes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3, 4, "w"])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    original = proto.SerializeToString()
    mod = models.load_onnx(proto, {"x": (1, 3, 8, 4)})
    assert proto.SerializeToString() == original  # the caller's model is untouched
    assert [int(d) for d in mod["main"].ret_ty.shape.values] == [1, 3, 4, 8]
    x = np.random.default_rng(0).normal(size=(1, 3, 8, 4)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(),
                                  np.maximum(x, 0).reshape(1, 3, 4, 8))


@pytest.mark.parametrize("name", ["shufflenet", "alexnet"])
def test_with_batch_follows_the_batch_through_flattens_and_shuffles(name):
    """ShuffleNet's 5-D channel shuffle and AlexNet's flatten are constant Reshape targets of
    batch 1: at batch 3 each sample's output is what batch 1 gives it (ONNX Runtime on both),
    TVM imports it, and the caller's model is untouched."""
    import onnxruntime as ort

    from _corpus import load

    proto, _ = load(name)
    before = proto.SerializeToString()
    batched = models.with_batch(proto, 3)
    assert proto.SerializeToString() == before
    (input_name, shape), = models.input_shapes(batched).items()
    assert shape[0] == 3
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    one, three = (ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"])
                  for p in (proto, batched))
    got = three.run(None, {input_name: x})[0]
    for i in range(3):
        np.testing.assert_allclose(got[i], one.run(None, {input_name: x[i:i + 1]})[0][0],
                                   rtol=1e-5, atol=1e-6)
    mod = models.load_onnx(batched)
    assert int(mod["main"].ret_ty.shape.values[0]) == 3


def test_with_batch_refuses_a_bad_batch_or_a_batched_model(resnet):
    with pytest.raises(BNFoldError, match="batch must be an int >= 1"):
        models.with_batch(resnet, 0)
    with pytest.raises(BNFoldError, match="inputs must have batch 1"):
        models.with_batch(models.with_batch(resnet, 2), 2)


def test_with_batch_gives_the_outputs_the_batch_too():
    from _corpus import load

    proto, _ = load("squeezenet")  # its output is declared (1, 1000, 1, 1)
    batched = models.with_batch(proto, 2)
    assert batched.graph.output[0].type.tensor_type.shape.dim[0].dim_value == 2
    assert not batched.graph.value_info
