"""tvm_bnfold: fold inference BatchNorm into conv/dense weights for Apache TVM (Relax)."""

from .errors import BNFoldError
from .fold_bn import FoldBN, FoldRecord
from .models import load_onnx

__all__ = ["BNFoldError", "FoldBN", "FoldRecord", "load_onnx"]
