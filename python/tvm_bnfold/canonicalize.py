"""Canonicalize: the forms TVM's ONNX importer writes -> the plain ops fusion and the blocked
layout see through. Each rewrite is exact.

Before (opset-9 ``Sum`` of a residual block, Caffe's ``Scale`` as a rank-3 constant, HardSigmoid)::

    s = R.sum(R.stack([R.broadcast_to(a, S), R.broadcast_to(b, S)], axis=0), axis=[0])
    y = R.multiply(x, c)                       # c: constant (C, 1, 1), x: (N, C, H, W)
    g = R.clip(R.add(R.multiply(0.2, x), 0.5), 0, 1)

After::

    s = R.add(a, b)                            # Max / Min likewise: maximum / minimum
    y = R.multiply(x, c')                      # c': the same values as (1, C, 1, 1)
    g = R.minimum(R.maximum(R.add(R.multiply(0.2, x), 0.5), 0.0), 1.0)

The stack + reduce of n tensors is one kernel that reads n broadcast copies; the pairwise form
fuses into the producer's epilogue. ``relax.clip`` has no layout rule (ConvertLayout wraps it in
two layout transforms); maximum and minimum have one. A constant of lower rank than the tensor
it broadcasts against is the same constant with leading 1s (NumPy broadcasting), in the rank
the layout rules expect; a one-element constant, ``(1,)`` or ``(1, 1, 1, 1)``, is a 0-d scalar
(ConvertLayout's rule for it fails inside TVM: "Cannot broadcast from 5 to 4", and the whole
model stayed in NCHW). Dropout, at inference, is its input. The importer's guard of a Clip
bound, ``where(isnan(c), -inf, c)`` on a constant, Gemm's transposed weight and a reshaped
bias are folded here in NumPy: FoldConstant compiles and runs each such op with LLVM
(MobileNetV2: 140 kernels, 1.5 s of every FoldConstant run; VGG-19's three classifier weights,
2.2 s of each). A multiply or divide by constant ones is its input (SiLU written as
``x * sigmoid(x * 1.0)``: in a region the blocked layout ends, the kernel of the multiply
became a copy that no fusion crosses).
"""

from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import relax

from .fold_bn import constant, values

_REDUCE_PAIRWISE = {
    "relax.sum": relax.op.add,
    "relax.max": relax.op.maximum,
    "relax.min": relax.op.minimum,
}
#: Ops on constants folded in NumPy: the importer's Clip bounds, Gemm's transposed weight and
#: the reshaped biases, as ``fn(call, *args)`` (ShapeExpr args as they are).
_NUMPY = {
    "relax.isnan": lambda call, x: np.isnan(x),
    "relax.where": lambda call, c, a, b: np.where(c, a, b),
    "relax.permute_dims": lambda call, x: _transposed(
        x, None if call.attrs.axes is None else [int(a) for a in call.attrs.axes]),
    "relax.reshape": lambda call, x, shape: x.reshape([int(d) for d in call.ty.shape.values]),
}
_BROADCASTING = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide",
                 "relax.maximum", "relax.minimum", "relax.power"}


@tvm.transform.module_pass(opt_level=0, name="Canonicalize")
class Canonicalize:
    """Rewrite the importer's forms of every Relax function; see the module docstring."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        out = mod.clone()
        for gvar, func in mod.functions.items():
            if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs):
                out.update_func(gvar, _Rewriter(mod).visit_expr(func))
        # Aliases (y = x, where a dropout was) would read as ops to ConvertLayout: none left.
        return tvm.transform.Sequential([relax.transform.CanonicalizeBindings(),
                                         relax.transform.DeadCodeElimination()])(out)


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)

    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:
        op = super().visit_tuple_getitem_(op)
        value = self._lookup(op.tuple_value)
        if (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.nn.dropout")
                and op.index == 0):
            return value.args[0]  # inference: dropout is the identity
        return op

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else ""
        if name in _REDUCE_PAIRWISE:
            return self._pairwise(call, _REDUCE_PAIRWISE[name])
        if name == "relax.clip":
            return self._clip(call)
        if name in ("relax.multiply", "relax.divide"):
            unit = self._unit(call)
            if unit is not None:
                return unit
        if name in _BROADCASTING:
            return self._ranked(call)
        if name in _NUMPY:
            return self._folded(call, _NUMPY[name])
        return call

    def _lookup(self, expr: relax.Expr):
        return self.builder_.lookup_binding(expr) if isinstance(expr, relax.Var) else None

    def _pairwise(self, call: relax.Call, binary) -> relax.Expr:
        """``reduce(stack([broadcast_to(x_i, S)...], 0), axis=0)`` -> pairwise ``binary``."""
        axes = call.attrs.axis
        if axes is None or [int(a) for a in axes] != [0] or call.attrs.keepdims:
            return call
        stack = self._lookup(call.args[0])
        if not (isinstance(stack, relax.Call) and stack.op == tvm.ir.Op.get("relax.stack")
                and int(stack.attrs.axis) == 0):
            return call
        fields = stack.args[0]
        fields = self._lookup(fields) if isinstance(fields, relax.Var) else fields
        if not isinstance(fields, relax.Tuple) or len(fields.fields) < 2:
            return call
        inputs = []
        for field in fields.fields:
            value = self._lookup(field)
            broadcast = isinstance(value, relax.Call) and value.op == tvm.ir.Op.get(
                "relax.broadcast_to")
            inputs.append(value.args[0] if broadcast else field)
        result = functools.reduce(lambda a, b: self.builder_.emit(binary(a, b)), inputs[:-1])
        out = binary(result, inputs[-1])
        if not _same_type(self.builder_.normalize(out), call):
            return call  # the inputs alone do not broadcast to the stacked shape
        return out

    def _clip(self, call: relax.Call) -> relax.Expr:
        """``clip(x, lo, hi)`` -> ``minimum(maximum(x, lo), hi)`` (scalar constants)."""
        x, lo, hi = call.args
        dtype = str(x.ty.dtype)
        bounds = (tvm.tirx.IntImm, tvm.tirx.FloatImm)
        if not all(isinstance(b, bounds) for b in (lo, hi)) or "float" not in dtype:
            return call
        low = self.builder_.emit(relax.op.maximum(x, relax.const(float(lo.value), dtype)))
        return relax.op.minimum(low, relax.const(float(hi.value), dtype))

    def _folded(self, call: relax.Call, numpy_op) -> relax.Expr:
        """``call`` on constants (or vars bound to them) -> its value, computed in NumPy."""
        operands = []
        for arg in call.args:
            arg = self._lookup(arg) if isinstance(arg, relax.Var) else arg
            if isinstance(arg, relax.ShapeExpr):
                operands.append(arg)
            elif isinstance(arg, tvm.ir.expr.GenericConst):
                operands.append(values(arg))
            else:
                return call
        if not is_static(call.ty):
            return call
        dtype = str(call.ty.dtype)
        return constant(np.asarray(numpy_op(call, *operands), dtype))

    def _unit(self, call: relax.Call) -> relax.Expr | None:
        """``x * 1``, ``1 * x``, ``x / 1`` -> ``x``, where the constant ones do not broadcast
        ``x`` to another shape or dtype (exact: -0, inf and NaN stay as they are)."""
        pairs = [(0, 1), (1, 0)] if call.op.name == "relax.multiply" else [(0, 1)]
        for keep, one in pairs:
            x, ones = call.args[keep], call.args[one]
            if (isinstance(ones, tvm.ir.expr.GenericConst) and _same_type(x, call)
                    and np.all(values(ones) == 1)):
                return x
        return None

    def _ranked(self, call: relax.Call) -> relax.Expr:
        """A one-element constant operand whose rank the other operand's reaches is a 0-d
        scalar; any other constant of lower rank (but not 0-d) gets leading 1s up to the
        other's."""
        ranks = [a.ty.ndim if isinstance(a.ty, relax.TensorType) else -1 for a in call.args]
        args, changed = [], False
        for i, arg in enumerate(call.args):
            if isinstance(arg, tvm.ir.expr.GenericConst) and arg.ty.ndim > 0:
                other = max((r for j, r in enumerate(ranks) if j != i), default=-1)
                value = values(arg)
                if value.size == 1 and arg.ty.ndim <= other:
                    arg, changed = constant(value.reshape(())), True
                elif arg.ty.ndim < other:
                    shape = (1,) * (other - value.ndim) + value.shape
                    arg, changed = constant(value.reshape(shape)), True
            args.append(arg)
        return relax.Call(call.op, args, call.attrs, call.ty_args) if changed else call


def _transposed(x: np.ndarray, axes: list[int] | None) -> np.ndarray:
    """``np.transpose(x, axes)``, C-ordered; a matrix in 256 x 256 tiles (VGG-19's 4096 x 25088
    classifier weight: 0.26 s, 0.81 s in one strided copy)."""
    if x.ndim != 2 or axes == [0, 1]:
        return np.asarray(np.transpose(x, axes), order="C")
    out, tile = np.empty(x.shape[::-1], x.dtype), 256
    for i in range(0, x.shape[0], tile):
        for j in range(0, x.shape[1], tile):
            out[j:j + tile, i:i + tile] = x[i:i + tile, j:j + tile].T
    return out


def _same_type(a: relax.Expr, b: relax.Expr) -> bool:
    """Both static tensors of one dtype and shape."""
    if not (is_static(a.ty) and is_static(b.ty)):
        return False
    shapes = [(str(ty.dtype), [int(d) for d in ty.shape.values]) for ty in (a.ty, b.ty)]
    return shapes[0] == shapes[1]


def is_static(ty) -> bool:
    """A tensor type of known shape."""
    return (isinstance(ty, relax.TensorType) and ty.shape is not None
            and all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values))
