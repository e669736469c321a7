"""tvm_bnfold: fold inference BatchNorm into conv/dense weights and run each conv's epilogue on its
register tile, for Apache TVM (Relax)."""

from . import chips
from .errors import BNFoldError
from .fold_bn import FoldBN, FoldRecord
from .fuse_epilogue import FuseEpilogue, FusionRecord
from .models import load_onnx
from .runtime import Model, load, set_threads
from .tuning import build, tune

__all__ = ["BNFoldError", "FoldBN", "FoldRecord", "FuseEpilogue", "FusionRecord", "Model", "build",
           "chips", "load", "load_onnx", "set_threads", "tune"]
