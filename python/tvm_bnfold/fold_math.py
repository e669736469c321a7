"""Pure numpy math of BatchNorm folding; no graph code here.

An inference BatchNorm is the per-channel affine map ``y = s * x + t`` with
``s = gamma / sqrt(var + eps)`` and ``t = beta - mean * s``. Folded into a producer
``x = W * input + b``: ``W' = W * s`` along W's output-channel axis, ``b' = s * b + t``.

Everything is computed in float64 and cast to the target dtype once at the end, so an
fp16 model folds as accurately as its dtype allows (the seed articles: fold in fp32 or
better even for fp16 models). Inputs are never written to.
"""

from __future__ import annotations

import numpy as np

from .errors import BNFoldError


def scale_shift(
    gamma: np.ndarray | None,
    beta: np.ndarray | None,
    mean: np.ndarray,
    var: np.ndarray,
    eps: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Return float64 ``(s, t)`` of an inference BatchNorm.

    ``gamma=None`` means ``scale=False`` (gamma = 1), ``beta=None`` means ``center=False``
    (beta = 0). Raises BNFoldError for non-finite parameters or ``var + eps <= 0``.
    """
    mean = np.asarray(mean, dtype=np.float64)
    var = np.asarray(var, dtype=np.float64)
    gamma = np.ones_like(var) if gamma is None else np.asarray(gamma, dtype=np.float64)
    beta = np.zeros_like(var) if beta is None else np.asarray(beta, dtype=np.float64)
    for name, value in (("gamma", gamma), ("beta", beta), ("mean", mean), ("var", var)):
        if value.shape != var.shape or value.ndim != 1:
            raise BNFoldError(f"BatchNorm {name} has shape {value.shape}, expected {var.shape}")
        bad = np.flatnonzero(~np.isfinite(value))
        if bad.size:
            raise BNFoldError(
                f"BatchNorm {name} is not finite at channel {bad[0]} ({value[bad[0]]})"
            )
    if not np.isfinite(eps):
        raise BNFoldError(f"BatchNorm epsilon is not finite ({eps})")
    denom = var + float(eps)
    bad = np.flatnonzero(denom <= 0)
    if bad.size:
        c = bad[0]
        raise BNFoldError(
            f"BatchNorm var + eps <= 0 at channel {c} (var={var[c]}, eps={eps})"
        )
    s = gamma / np.sqrt(denom)
    return s, beta - mean * s


def weight_factor(
    shape: tuple[int, ...],
    s: np.ndarray,
    out_axis: int,
    in_axis: int | None = None,
    groups: int = 1,
) -> np.ndarray:
    """Broadcastable float64 factor that scales a weight of ``shape`` by ``s`` per output channel.

    For a conv / dense weight, the output channels are the ``out_axis`` of the weight. For a
    transposed conv, the weight is ``(Cin, Cout/groups, ...)`` (in some layout): output channel
    ``g * Cout/groups + o`` is weight slice ``[i in group g, o]``, so the factor depends on both
    ``in_axis`` and ``out_axis`` — pass ``in_axis`` and ``groups`` for that case.
    """
    ndim = len(shape)
    bshape = [1] * ndim
    if in_axis is None:
        if shape[out_axis] != s.size:
            raise BNFoldError(
                f"weight has {shape[out_axis]} output channels, BatchNorm has {s.size}"
            )
        bshape[out_axis] = s.size
        return s.reshape(bshape)
    cin, cout_g = shape[in_axis], shape[out_axis]
    if cin % groups or cout_g * groups != s.size:
        raise BNFoldError(
            f"transposed weight {shape} with groups={groups} does not give {s.size} channels"
        )
    per_group = s.reshape(groups, cout_g)  # [g, o]
    factor = np.repeat(per_group, cin // groups, axis=0)  # [i, o]
    if in_axis > out_axis:
        factor = factor.T
    bshape[in_axis], bshape[out_axis] = cin, cout_g
    return factor.reshape(bshape)


def channel_vector(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """Reshape a per-channel vector to broadcast along ``axis`` of an ``ndim`` tensor."""
    shape = [1] * ndim
    shape[axis] = v.size
    return v.reshape(shape)


def fold_bias(
    bias: np.ndarray | None, s: np.ndarray, t: np.ndarray | None, axis: int, ndim: int
) -> np.ndarray | None:
    """``s * bias + t`` in float64, broadcast per channel along ``axis``; None if both are absent.

    ``bias`` may have any shape that broadcasts against the producer's output.
    """
    if bias is None and t is None:
        return None
    result = 0.0
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
        pad = ndim - bias.ndim
        result = bias.reshape((1,) * pad + bias.shape) * channel_vector(s, axis, ndim)
    if t is not None:
        result = result + channel_vector(t, axis, ndim)
    return np.asarray(result)


def cast_checked(value: np.ndarray, dtype: str, what: str) -> np.ndarray:
    """Cast a float64 result to ``dtype``; BNFoldError if it overflows that dtype."""
    with np.errstate(over="ignore"):
        out = np.asarray(value).astype(dtype)
    if not np.all(np.isfinite(out)):
        raise BNFoldError(f"folded {what} does not fit in {dtype} (overflow to inf)")
    return out


def fold(
    w: np.ndarray,
    b: np.ndarray | None,
    gamma: np.ndarray | None,
    beta: np.ndarray | None,
    mean: np.ndarray,
    var: np.ndarray,
    eps: float,
    axis: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Fold a BatchNorm into ``(w, b)``: returns ``(w', b')`` in ``w``'s dtype.

    ``axis`` is the output-channel axis of ``w``; ``b`` is a per-channel vector or None.
    """
    s, t = scale_shift(gamma, beta, mean, var, eps)
    w_new = np.asarray(w, dtype=np.float64) * weight_factor(w.shape, s, axis)
    b_new = fold_bias(b, s, t, 0, 1)
    return cast_checked(w_new, w.dtype, "weight"), cast_checked(b_new, w.dtype, "bias")
