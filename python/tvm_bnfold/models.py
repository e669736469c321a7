"""Load ONNX models into Relax, and the built-in demo CNNs with BatchNorm.

The built-ins need no download: ``resnet50()`` takes the real ResNet-50 graph that ships inside
the ``onnx`` package (its weights there are placeholders) and ``mobilenetv2()`` is generated
with ``onnx.helper``. Both get seeded random weights with inference BatchNorm statistics that
keep activations bounded through the whole network, so folding and fusion have real numbers to
preserve.

    mod = load_onnx(get_model("resnet50"), shapes={"data": (1, 3, 64, 64)})
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
import tvm
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

from .errors import BNFoldError

logger = logging.getLogger(__name__)

INPUT_NAME = "data"
_OPSET = 13
_IR_VERSION = 8
_RESNET50_ONNX = Path(onnx.__file__).parent / "backend/test/data/light/light_resnet50.onnx"
# Ops the importer handles outside its convert map.
_IMPORTER_BUILTIN_OPS = frozenset({"Constant", "If"})


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_onnx(
    model: str | os.PathLike | onnx.ModelProto,
    shapes: dict[str, Sequence[int]] | None = None,
) -> tvm.IRModule:
    """Import an ONNX model (path or ModelProto) as a Relax module whose weights are constants.

    ``shapes`` overrides graph input shapes, e.g. ``{"data": (1, 3, 64, 64)}``. The caller's
    ModelProto is not modified. Raises BNFoldError for a missing or non-ONNX file, an unknown
    input name in ``shapes``, ops TVM's ONNX importer does not support and any other error of
    that importer (shapes that do not broadcast, say).
    """
    from tvm.relax.frontend.onnx import from_onnx

    proto = model if isinstance(model, onnx.ModelProto) else _read_onnx(Path(model))
    if not proto.HasField("graph"):
        raise BNFoldError("ONNX model has no graph")
    _check_ops(proto)
    shape_dict = _shape_overrides(proto, shapes or {})
    proto = _fold_static_shapes(proto, shape_dict)

    start = time.perf_counter()
    try:
        mod = from_onnx(proto, shape_dict=shape_dict, keep_params_in_input=False)
    except NotImplementedError as err:  # tvm.error.OpNotImplemented is one
        raise BNFoldError(f"TVM's ONNX importer cannot import this model: {err}") from err
    except Exception as err:  # its shape inference (ValueError), a TVM InternalError, ...
        raise BNFoldError(f"TVM's ONNX importer cannot import this model: "
                          f"{type(err).__name__}: {_last_words(err)}") from err
    logger.info(
        "imported ONNX graph %r (%d nodes) in %.2f s",
        proto.graph.name,
        len(proto.graph.node),
        time.perf_counter() - start,
    )
    return mod


def _last_words(err: Exception, limit: int = 300) -> str:
    """The end of an error's last line, where TVM says what was wrong (its messages print
    whole operator definitions before that); the whole error stays chained as the cause."""
    lines = str(err).strip().splitlines() or [""]
    last = lines[-1].strip()
    return last if len(last) <= limit else "..." + last[-limit:]


def _read_onnx(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise BNFoldError(f"ONNX model file not found: {path}" + " (a directory)" * path.is_dir())
    try:
        proto = onnx.load(path)
    except DecodeError as err:
        raise BNFoldError(f"{path} is not an ONNX model: {err}") from err
    if proto.ir_version == 0 or not proto.HasField("graph"):
        raise BNFoldError(f"{path} is not an ONNX model: it has no IR version or no graph")
    return proto


#: Constants small enough to take part in shape arithmetic (axes, starts, ends, dims).
_SHAPE_CONSTANT_SIZE = 64


def _fold_static_shapes(
    proto: onnx.ModelProto, shapes: dict[str, list[int]]
) -> onnx.ModelProto:
    """A copy of ``proto`` where each ``Shape`` of a tensor whose shape is static is a constant,
    and so is every node that computes only from those and small constants (the shape
    arithmetic exporters write: Cast, Slice, Gather, Concat, ...; evaluated with onnx's
    reference evaluator). TVM's importer needs, e.g., a Reshape's target shape constant
    (PaddleOCR's exports compute it from ``Shape``). ``proto`` itself when there is no Shape."""
    from onnx.reference import ReferenceEvaluator

    if not any(n.op_type == "Shape" for n in proto.graph.node):
        return proto
    proto = _with_input_shapes(proto, shapes)
    while _fold_shape_round(proto, ReferenceEvaluator):  # a folded Reshape target can make
        pass  # more shapes static downstream
    return proto


def _fold_shape_round(proto: onnx.ModelProto, evaluator_class) -> int:
    """One round of :func:`_fold_static_shapes` in place (integer arithmetic of small constants
    folds too); returns how many Shapes it folded."""
    known = {}
    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True).graph
    for vi in [*inferred.value_info, *_graph_inputs(proto.graph)]:
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            known[vi.name] = [d.dim_value for d in dims]
    small = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer
             if np.prod(t.dims, dtype=np.int64) <= _SHAPE_CONSTANT_SIZE}
    derived: dict[str, np.ndarray] = {}  # values computed from a static shape
    opset = {o.domain: o.version for o in proto.opset_import}
    folded = 0
    for node in proto.graph.node:
        if node.op_type == "Constant":
            attr = node.attribute[0] if len(node.attribute) == 1 else None
            if attr is not None and attr.name == "value":
                value = numpy_helper.to_array(attr.t)
                if value.size <= _SHAPE_CONSTANT_SIZE:
                    small[node.output[0]] = value
            continue
        if node.op_type == "Shape" and node.input[0] in known:
            attrs = {a.name: a.i for a in node.attribute}
            dims = np.array(known[node.input[0]], np.int64)
            values = [dims[attrs.get("start", 0):attrs.get("end", len(dims))]]
            folded += 1
        elif (node.domain in ("", "ai.onnx") and node.input
              and all(not i or i in derived or i in small for i in node.input)):
            evaluator = evaluator_class(node, opsets=opset)
            values = evaluator.run(None, {i: derived.get(i, small.get(i)) for i in node.input if i})
            if not any(i in derived for i in node.input) and not all(
                    np.issubdtype(np.asarray(v).dtype, np.integer) for v in values):
                continue  # float arithmetic of constants: the importer's to fold
        else:
            continue
        derived.update(zip(node.output, values, strict=True))
        if len(node.output) == 1:
            node.CopyFrom(helper.make_node("Constant", [], [node.output[0]],
                                           value=numpy_helper.from_array(np.asarray(values[0]))))
    _resolve_reshape_zeros(proto, known, {**small, **derived})
    logger.debug("folded %d static shapes", folded)
    return folded


def _resolve_reshape_zeros(proto: onnx.ModelProto, known: dict, constants: dict) -> None:
    """A Reshape target ``0`` means "this dim of the input" (unless ``allowzero``); TVM's
    importer passes it on as a 0-sized dim. Write the dim itself where the input is static."""
    nodes = []
    for node in proto.graph.node:
        allowzero = any(a.name == "allowzero" and a.i for a in node.attribute)
        target = constants.get(node.input[1]) if node.op_type == "Reshape" else None
        if target is not None and not allowzero and 0 in target and node.input[0] in known:
            dims = known[node.input[0]]
            resolved = np.array([dims[k] if d == 0 else d for k, d in enumerate(target)], np.int64)
            name = f"{node.output[0]}__target"
            nodes.append(helper.make_node("Constant", [], [name],
                                          value=numpy_helper.from_array(resolved)))
            node.input[1] = name
        nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)


def _with_input_shapes(proto: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    """A copy of ``proto`` whose graph inputs have the static ``shapes``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for vi in _graph_inputs(copy.graph):
        if vi.name in shapes:
            dims = vi.type.tensor_type.shape.dim
            del dims[:]
            for d in shapes[vi.name]:
                dims.add().dim_value = d
    return copy


def with_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """A copy of a batch-1 ``model`` at batch ``batch``: the first dim of its graph inputs (and
    outputs) set to ``batch``, its recorded intermediate shapes dropped, and each constant
    Reshape target of an activation whose first dim is 1 given ``0`` there (ONNX: that dim of
    the input), so a classifier's flatten (VGG's ``(1, 25088)``) or a channel shuffle follows
    the batch. A target whose input did not carry the batch in its
    first dim then fails to import (its element count differs): never a silent reshape."""
    if not isinstance(batch, int) or batch < 1:
        raise BNFoldError(f"with_batch: the batch must be an int >= 1, got {batch!r}")
    inputs = input_shapes(model)
    if any(shape[:1] != (1,) for shape in inputs.values()):
        raise BNFoldError(f"with_batch: the inputs must have batch 1, got {inputs}")
    copy = _with_input_shapes(model, {n: (batch, *s[1:]) for n, s in inputs.items()})
    graph = copy.graph
    del graph.value_info[:]  # shapes recorded at batch 1
    for output in graph.output:
        dims = output.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value == 1:
            dims[0].dim_value = batch
    initializers = {t.name: t for t in graph.initializer}
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
    for node in graph.node:
        if (node.op_type != "Reshape" or node.input[0] in initializers
                or node.input[0] in constants
                or any(a.name == "allowzero" and a.i for a in node.attribute)):
            continue  # a weight's reshape keeps its shape
        target = node.input[1]
        if target in initializers:
            _batch_free(initializers[target])
        elif target in constants:
            value = next((a for a in constants[target].attribute if a.name == "value"), None)
            if value is not None:
                _batch_free(value.t)
    return copy


def _batch_free(tensor: onnx.TensorProto) -> None:
    """A Reshape target ``[1, ...]`` -> ``[0, ...]``, in place."""
    dims = numpy_helper.to_array(tensor)
    if dims.ndim == 1 and dims.size > 1 and dims[0] == 1:
        dims = dims.copy()
        dims[0] = 0
        tensor.CopyFrom(numpy_helper.from_array(dims, tensor.name))


def _walk_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """All nodes of ``graph``, including those in subgraphs (If branches)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from _walk_nodes(sub)


def _check_ops(proto: onnx.ModelProto) -> None:
    """Name every node whose op TVM's importer lacks, before importing."""
    try:
        from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map
    except ImportError:  # private API moved: from_onnx's own OpNotImplemented still surfaces
        return
    known = _get_convert_map().keys() | _IMPORTER_BUILTIN_OPS
    bad = [n for n in _walk_nodes(proto.graph) if n.op_type not in known]
    if bad:
        listed = ", ".join(f"{n.op_type} (node {n.name or '<unnamed>'!r})" for n in bad)
        raise BNFoldError(f"TVM's ONNX importer does not support op(s): {listed}")


def _graph_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    params = {t.name for t in graph.initializer}
    return [i for i in graph.input if i.name not in params]


def _shape_overrides(
    proto: onnx.ModelProto, shapes: dict[str, Sequence[int]]
) -> dict[str, list[int]]:
    inputs = {i.name: i for i in _graph_inputs(proto.graph)}
    unknown = sorted(set(shapes) - inputs.keys())
    if unknown:
        raise BNFoldError(
            f"shapes given for {unknown}, which are not graph inputs (inputs: {sorted(inputs)})"
        )
    result = {}
    for name, shape in shapes.items():
        dims = [int(d) for d in shape]
        rank = len(inputs[name].type.tensor_type.shape.dim)
        if any(d <= 0 for d in dims) or (rank and rank != len(dims)):
            raise BNFoldError(f"shape {tuple(shape)} for input {name!r}: expected {rank} dims > 0")
        result[name] = dims
    return result


def input_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Static shape of each graph input that is not an initializer."""
    result = {}
    for value in _graph_inputs(model.graph):
        dims = value.type.tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            raise BNFoldError(f"input {value.name!r} has a dynamic shape; pass shapes= to load it")
        result[value.name] = tuple(d.dim_value for d in dims)
    return result


def random_inputs(
    mod_or_model: tvm.IRModule | onnx.ModelProto, seed: int = 0
) -> dict[str, np.ndarray]:
    """Deterministic N(0, 1) inputs for each graph input (of a ModelProto or Relax "main")."""
    if isinstance(mod_or_model, onnx.ModelProto):
        dtypes = {
            v.name: helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
            for v in _graph_inputs(mod_or_model.graph)
        }
        specs = [(name, shape, dtypes[name]) for name, shape in input_shapes(mod_or_model).items()]
    else:
        specs = []
        for param in mod_or_model["main"].params:
            if not all(isinstance(d, tvm.tirx.IntImm) for d in param.ty.shape):
                raise BNFoldError(f"input {param.name!r} has a dynamic shape {param.ty.shape}")
            specs.append((param.name, tuple(int(d) for d in param.ty.shape), str(param.ty.dtype)))
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape, dtype in specs}


# --------------------------------------------------------------------------------------------
# Seeded weights
# --------------------------------------------------------------------------------------------


def _he_normal(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    """Kaiming-normal conv weight (O, I/group, kh, kw), std = sqrt(2 / fan_in), each filter
    centred to zero sum so a conv adds no per-channel offset (keeps running_mean ~ 0 honest)."""
    std = np.sqrt(2.0 / np.prod(shape[1:]), dtype=np.float32)
    weight = rng.standard_normal(shape, dtype=np.float32) * std
    return weight - weight.mean(axis=(1, 2, 3), keepdims=True)


def _bn_stats(
    rng: np.random.Generator, weight: np.ndarray, *, after_relu: bool, branch_end: bool
) -> list[np.ndarray]:
    """Inference BatchNorm (gamma, beta, running_mean, running_var) after a conv with ``weight``.

    running_var is what the conv outputs for inputs of variance v, times U(0.5, 2) per
    channel: v * sum(W^2), with v = 0.34 after BN + ReLU (that of relu(N(0, 1))), else 1.
    running_mean ~ N(0, 0.1^2), as the zero-sum filters output mean ~ 0. ``branch_end`` marks
    the last BN of a residual branch: gamma ~ U(0.1, 0.3) instead of U(0.5, 1.5), as
    zero-init-gamma training leaves it, so the residual stream stays bounded.
    """
    channels = weight.shape[0]
    in_var = 0.34 if after_relu else 1.0
    gamma = rng.uniform(0.1, 0.3, channels) if branch_end else rng.uniform(0.5, 1.5, channels)
    beta = rng.normal(0.0, 0.1, channels)
    mean = rng.normal(0.0, 0.1, channels)
    var = in_var * np.square(weight).sum(axis=(1, 2, 3)) * rng.uniform(0.5, 2.0, channels)
    return [a.astype(np.float32) for a in (gamma, beta, mean, var)]


def _linear(rng: np.random.Generator, out_features: int, in_features: int) -> list[np.ndarray]:
    """Classifier weight (out, in) ~ N(0, 0.01^2) and bias ~ N(0, 0.01^2)."""
    shapes = [(out_features, in_features), (out_features,)]
    return [rng.standard_normal(s, dtype=np.float32) * np.float32(0.01) for s in shapes]


def _make_model(
    nodes: list[onnx.NodeProto], name: str, output: str, params: dict[str, np.ndarray]
) -> onnx.ModelProto:
    """A 224x224 classifier: input ``data``, output ``output`` (1, 1000), weights ``params``."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, [1, 3, 224, 224])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, 1000])],
        initializer=[numpy_helper.from_array(a, n) for n, a in params.items()],
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", _OPSET)],
        ir_version=_IR_VERSION,
        producer_name="tvm_bnfold",
    )


# --------------------------------------------------------------------------------------------
# ResNet-50
# --------------------------------------------------------------------------------------------


def resnet50(seed: int = 0) -> onnx.ModelProto:
    """ResNet-50 v1 (53 Conv -> BatchNorm pairs), input "data" (1, 3, 224, 224), output "prob".

    The graph is the caffe2 export in ``onnx/backend/test/data/light``; all its parameters
    (placeholders, and a few real BN tensors that would not match random convs) are replaced
    by seeded random ones. Changes, all exact at 224x224: the 7x7 AveragePool
    becomes GlobalAveragePool and the fixed Reshape a Flatten (any resolution works), and the
    two-input ``Sum`` residual joins become ``Add`` (TVM imports ``Sum`` as stack + reduce,
    which hides the residual add from epilogue fusion). Opset 9 ops are re-declared as opset
    13, whose semantics are the same for every op used.
    """
    src = onnx.load(_RESNET50_ONNX).graph
    shapes = {}  # parameter name -> shape, from "<name>__SHAPE" placeholders or real tensors
    for tensor in src.initializer:
        if tensor.name.endswith("__SHAPE"):
            shapes[tensor.name.removesuffix("__SHAPE")] = numpy_helper.to_array(tensor).tolist()
        else:
            shapes.setdefault(tensor.name, list(tensor.dims))

    def rename(name: str) -> str:
        return name.removeprefix("gpu_0/").removesuffix("_0")

    src_in, src_out = src.input[0].name, src.output[0].name
    names = {src_in: INPUT_NAME, src_out: "prob"}
    rng = np.random.default_rng(seed)
    nodes, params = [], {}
    convs = {}  # conv output -> (conv input, weight)
    for node in src.node:
        if node.op_type == "ConstantOfShape":
            continue
        op, name = node.op_type, node.name
        ins = [names.get(i, rename(i)) for i in node.input]
        outs = [names.get(o, rename(o)) for o in node.output]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if op == "Conv":
            name = ins[1].removesuffix("_w")
            params[ins[1]] = _he_normal(rng, shapes[node.input[1]])
            convs[outs[0]] = ins[0], params[ins[1]]
        elif op == "BatchNormalization":
            name = ins[1].removesuffix("_s")
            conv_input, weight = convs[ins[0]]
            # Every conv but the stem reads a ReLU output; branch2c ends a residual branch.
            after_relu, branch_end = conv_input != INPUT_NAME, "branch2c" in name
            stats = _bn_stats(rng, weight, after_relu=after_relu, branch_end=branch_end)
            params.update(zip(ins[1:], stats, strict=True))
        elif op == "Gemm":
            params.update(zip(ins[1:], _linear(rng, *shapes[node.input[1]]), strict=True))
        elif op == "AveragePool":
            op, attrs = "GlobalAveragePool", {}
        elif op == "Reshape":
            op, ins, attrs = "Flatten", ins[:1], {"axis": 1}
        elif op == "Sum":
            op = "Add"
        nodes.append(helper.make_node(op, ins, outs, name=name, **attrs))

    return _make_model(nodes, "resnet50", "prob", params)


# --------------------------------------------------------------------------------------------
# MobileNetV2
# --------------------------------------------------------------------------------------------

# (expansion t, output channels c, repeats n, first stride s), as in the paper and torchvision.
_MOBILENETV2_BLOCKS = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


def mobilenetv2(seed: int = 0) -> onnx.ModelProto:
    """MobileNetV2 1.0 as torchvision exports it: 52 Conv (no bias) -> BatchNorm pairs, ReLU6 as
    ``Clip(x, 0, 6)``, 17 inverted residual blocks ``block1..block17`` (10 with a residual
    ``Add``); input "data" (1, 3, 224, 224), output "logits" (1, 1000)."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    params = {"relu6_min": np.array(0.0, np.float32), "relu6_max": np.array(6.0, np.float32)}

    def node(op: str, inputs: list[str], name: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv_bn(
        x: str,
        name: str,
        cin: int,
        cout: int,
        *,
        kernel: int = 1,
        stride: int = 1,
        groups: int = 1,
        relu6: bool = True,
        branch_end: bool = False,
    ) -> str:
        weight = params[f"{name}_w"] = _he_normal(rng, (cout, cin // groups, kernel, kernel))
        node(
            "Conv",
            [x, f"{name}_w"],
            name,
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[kernel // 2] * 4,
            group=groups,
        )
        bn_params = [f"{name}_bn_{p}" for p in ("s", "b", "rm", "riv")]
        # Inputs that come out of a ReLU6 are non-negative; the stream between blocks is linear.
        stats = _bn_stats(rng, weight, after_relu=x.endswith("_relu6"), branch_end=branch_end)
        params.update(zip(bn_params, stats, strict=True))
        y = node("BatchNormalization", [name, *bn_params], f"{name}_bn", epsilon=1e-5)
        return node("Clip", [y, "relu6_min", "relu6_max"], f"{name}_relu6") if relu6 else y

    x = conv_bn(INPUT_NAME, "conv0", 3, 32, kernel=3, stride=2)
    cin, block = 32, 0
    for t, c, n, s in _MOBILENETV2_BLOCKS:
        for i in range(n):
            block += 1
            name, stride = f"block{block}", s if i == 0 else 1
            residual = stride == 1 and cin == c
            y = x if t == 1 else conv_bn(x, f"{name}_expand", cin, cin * t)
            y = conv_bn(y, f"{name}_dw", cin * t, cin * t, kernel=3, stride=stride, groups=cin * t)
            y = conv_bn(y, f"{name}_project", cin * t, c, relu6=False, branch_end=residual)
            x = node("Add", [x, y], f"{name}_add") if residual else y
            cin = c
    x = conv_bn(x, "conv_last", cin, 1280)
    x = node("Flatten", [node("GlobalAveragePool", [x], "pool")], "flatten", axis=1)
    params["fc_w"], params["fc_b"] = _linear(rng, 1000, 1280)
    node("Gemm", [x, "fc_w", "fc_b"], "logits", transB=1)

    return _make_model(nodes, "mobilenetv2", "logits", params)


BUILTIN: dict[str, Callable[[], onnx.ModelProto]] = {
    "resnet50": resnet50,
    "mobilenetv2": mobilenetv2,
}


def get_model(name_or_path: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """A built-in model by name (see ``BUILTIN``), a real model of the test corpus by name
    (``corpus.MODELS``), an .onnx file, or a ModelProto as given."""
    from . import corpus  # it builds on this module

    if isinstance(name_or_path, onnx.ModelProto):
        return name_or_path
    if isinstance(name_or_path, str) and name_or_path in BUILTIN:
        return BUILTIN[name_or_path]()
    if isinstance(name_or_path, str) and name_or_path in corpus.MODELS:
        return corpus.MODELS[name_or_path]()
    path = Path(name_or_path)
    if path.exists():
        return _read_onnx(path)
    raise BNFoldError(
        f"unknown model {str(name_or_path)!r}: no such file, and not a built-in model "
        f"(built-in: {', '.join(BUILTIN)}; corpus: {', '.join(corpus.MODELS)})"
    )
