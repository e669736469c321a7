"""The conformance corpus: real CNN topologies nobody here wrote, built without downloads.

Nine come with the ``onnx`` package (``onnx/backend/test/data/light``), exactly as their
exporters wrote them (Caffe2 / IR 3, opset 9: ``Sum``, ``LRN``, ``Dropout``, Caffe's BN +
Scale, channel shuffles), with ``ConstantOfShape`` placeholder weights: :func:`corpus_model`
seeds them and calibrates each BatchNorm to the statistics its input really has. Three are
trained PaddleOCR models shipped in the ``rapidocr-onnxruntime`` wheel (DBNet text detector,
PP-LCNet + SVTR recognizer, MobileNetV3 direction classifier): :func:`trained_model`.

    proto = corpus_model("shufflenet", size=64)
    proto = trained_model("ocr_det")  # input (1, 3, 96, 96)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import BNFoldError
from .models import _RESNET50_ONNX, _graph_inputs, _he_normal, _with_input_shapes

_LIGHT_DIR = _RESNET50_ONNX.parent
_CORPUS_FILES = {
    "resnet50_caffe2": "light_resnet50.onnx",
    "densenet121": "light_densenet121.onnx",
    "inception_v1": "light_inception_v1.onnx",
    "inception_v2": "light_inception_v2.onnx",
    "shufflenet": "light_shufflenet.onnx",
    "squeezenet": "light_squeezenet.onnx",
    "vgg19": "light_vgg19.onnx",
    "alexnet": "light_bvlc_alexnet.onnx",
    "zfnet512": "light_zfnet512.onnx",
}
#: Square input sizes each corpus model accepts: (smallest, largest), None for no upper limit.
#: The three with a fixed-size classifier (Reshape to (1, C*h*w) -> Gemm) accept only the sizes
#: whose last feature map is the native one; the others have a global pooling before the head.
CORPUS_SIZES: dict[str, tuple[int, int | None]] = {
    "resnet50_caffe2": (33, None),
    "densenet121": (32, None),
    "inception_v1": (61, None),
    "inception_v2": (32, None),
    "shufflenet": (33, None),
    "squeezenet": (33, None),
    "vgg19": (224, 255),
    "alexnet": (211, 242),
    "zfnet512": (219, 226),
}
# The calibration batch: at least 4 images and 256x256 samples per channel at the input.
_CALIBRATION_IMAGES, _CALIBRATION_PIXELS = 4, 256 * 256
_PARAM_PATH_OPS = frozenset({"Reshape", "Unsqueeze", "Identity"})  # parameter -> its real user


def corpus_model(name: str, size: int = 224, seed: int = 0) -> onnx.ModelProto:
    """One of the nine ``onnx/backend/test/data/light`` models (see ``CORPUS``), exactly as
    shipped (IR 3, opset 9, its ops and node names: Sum, LRN, Dropout, Caffe's BN + Scale as
    BatchNormalization + Unsqueeze/Mul/Add, ...) with real numbers in it, input (1, 3, size, size).

    Every ConstantOfShape placeholder and every float tensor shipped with it (a few trained
    biases and BN tensors that would not match random convs) becomes a seeded initializer,
    listed in the graph inputs as IR 3 requires: conv weights He-normal (``_he_normal``),
    Gemm weights and biases N(0, 0.01^2) (``_linear``), conv biases and additive scale-layer
    terms N(0, 0.1^2), BatchNorm and multiplicative scale-layer factors U(0.5, 1.5), BN beta
    N(0, 0.1^2). Then, on the seeded batch ``corpus_calibration_input(size, seed)``, in
    topological order: each BatchNorm's mean and var become the statistics its input really
    has, and each Conv/Gemm with no BatchNorm downstream (all of them in the nets without BN,
    the classifier in the others) is rescaled so that its output before the bias has RMS 1.

    Changes for ``size`` other than 224, only where the size forces them: the constants of the
    channel-shuffle Reshapes (ShuffleNet) get the new height and width, and a final
    AveragePool whose window covers the whole 224x224 feature map gets a kernel that covers the
    new one (it stays global). Sizes each model accepts: ``CORPUS_SIZES``; others raise
    BNFoldError. Needs onnxruntime (calibration runs the graph).
    """
    if name not in _CORPUS_FILES:
        raise BNFoldError(f"unknown corpus model {name!r} (corpus: {', '.join(_CORPUS_FILES)})")
    if int(size) != size or size < 1:
        raise BNFoldError(f"corpus model {name!r}: input size must be a positive int, not {size!r}")
    proto = onnx.load(_LIGHT_DIR / _CORPUS_FILES[name])
    graph = proto.graph
    params, placeholders = _corpus_params(graph)
    _fit_input_size(name, graph, params, int(size))
    rng = np.random.default_rng(seed)
    consumers = _consumer_map(graph)
    values = {p: _corpus_init(rng, name, p, shape, consumers) for p, shape in params.items()}
    _calibrate(name, proto, values, corpus_calibration_input(int(size), seed))
    _store_params(graph, values, placeholders)
    proto.doc_string = (
        f"{_CORPUS_FILES[name]} from onnx {onnx.__version__} with seeded weights (seed {seed}) "
        f"and calibrated BatchNorm, input {size}x{size} (tvm_bnfold.models.corpus_model)"
    )
    return proto


def corpus_calibration_input(size: int, seed: int = 0) -> np.ndarray:
    """The N(0, 1) batch (n, 3, size, size) that ``corpus_model(..., size, seed)`` calibrates
    on: n = 4 images at 224x224, more at small sizes (16 at 64x64) so that the small feature
    maps of the last layers still give stable statistics. Drawn apart from
    ``random_inputs(model, seed)``."""
    images = max(_CALIBRATION_IMAGES, -(-_CALIBRATION_PIXELS // (size * size)))
    rng = np.random.default_rng([seed, 1])
    return rng.standard_normal((images, 3, size, size), dtype=np.float32)


CORPUS: dict[str, Callable[..., onnx.ModelProto]] = {
    name: functools.partial(corpus_model, name) for name in _CORPUS_FILES
}


def _corpus_params(graph: onnx.GraphProto) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Drop the ConstantOfShape placeholder nodes. Returns the float parameters (placeholder
    outputs and shipped float tensors that nodes use) -> shape, in order of first use, and
    placeholder shape initializer -> parameter name."""
    init = {t.name: t for t in graph.initializer}
    placeholders = {n.input[0]: n.output[0] for n in graph.node if n.op_type == "ConstantOfShape"}
    shapes = {p: tuple(numpy_helper.to_array(init[s]).tolist()) for s, p in placeholders.items()}
    kept = [n for n in graph.node if n.op_type != "ConstantOfShape"]
    del graph.node[:]
    graph.node.extend(kept)
    for t in graph.initializer:
        if t.data_type == TensorProto.FLOAT:
            shapes.setdefault(t.name, tuple(t.dims))
    used = dict.fromkeys(i for n in graph.node for i in n.input)
    return {p: shapes[p] for p in used if p in shapes}, placeholders


def _consumer_map(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    result: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            result.setdefault(name, []).append((node, index))
    return result


def _corpus_init(
    rng: np.random.Generator,
    model: str,
    param: str,
    shape: tuple[int, ...],
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]],
) -> np.ndarray:
    """Seeded value of ``param``, by the op and input slot that finally uses it (through
    Reshape/Unsqueeze of the parameter itself)."""
    name = param
    while len(users := consumers.get(name, [])) == 1 and users[0][0].op_type in _PARAM_PATH_OPS:
        name = users[0][0].output[0]
    roles = {(node.op_type, index) for node, index in users}
    role = roles.pop() if len(roles) == 1 else None
    if role == ("Conv", 1):
        value = _he_normal(rng, shape)
    elif role in {("Gemm", 1), ("Gemm", 2)}:
        value = rng.standard_normal(shape, dtype=np.float32)
        value *= np.float32(0.01)
    elif role in {("Conv", 2), ("BatchNormalization", 2), ("Add", 0), ("Add", 1)}:
        value = rng.normal(0.0, 0.1, shape)
    elif role in {("BatchNormalization", 1), ("Mul", 0), ("Mul", 1)}:
        value = rng.uniform(0.5, 1.5, shape)
    elif role == ("BatchNormalization", 3):
        value = np.zeros(shape)  # calibrated
    elif role == ("BatchNormalization", 4):
        value = np.ones(shape)  # calibrated
    else:
        used = sorted({(n.op_type, n.name, i) for n, i in users})
        raise BNFoldError(f"corpus model {model!r}: no seeding rule for parameter {param!r} {used}")
    return np.asarray(value, dtype=np.float32)


def _store_params(
    graph: onnx.GraphProto, values: dict[str, np.ndarray], placeholders: dict[str, str]
) -> None:
    """Put ``values`` where the placeholders' shape tensors (or the shipped tensors) were, in
    the initializers and, as IR 3 wants, in the graph inputs."""
    # In place: copying VGG-19's 575 MB of initializers into new messages takes seconds.
    for field in (graph.initializer, graph.input):
        unused = []
        for index, item in enumerate(field):
            name = placeholders.get(item.name, item.name)
            if name not in values:
                if item.name in placeholders:  # a placeholder no node reads
                    unused.append(index)
                continue
            array = values[name]
            if isinstance(item, onnx.TensorProto):
                item.Clear()
                item.name, item.data_type = name, TensorProto.FLOAT
                item.dims.extend(array.shape)
                item.raw_data = array.astype("<f4", copy=False).tobytes()
            else:
                item.CopyFrom(helper.make_tensor_value_info(name, TensorProto.FLOAT, array.shape))
        for index in reversed(unused):
            del field[index]


# Sizes ------------------------------------------------------------------------------------


def _data_input(graph: onnx.GraphProto) -> onnx.ValueInfoProto:
    (data,) = [i for i in _graph_inputs(graph) if not i.name.endswith("__SHAPE")]
    return data


def _skeleton(
    graph: onnx.GraphProto,
    params: dict[str, tuple[int, ...]],
    consts: dict[str, onnx.TensorProto] | None = None,
) -> onnx.ModelProto:
    """The graph without weight data: parameters are typed inputs, constants initializers."""
    used = {i for n in graph.node for i in n.input}
    consts = consts or {t.name: t for t in graph.initializer if t.name in used}
    inputs = [_data_input(graph)] + [
        helper.make_tensor_value_info(p, TensorProto.FLOAT, shape) for p, shape in params.items()
    ]
    outputs = [helper.make_tensor_value_info(o.name, TensorProto.FLOAT, None) for o in graph.output]
    inits = [t for name, t in consts.items() if name not in params]
    skeleton = helper.make_graph(graph.node, graph.name, inputs, outputs, initializer=inits)
    return helper.make_model(skeleton, opset_imports=[helper.make_opsetid("", 9)], ir_version=4)


def _infer_shapes(
    graph: onnx.GraphProto, params: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor (ONNX shape inference; it does not reject empty outputs)."""
    inferred = onnx.shape_inference.infer_shapes(_skeleton(graph, params)).graph
    shapes = {}
    for value in [*inferred.input, *inferred.value_info, *inferred.output]:
        if value.type.tensor_type.HasField("shape"):
            dims = value.type.tensor_type.shape.dim
            shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims)
    return shapes


def _fit_input_size(
    model: str, graph: onnx.GraphProto, params: dict[str, tuple[int, ...]], size: int
) -> None:
    """Set the input to (1, 3, size, size), rewriting only what the size forces (see
    ``corpus_model``); BNFoldError where the model cannot take ``size``."""
    lo, hi = CORPUS_SIZES[model]
    accepted = f"{lo}..{hi}" if hi else f">= {lo}"
    dims = _data_input(graph).type.tensor_type.shape.dim
    native_size = dims[2].dim_value
    native = _infer_shapes(graph, params)
    dims[2].dim_value = dims[3].dim_value = size
    shapes = _infer_shapes(graph, params) if size != native_size else native
    consts = {t.name: t for t in graph.initializer}
    uses = _consumer_map(graph)

    def refuse(why: str) -> BNFoldError:
        return BNFoldError(
            f"corpus model {model!r} cannot take a {size}x{size} input: {why}; it accepts "
            f"sizes {accepted} (native {native_size})"
        )

    for node in graph.node:
        old_in, new_in = native.get(node.input[0]), shapes.get(node.input[0])
        if old_in == new_in:
            continue
        if node.op_type == "Reshape" and node.input[1] in consts:
            target = numpy_helper.to_array(consts[node.input[1]]).tolist()
            if target[-2:] != list(old_in[-2:]) or len(uses[node.input[1]]) != 1:
                raise refuse(
                    f"Reshape {node.name!r} reshapes to the fixed {tuple(target)} "
                    f"(from {old_in} at {native_size}x{native_size}), its input is now {new_in}"
                )
            target[-2:] = new_in[-2:]  # a channel shuffle: (1, g, c/g, h, w) and back
            consts[node.input[1]].CopyFrom(
                numpy_helper.from_array(np.array(target, np.int64), node.input[1])
            )
        elif node.op_type == "AveragePool" and native[node.output[0]][2:] == (1, 1):
            attrs = {a.name: a for a in node.attribute}
            kernel = list(attrs["kernel_shape"].ints)
            pads = list(attrs["pads"].ints) if "pads" in attrs else [0] * 2 * len(kernel)
            spatial = len(kernel)
            covers = all(kernel[k] >= old_in[2 + k] + pads[k] for k in range(spatial))
            if "count_include_pad" in attrs or not covers:
                continue
            attrs["kernel_shape"].ints[:] = [
                new_in[2 + k] + pads[k] + pads[spatial + k] for k in range(spatial)
            ]
        else:
            continue
        shapes = _infer_shapes(graph, params)

    for node in graph.node:
        for out in node.output:
            if out in shapes and min(shapes[out], default=1) < 1:
                raise refuse(f"{node.op_type} {node.name!r} would output {shapes[out]}")
        if node.op_type in ("MaxPool", "AveragePool", "Conv") and node.input[0] in shapes:
            # ONNX Runtime rounds a window larger than its padded input to one output; TVM's
            # importer to none
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            spatial = shapes[node.input[0]][2:]
            kernel = attrs.get("kernel_shape")
            if kernel is None:  # a Conv's window is its weight's
                kernel = (shapes.get(node.input[1]) or params[node.input[1]])[2:]
            pads = attrs.get("pads", [0] * 2 * len(kernel))
            if any(spatial[k] + pads[k] + pads[len(kernel) + k] < kernel[k]
                   for k in range(len(kernel))):
                raise refuse(f"{node.op_type} {node.name!r}: its {tuple(kernel)} window is larger "
                             f"than its padded {tuple(spatial)} input")
        if node.op_type == "Gemm":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            a_shape, b_shape = shapes[node.input[0]], shapes[node.input[1]]
            k_a = a_shape[0 if attrs.get("transA") else 1]
            k_b = b_shape[1 if attrs.get("transB") else 0]
            if k_a != k_b:
                raise refuse(f"Gemm {node.name!r} takes {k_b} features and would get {k_a}")
        if node.op_type == "Reshape":
            old, new = shapes[node.input[0]], shapes[node.output[0]]
            if np.prod(old) != np.prod(new):
                raise refuse(f"Reshape {node.name!r} cannot reshape {old} to {new}")
    for out in graph.output:
        if shapes[out.name] != native[out.name]:
            raise refuse(f"output {out.name!r} would be {shapes[out.name]}")


# Calibration ------------------------------------------------------------------------------


def _calibrate(
    model: str, proto: onnx.ModelProto, values: dict[str, np.ndarray], batch: np.ndarray
) -> None:
    """Set BatchNorm statistics and head scales in ``values`` on ``batch`` (see
    ``corpus_model``), with ONNX Runtime.

    Each tensor gets a round: the number of calibrated nodes upstream of it. Round r runs the
    nodes of round r in one ONNX Runtime session, fed the (cached) tensors of earlier rounds;
    then the calibrated nodes whose inputs are now complete take their statistics, and their
    outputs (a BatchNorm's computed in numpy, a rescaled Conv/Gemm's corrected) go to the
    cache. Every node runs once: the whole calibration costs one forward pass of the batch.
    """
    try:
        import onnxruntime as ort
    except ImportError as err:
        raise BNFoldError("corpus models need onnxruntime to calibrate their weights") from err

    graph = proto.graph
    opset = list(proto.opset_import)
    nodes = list(graph.node)
    data = _data_input(graph).name
    consts = {t.name: t for t in graph.initializer if t.name not in values}
    producer = {o: n for n in nodes for o in n.output}
    feeds_bn: set[str] = set()
    for node in reversed(nodes):
        if node.op_type == "BatchNormalization" or feeds_bn.intersection(node.output):
            feeds_bn.update(node.input)

    # Step 1. Rounds, and the calibration batch through every Reshape of activations.
    round_of: dict[str, int] = {}
    dynamic = {data}
    steps: dict[int, list[onnx.NodeProto]] = {}  # round -> ORT nodes
    finish: dict[int, list[onnx.NodeProto]] = {}  # round -> nodes calibrated at its end
    last_use: dict[str, int] = {}
    for node in nodes:
        r = max((round_of.get(i, 0) for i in node.input if i), default=0)
        for i in node.input:
            last_use[i] = r
        is_bn = node.op_type == "BatchNormalization"
        rescale = node.op_type in {"Conv", "Gemm"} and not feeds_bn.intersection(node.output)
        if not is_bn:
            steps.setdefault(r, []).append(node)
        if is_bn or rescale:
            finish.setdefault(r, []).append(node)
        for out in node.output:
            round_of[out] = r + (is_bn or rescale)
        if dynamic.intersection(node.input):
            dynamic.update(node.output)
            if node.op_type == "Reshape" and node.input[1] in consts:
                target = numpy_helper.to_array(consts[node.input[1]])
                if target[0] == 1:  # the batch: 0 copies it
                    consts[node.input[1]] = numpy_helper.from_array(
                        np.concatenate([[0], target[1:]]).astype(np.int64), node.input[1]
                    )
    for out in graph.output:
        last_use[out.name] = len(nodes)

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    cache = {data: batch}
    for r in range(max(steps.keys() | finish.keys()) + 1):
        # Step 2. Run round r in ONNX Runtime, keeping what later rounds and Step 3 read.
        round_nodes = steps.get(r, [])
        made = {o for n in round_nodes for o in n.output}
        read_now = {n.input[0] for n in finish.get(r, [])}
        needed = dict.fromkeys(i for n in round_nodes for i in n.input if i and i not in made)
        fed = [i for i in needed if i not in consts]
        kept = [o for o in made if last_use.get(o, -1) > r or o in read_now]
        if kept:
            sub = helper.make_graph(
                round_nodes,
                f"{graph.name}_round{r}",
                [helper.make_tensor_value_info(i, TensorProto.FLOAT, None) for i in fed],
                [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in kept],
                initializer=[consts[i] for i in needed if i in consts],
            )
            sub_model = helper.make_model(sub, opset_imports=opset, ir_version=4)
            session = ort.InferenceSession(
                sub_model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
            feed = {i: cache[i] if i in cache else values[i] for i in fed}
            cache.update(zip(kept, session.run(kept, feed), strict=True))
        # Step 3. Calibrate the nodes whose inputs are complete.
        for node in finish.get(r, []):
            if node.op_type == "BatchNormalization":
                cache[node.output[0]] = _calibrate_bn(node, cache[node.input[0]], values)
            else:
                cache[node.output[0]] = _rescale_head(
                    model, node, cache[node.output[0]], values, producer
                )
        for name in [n for n in cache if last_use.get(n, -1) <= r]:
            del cache[name]

    for out in graph.output:
        if not np.isfinite(cache[out.name]).all():
            raise BNFoldError(f"corpus model {model!r}: output {out.name!r} is not finite")


def _calibrate_bn(node: onnx.NodeProto, x: np.ndarray, values: dict[str, np.ndarray]) -> np.ndarray:
    """Set the BatchNorm's mean and var to those of ``x`` per channel; returns its output."""
    if len(node.output) != 1 or not all(i in values for i in node.input[1:]):
        raise BNFoldError(f"BatchNormalization {node.name!r}: expected one output, parameters")
    gamma, beta, mean_name, var_name = node.input[1:]
    axes = (0, *range(2, x.ndim))
    mean, var = x.mean(axis=axes, dtype=np.float64), x.var(axis=axes, dtype=np.float64)
    values[mean_name], values[var_name] = mean.astype(np.float32), var.astype(np.float32)
    eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    per_channel = (-1,) + (1,) * (x.ndim - 2)
    scale = (values[gamma] / np.sqrt(var + eps)).reshape(per_channel)
    shift = values[beta].reshape(per_channel) - mean.reshape(per_channel) * scale
    return (x * scale + shift).astype(np.float32)


def _rescale_head(
    model: str,
    node: onnx.NodeProto,
    y: np.ndarray,
    values: dict[str, np.ndarray],
    producer: dict[str, onnx.NodeProto],
) -> np.ndarray:
    """Scale the Conv/Gemm weight so its output before the bias has RMS 1 on this batch;
    returns the output ``y`` (computed with the old weight) corrected to the new one."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    bias = np.float32(0.0)
    if len(node.input) > 2 and node.input[2]:
        if node.input[2] not in values:
            raise BNFoldError(f"{node.op_type} {node.name!r}: bias is not a parameter")
        bias = values[node.input[2]] * np.float32(attrs.get("beta", 1.0))
        if node.op_type == "Conv":
            bias = bias.reshape((-1,) + (1,) * (y.ndim - 2))
    core = y - bias
    rms = float(np.sqrt(np.mean(np.square(core, dtype=np.float64))))
    if not np.isfinite(rms) or rms == 0:
        raise BNFoldError(f"corpus model {model!r}: {node.op_type} {node.name!r} outputs RMS {rms}")
    weight = node.input[1]
    while weight not in values:  # a Reshape/Unsqueeze of the weight parameter
        if weight not in producer or producer[weight].op_type not in _PARAM_PATH_OPS:
            raise BNFoldError(f"{node.op_type} {node.name!r}: weight is not a parameter")
        weight = producer[weight].input[0]
    values[weight] *= np.float32(1.0 / rms)  # our own array
    return (core * np.float32(1.0 / rms) + bias).astype(np.float32)


# Trained models from PyPI wheels -------------------------------------------------------------

#: name -> (distribution, file inside it, the input shape its app feeds (NCHW), what it is).
TRAINED = {
    "ocr_det": ("rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                (1, 3, 96, 96), "PP-OCRv4 DBNet text detector (Resize, ConvTranspose + BN, SE)"),
    "ocr_rec": ("rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                (1, 3, 48, 320), "PP-OCRv4 recognizer (PP-LCNet + SVTR: HardSwish, SE, attention)"),
    "ocr_cls": ("rapidocr-onnxruntime",
                "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                (1, 3, 48, 192), "PP-OCR direction classifier (MobileNetV3: HardSwish, SE)"),
}


def trained_model(name: str) -> onnx.ModelProto:
    """A trained CNN of :data:`TRAINED`, its input given the static shape of :data:`TRAINED`
    (the export's own is dynamic). BNFoldError when its wheel is not installed (``make test``
    installs it)."""
    if name not in TRAINED:
        raise BNFoldError(f"unknown trained model {name!r} (known: {', '.join(TRAINED)})")
    dist, file, shape, _ = TRAINED[name]
    try:
        path = Path(metadata.distribution(dist).locate_file(file))
    except metadata.PackageNotFoundError as err:
        raise BNFoldError(f"trained model {name!r} ships in the {dist} wheel, which is not "
                          f"installed (pip install --no-deps {dist})") from err
    if not path.is_file():
        raise BNFoldError(f"trained model {name!r}: {path} is missing from {dist}")
    proto = onnx.load(path)
    return _with_input_shapes(proto, {_graph_inputs(proto.graph)[0].name: list(shape)})


#: Every model of the corpus by name: the nine at their native size, the trained ones.
MODELS: dict[str, Callable[[], onnx.ModelProto]] = {
    **{name: functools.partial(corpus_model, name) for name in _CORPUS_FILES},
    **{name: functools.partial(trained_model, name) for name in TRAINED},
}
