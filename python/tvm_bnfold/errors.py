"""Typed errors of tvm_bnfold."""

import tvm_ffi


@tvm_ffi.register_error
class BNFoldError(ValueError):
    """A user-facing error: the message names the offending node, file or value.

    Registered with tvm-ffi so that it keeps its type when raised inside a pass (TVM would
    otherwise turn it into a RuntimeError on the way back to the caller).
    """
