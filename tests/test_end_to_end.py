"""FoldBN on the built-in real architectures, compiled and run with TVM before and after."""

import pytest

from _util import max_rel_err, run
from tvm_bnfold import FoldBN, load_onnx
from tvm_bnfold.bench import conv_count, op_counts
from tvm_bnfold.models import BUILTIN, random_inputs

# Small inputs keep the untuned TVM builds quick; the graphs are the full networks.
CASES = {"resnet50": (53, (1, 3, 64, 64)), "mobilenetv2": (52, (1, 3, 64, 64))}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_builtin_model_folds_every_batchnorm(name):
    n_bn, shape = CASES[name]
    mod = load_onnx(BUILTIN[name](), shapes={"data": shape})
    fold = FoldBN()
    folded = fold(mod)
    before, after = op_counts(mod), op_counts(folded)
    assert before["nn.batch_norm"] == n_bn and after["nn.batch_norm"] == 0
    assert conv_count(after) == conv_count(before) == n_bn
    assert [r.action for r in fold.report] == ["folded"] * n_bn
    inputs = list(random_inputs(mod).values())
    ref = run(mod, *inputs)
    assert max_rel_err(run(folded, *inputs), ref) <= 1e-5
