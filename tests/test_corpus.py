"""The conformance corpus: real CNNs nobody here wrote, through FoldBN + FuseEpilogue + compile,
against the unfolded module compiled by TVM and against ONNX Runtime (1e-4 relative), with never
more kernels than stock TVM fusion."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from tvm import relax

from _corpus import MODELS, load
from tvm_bnfold import BNFoldError, FoldBN, FuseEpilogue, chips, corpus
from tvm_bnfold.bench import STOCK_TVM, layout_kernel_count, op_counts
from tvm_bnfold.fuse_epilogue import fuse_graph, kernel_count, schedule_kernels, tvm_fusion
from tvm_bnfold.models import _with_input_shapes, random_inputs

CHIP = chips.host_chip()


def stock(mod: tvm.IRModule) -> tvm.IRModule:
    """Stock TVM: its BatchNorm decomposition and fusion, unfolded."""
    return tvm.transform.Sequential([*STOCK_TVM, *tvm_fusion()])(mod)


def run(mod: tvm.IRModule, inputs: list[np.ndarray]) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, CHIP.target), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", MODELS)
def test_real_model_folds_fuses_and_matches_tvm_and_onnxruntime(name):
    proto, mod = load(name)
    before = mod["main"].script(show_meta=True)
    # measure=False: the spill measurement is tested on its own; here, the graph and numerics.
    fuse = FuseEpilogue(measure=False)
    folded = FoldBN()(mod)
    assert op_counts(folded)["nn.batch_norm"] == 0
    with CHIP.target:
        ours = fuse(folded)
        unfolded = stock(mod)
        assert kernel_count(ours) <= kernel_count(unfolded), fuse.layout_report
        unfolded, _ = schedule_kernels(unfolded, CHIP, measure=False)  # NCHW default schedules
    assert mod["main"].script(show_meta=True) == before  # the caller's module is untouched

    inputs = list(random_inputs(mod, seed=1).values())
    got = run(ours, inputs)
    reference = run(unfolded, inputs)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    peer = session.run(None, {session.get_inputs()[0].name: inputs[0]})[0]
    assert np.isfinite(got).all()
    assert relative(got, reference) <= 1e-4
    # TVM's own import of the text detector differs from ONNX Runtime's (its Resize): compare
    # ours with ONNX Runtime no worse than TVM's unfolded module is.
    assert relative(got, peer) <= max(1e-4, relative(reference, peer) + 1e-4)


@pytest.mark.parametrize("name", ["shufflenet", "ocr_det"])
def test_blocked_everywhere_it_can_ends_regions_instead_of_crashing(name):
    """Where ConvertLayout used to crash (a 5-D channel-shuffle reshape, a rank-3 broadcast,
    ConvTranspose; Resize now runs blocked): blocked=True blocks what it can, the rest stays
    NCHW, and the layout report names the ops that ended a region."""
    _, mod = load(name)
    fuse = FuseEpilogue(blocked=True, measure=False)
    with CHIP.target:
        ours = fuse(FoldBN()(mod))
    assert any("NCHWc" in g.name_hint for g in ours.functions)
    ends = {r.op for r in fuse.layout_report}
    expected = {"shufflenet": "relax.reshape", "ocr_det": "relax.nn.conv2d_transpose"}.get(name)
    assert expected is None or expected in ends
    inputs = list(random_inputs(mod, seed=2).values())
    plain = FuseEpilogue(blocked=False, measure=False)
    with CHIP.target:
        nchw = plain(FoldBN()(mod))
    assert relative(run(ours, inputs), run(nchw, inputs)) <= 1e-4


def test_the_sum_of_a_caffe2_residual_fuses_into_the_conv():
    """Opset-9 Sum (stack + reduce in TVM's import) becomes an add, fused into the conv's
    epilogue: the Caffe2 ResNet-50 has as many kernels as the opset-13 built-in one."""
    _, mod = load("resnet50_caffe2")
    with CHIP.target:
        ours = fuse_graph(FoldBN()(mod))
    # 53 convs (each Sum in the epilogue of a conv), 2 pools, fc, softmax, one reshape
    assert kernel_count(ours) == 58 < kernel_count(stock(mod))
    assert layout_kernel_count(ours) == 0


def test_corpus_models_are_real_and_calibrated():
    """The placeholders are seeded (no ConstantOfShape left) and each BatchNorm's statistics
    are those of its input on the calibration batch."""
    proto = corpus.corpus_model("inception_v2", 32)
    assert not any(n.op_type == "ConstantOfShape" for n in proto.graph.node)
    onnx.checker.check_model(proto)
    bn = next(n for n in proto.graph.node if n.op_type == "BatchNormalization")
    init = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    x = corpus.corpus_calibration_input(32)
    data = proto.graph.input[0].name  # the graph up to the BN (the rest has batch-1 reshapes)
    batched = onnx.shape_inference.infer_shapes(_with_input_shapes(proto, {data: list(x.shape)}))
    probe = onnx.utils.Extractor(batched).extract_model([data], [bn.input[0]])
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    (acts,) = session.run([bn.input[0]], {session.get_inputs()[0].name: x})
    np.testing.assert_allclose(init[bn.input[3]], acts.mean(axis=(0, 2, 3)), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(init[bn.input[4]], acts.var(axis=(0, 2, 3)), rtol=1e-3)


def test_corpus_bad_input_is_a_typed_error():
    with pytest.raises(BNFoldError, match="unknown corpus model"):
        corpus.corpus_model("resnet18")
    with pytest.raises(BNFoldError, match="cannot take a 64x64 input"):
        corpus.corpus_model("vgg19", 64)
    # ONNX Runtime would run it (a 3x3 window over 2x2 gives one output), TVM's importer not
    with pytest.raises(BNFoldError, match=r"MaxPool .* window is larger than its padded"):
        corpus.corpus_model("inception_v1", 60)
    with pytest.raises(BNFoldError, match="unknown trained model"):
        corpus.trained_model("yolo")
