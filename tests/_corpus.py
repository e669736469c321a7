"""The real-model corpus at the sizes the tests use (test_corpus, the schedule fingerprints)."""

from __future__ import annotations

import functools

import onnx
import tvm

from tvm_bnfold import corpus
from tvm_bnfold.models import _with_input_shapes, load_onnx

#: Smallest input each corpus model takes (fixed-size classifiers: their native-ish size).
#: VGG-19 is left to ``make bench``: 575 MB of weights and 20 GFLOP at its only sizes.
SIZES = {name: max(lo, 32) for name, (lo, _) in corpus.CORPUS_SIZES.items() if name != "vgg19"}
#: The trained models at inputs their apps also feed, smaller than the defaults (test budget).
TRAINED_SHAPES = {"ocr_det": (1, 3, 64, 64), "ocr_rec": (1, 3, 48, 160), "ocr_cls": None}
MODELS = [*SIZES, *corpus.TRAINED]


@functools.cache
def load(name: str) -> tuple[onnx.ModelProto, tvm.IRModule]:
    """The model and its Relax module (shared by the tests: each checks it is not mutated)."""
    if name in corpus.TRAINED:
        proto = corpus.trained_model(name)
        shape = TRAINED_SHAPES[name]
        shapes = {proto.graph.input[0].name: shape} if shape else None
        if shapes:
            proto = _with_input_shapes(proto, shapes)
    else:
        proto = corpus.corpus_model(name, SIZES[name])
    return proto, load_onnx(proto)
