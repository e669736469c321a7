"""Typed errors of tvm_bnfold."""


class BNFoldError(ValueError):
    """A user-facing error: the message names the offending node, file or value."""
