"""FoldBN: fold every legal inference BatchNorm into the conv / dense that produces its input.

Before::

    lv = R.nn.conv2d(x, W)
    lv1 = R.add(lv, b)                        # how ONNX Conv bias arrives
    lv2 = R.nn.batch_norm(lv1, g, be, m, v, axis=1, training=False)
    y = lv2[0]

After::

    lv3 = R.nn.conv2d(x, W')                  # W' = W * s along the output channels
    y = R.add(lv3, b')                        # b' = s * b + t

Producers it folds into: conv1d/2d/3d (any layout TVM accepts, groups, depthwise),
conv1d/2d_transpose (groups too), matmul with a constant weight, each optionally followed by a
constant bias add; a concat of such producers along the channel axis (each slice into its
producer) and an add of two (scale into both, shift into one). A BN whose input has no foldable
producer becomes one multiply and one add with precomputed constants. A BN that cannot be
rewritten exactly (training mode, non-constant or non-finite statistics, ``var + eps <= 0``)
stays. Every BN seen gets a :class:`FoldRecord` in ``FoldBN().report`` and a log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from . import fold_math
from .errors import BNFoldError

logger = logging.getLogger(__name__)

_CONV = {f"relax.nn.conv{d}d" for d in (1, 2, 3)}
_CONV_T = {"relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose"}
_SHAPE_OPS = {"relax.reshape", "relax.expand_dims", "relax.squeeze"}


@dataclass
class FoldRecord:
    """What happened to one BatchNorm.

    ``action`` is ``"folded"`` (into ``into``), ``"scale-shift"`` (no foldable producer: became
    multiply + add, ``reason`` says why) or ``"kept"`` (the BN stays, ``reason`` says why).
    """

    function: str
    bn: str
    action: str
    into: list[str] = field(default_factory=list)
    reason: str = ""

    def __str__(self) -> str:
        where = f"{self.function}:{self.bn}"
        if self.action == "folded":
            return f"{where}: folded into {', '.join(self.into)}"
        return f"{where}: {self.action} ({self.reason})"


@tvm.transform.module_pass(opt_level=0, name="FoldBN")
class FoldBN:
    """Fold inference BatchNorms into their producers' weights; see the module docstring."""

    def __init__(self) -> None:
        self.report: list[FoldRecord] = []

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = []
        updates = {}
        for gvar, func in mod.functions.items():
            if not isinstance(func, relax.Function) or _is_primitive(func):
                continue
            new_func, records = _fold_function(func, gvar.name_hint)
            self.report.extend(records)
            if new_func is not func:
                updates[gvar] = new_func
        for record in self.report:
            logger.log(logging.INFO if record.action == "folded" else logging.WARNING, "%s", record)
        if not updates:
            return mod
        new_mod = mod.clone()  # never update the caller's module in place
        for gvar, func in updates.items():
            new_mod.update_func(gvar, func)
        return new_mod


# --------------------------------------------------------------------------------------------
# Analysis: which BN folds into what.


@dataclass
class _Linear:
    """conv / conv_transpose / matmul with a constant weight, optionally + a constant bias."""

    call: relax.Call
    weight: np.ndarray
    out_axis: int  # output-channel axis of the weight
    in_axis: int | None  # transposed conv only: input-channel axis of the weight
    groups: int
    bias: np.ndarray | None
    name: str
    new_weight: np.ndarray | None = None  # set by _fold_tree
    new_bias: np.ndarray | None = None


@dataclass
class _Concat:
    parts: list
    sizes: list[int]
    axis: int


@dataclass
class _Sum:
    lhs: object
    rhs: object


@dataclass
class _Plan:
    """Rewrite of one BN: ``s * data + t``, folded into ``tree`` (None: multiply + add)."""

    data: relax.Var
    s: np.ndarray
    t: np.ndarray
    axis: int
    tree: _Linear | _Concat | _Sum | None


class _Skip(Exception):
    """Internal: a rewrite is not legal; the message is the user-readable reason."""


class _Analysis:
    """Use counts and constant values of one function."""

    def __init__(self, func: relax.Function) -> None:
        self.var2val = relax.analysis.get_var2val(func)
        self.uses = count_uses(func)
        # Bindings of unused ``tuple[i]`` (the ONNX importer reads BN outputs 1 and 2 and never
        # uses them) are dead: they do not count as uses of the tuple.
        self.dead = set()
        for var, val in self.var2val.items():
            if (isinstance(val, relax.TupleGetItem) and self.uses.get(var, 0) == 0
                    and isinstance(val.tuple_value, relax.Var)):
                self.dead.add(var)
                self.uses[val.tuple_value] -= 1

    def const(self, expr: relax.Expr) -> np.ndarray | None:
        """Value of a constant, or of reshape/permute_dims of one; None if not constant."""
        if isinstance(expr, tvm.ir.expr.GenericConst):
            return values(expr)
        if isinstance(expr, relax.Var) and expr in self.var2val:
            val = self.var2val[expr]
            if isinstance(val, relax.Call) and isinstance(val.op, tvm.ir.Op):
                name = val.op.name
                if name in _SHAPE_OPS or name == "relax.permute_dims":
                    inner = self.const(val.args[0])
                    if inner is None:
                        return None
                    if name == "relax.permute_dims":
                        axes = val.attrs.axes
                        return inner.transpose(None if axes is None else [int(a) for a in axes])
                    return inner.reshape(_static_shape(val))
            return self.const(val) if isinstance(val, tvm.ir.expr.GenericConst) else None
        return None

    def single_use(self, var: relax.Expr, what: str) -> None:
        if not isinstance(var, relax.Var) or var not in self.var2val:
            raise _Skip(f"{what} is not computed in this function")
        if self.uses.get(var, 0) != 1:
            raise _Skip(f"{what} {var.name} has {self.uses.get(var, 0)} consumers")

    def producer(self, var: relax.Expr, axis: int):
        """Foldable producer tree of ``var`` for a BN over ``axis``; raises _Skip with a reason."""
        if not isinstance(var, relax.Var) or var not in self.var2val:
            raise _Skip("input is not computed by an op in this function")
        call = self.var2val[var]
        if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
            raise _Skip(f"{var.name} is not an op call")
        name = call.op.name
        if name == "relax.add":
            return self._add(var, call, axis)
        if name == "relax.concat":
            return self._concat(var, call, axis)
        return self._linear(var, call, axis)

    def _add(self, var, call, axis):
        lhs, rhs = call.args
        bias = self.const(rhs)
        if bias is None and self.const(lhs) is not None:
            lhs, rhs, bias = rhs, lhs, self.const(lhs)
        out_shape = _static_shape(call)
        if bias is not None:
            self.single_use(lhs, "producer output")
            inner = self.producer(lhs, axis)
            if not isinstance(inner, _Linear) or inner.bias is not None:
                raise _Skip(f"bias add {var.name} does not follow a conv/matmul")
            if _static_shape(lhs) != out_shape or bias.ndim > len(out_shape):
                raise _Skip(f"bias of {var.name} broadcasts the output to {out_shape}")
            inner.bias = bias
            return inner
        for side in (lhs, rhs):
            self.single_use(side, "operand of add")
            if _static_shape(side) != out_shape:
                raise _Skip(f"add {var.name} broadcasts {side.name}")
        return _Sum(self.producer(lhs, axis), self.producer(rhs, axis))

    def _concat(self, var, call, axis):
        if _normalize_axis(call.attrs.axis, len(_static_shape(call))) != axis:
            raise _Skip(f"concat {var.name} is not along the BatchNorm axis")
        fields = call.args[0]
        if isinstance(fields, relax.Var):
            self.single_use(fields, "concat operand tuple")
            fields = self.var2val[fields]
        if not isinstance(fields, relax.Tuple):
            raise _Skip(f"concat {var.name} operands are not a tuple")
        parts = []
        for f in fields.fields:
            self.single_use(f, "concat operand")
            parts.append(self.producer(f, axis))
        return _Concat(parts, [_static_shape(f)[axis] for f in fields.fields], axis)

    def _linear(self, var, call, axis) -> _Linear:
        name = call.op.name
        out_ndim = len(_static_shape(call))
        if name in _CONV or name in _CONV_T:
            attrs = call.attrs
            layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
            if any(ch.islower() or ch.isdigit() for lay in layouts for ch in lay):
                raise _Skip(f"{name} {var.name} uses a blocked layout {layouts}")
            if attrs.out_layout.index("C") != axis:
                raise _Skip(f"BatchNorm axis {axis} is not the output channels of {var.name}")
            weight = self.const(call.args[1])
            if weight is None:
                raise _Skip(f"weight of {var.name} is not a constant")
            kl = attrs.kernel_layout
            in_axis = kl.index("I") if name in _CONV_T else None
            return _Linear(call, weight, kl.index("O"), in_axis, int(attrs.groups), None,
                           f"{name.split('.')[-1]} {var.name}")
        if name == "relax.matmul":
            weight = self.const(call.args[1])
            if weight is None or self.const(call.args[0]) is not None or weight.ndim != 2:
                raise _Skip(f"matmul {var.name} has no constant 2-D right-hand weight")
            if axis != out_ndim - 1:
                raise _Skip(f"BatchNorm axis {axis} is not the features of matmul {var.name}")
            return _Linear(call, weight, 1, None, 1, None, f"matmul {var.name}")
        raise _Skip(f"{var.name} is {name}, not a conv/matmul/concat/add")


def _fold_function(func: relax.Function, fname: str) -> tuple[relax.Function, list[FoldRecord]]:
    """Plan and apply the rewrites of one function; returns it unchanged if nothing applies."""
    info = _Analysis(func)
    plans, removed, records = {}, set(), []
    for var, call in info.var2val.items():
        if not (isinstance(call, relax.Call) and call.op == tvm.ir.Op.get("relax.nn.batch_norm")):
            continue
        record = FoldRecord(fname, var.name, "kept")
        records.append(record)
        try:
            out_var, plan, consumed = _plan(info, var, call, record)
        except (_Skip, BNFoldError) as err:
            record.reason = str(err)
            continue
        plans[out_var] = plan
        removed |= consumed
    if not plans:
        return func, records
    removed |= info.dead
    new_func = _Rewriter(plans, removed).visit_expr(func)
    return relax.analysis.remove_all_unused(new_func), records


def _plan(info: _Analysis, bn_var, call, record: FoldRecord):
    """Check one BN; returns (its output var, the plan, the vars whose bindings it replaces)."""
    attrs = call.attrs
    data, gamma, beta, mean, var = call.args
    if attrs.training:
        raise _Skip("training mode (training=True)")
    getitems = [v for v, val in info.var2val.items()
                if isinstance(val, relax.TupleGetItem) and val.tuple_value.same_as(bn_var)
                and v not in info.dead]
    if info.uses.get(bn_var, 0) != 1 or len(getitems) != 1 or info.var2val[getitems[0]].index:
        raise _Skip("its batch mean/var outputs are used")
    params = {n: info.const(e) for n, e in
              (("gamma", gamma), ("beta", beta), ("moving_mean", mean), ("moving_var", var))}
    missing = [n for n, v in params.items() if v is None]
    if missing:
        raise _Skip(f"{', '.join(missing)} not constant")
    s, t = fold_math.scale_shift(
        params["gamma"] if attrs.scale else None,
        params["beta"] if attrs.center else None,
        params["moving_mean"], params["moving_var"], float(attrs.epsilon),
    )
    ndim = len(_static_shape(data))
    axis = _normalize_axis(attrs.axis, ndim)
    consumed = {bn_var}
    try:
        info.single_use(data, "producer output")
        tree = info.producer(data, axis)
        _fold_tree(tree, s, t, axis)
    except (_Skip, BNFoldError) as err:
        dtype = _dtype(data)
        fold_math.cast_checked(s, dtype, "scale")
        fold_math.cast_checked(t, dtype, "shift")
        record.action, record.reason = "scale-shift", f"not folded: {err}"
        return getitems[0], _Plan(data, s, t, axis, None), consumed
    record.action, record.into = "folded", [leaf.name for leaf in _flat(tree)]
    consumed |= _tree_vars(info, data, tree)
    return getitems[0], _Plan(data, s, t, axis, tree), consumed


def _fold_tree(tree, s, t, axis: int) -> None:
    """Compute every producer's folded weight and bias (raises on overflow before any rewrite)."""
    for leaf, ls, lt in _leaves(tree, s, t):
        ndim = len(_static_shape(leaf.call))
        factor = fold_math.weight_factor(leaf.weight.shape, ls, leaf.out_axis, leaf.in_axis,
                                         leaf.groups)
        leaf.new_weight = fold_math.cast_checked(
            leaf.weight.astype(np.float64) * factor, leaf.weight.dtype, f"weight of {leaf.name}"
        )
        bias = fold_math.fold_bias(leaf.bias, ls, lt, axis, ndim)
        if bias is not None:
            leaf.new_bias = fold_math.cast_checked(bias, _dtype(leaf.call), f"bias of {leaf.name}")


def _leaves(tree, s, t):
    """Yield (linear producer, its slice of s, its shift or None) for every leaf."""
    if isinstance(tree, _Linear):
        yield tree, s, t
    elif isinstance(tree, _Sum):
        yield from _leaves(tree.lhs, s, t)
        yield from _leaves(tree.rhs, s, None)
    else:
        start = 0
        for part, size in zip(tree.parts, tree.sizes, strict=True):
            sl = slice(start, start + size)
            yield from _leaves(part, s[sl], t[sl] if t is not None else None)
            start += size


def _flat(tree):
    if isinstance(tree, _Linear):
        return [tree]
    if isinstance(tree, _Sum):
        return _flat(tree.lhs) + _flat(tree.rhs)
    return [leaf for part in tree.parts for leaf in _flat(part)]


def _tree_vars(info: _Analysis, root, tree) -> set:
    """The vars whose bindings the rewrite replaces (root of the tree down to the convs)."""
    out = {root}
    val = info.var2val[root]
    if isinstance(tree, _Linear) and val.op.name == "relax.add":
        out.add(val.args[0] if info.const(val.args[1]) is not None else val.args[1])
    elif isinstance(tree, _Sum):
        out |= _tree_vars(info, val.args[0], tree.lhs) | _tree_vars(info, val.args[1], tree.rhs)
    elif isinstance(tree, _Concat):
        fields = val.args[0]
        if isinstance(fields, relax.Var):
            out.add(fields)
            fields = info.var2val[fields]
        for f, part in zip(fields.fields, tree.parts, strict=True):
            out |= _tree_vars(info, f, part)
    return out


# --------------------------------------------------------------------------------------------
# Rewrite.


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Rebind each planned BN output to its folded expression; drop the bindings it replaces."""

    def __init__(self, plans: dict, removed: set) -> None:
        super().__init__()
        self.plans, self.removed = plans, removed

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.removed:
            return
        plan = self.plans.get(binding.var)
        if plan is None:
            super().visit_var_binding_(binding)
            return
        expr = self._scale_shift(plan) if plan.tree is None else self._folded(plan.tree)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(expr)))

    def _scale_shift(self, plan: _Plan) -> relax.Expr:
        """``data * s + t`` with both constants precomputed in the data's dtype."""
        ndim, dtype = len(_static_shape(plan.data)), _dtype(plan.data)
        s = fold_math.channel_vector(plan.s, plan.axis, ndim).astype(dtype)
        t = fold_math.channel_vector(plan.t, plan.axis, ndim).astype(dtype)
        scaled = self.builder_.emit(relax.op.multiply(self.visit_expr(plan.data), constant(s)))
        return relax.op.add(scaled, constant(t))

    def _folded(self, tree) -> relax.Expr:
        """The producers of ``tree`` rebuilt with their folded weights and biases."""
        if isinstance(tree, _Linear):
            call = tree.call
            args = [self.visit_expr(call.args[0]), constant(tree.new_weight)]
            new = relax.Call(call.op, args, call.attrs, call.ty_args)
            if tree.new_bias is None:
                return new
            return relax.op.add(self.builder_.emit(new), constant(tree.new_bias))
        if isinstance(tree, _Sum):
            lhs, rhs = (self.builder_.emit(self._folded(p)) for p in (tree.lhs, tree.rhs))
            return relax.op.add(lhs, rhs)
        parts = [self.builder_.emit(self._folded(p)) for p in tree.parts]
        return relax.op.concat(parts, tree.axis)


# --------------------------------------------------------------------------------------------
# Helpers.


def values(const: tvm.ir.expr.GenericConst) -> np.ndarray:
    """The array of a Relax constant: a read-only view, not a copy (``.numpy()`` copies: 1.2 s
    for VGG-19's 400 MB classifier weight)."""
    try:
        view = np.from_dlpack(const.value)
    except (BufferError, TypeError, RuntimeError):  # a dtype NumPy's DLPack import lacks
        return const.value.numpy()
    view.flags.writeable = False
    return view


def constant(value: np.ndarray) -> tvm.ir.expr.GenericConst:
    """A Relax constant of ``value`` in its dtype, copied once (``relax.const`` with a dtype
    copies an array twice: VGG-19's 400 MB classifier weight, 0.4 s more)."""
    return relax.const(tvm.runtime.tensor(np.asarray(value, order="C")))


def _is_primitive(func: relax.Function) -> bool:
    return bool(func.attrs and "Primitive" in func.attrs and int(func.attrs["Primitive"]))


def _static_shape(expr: relax.Expr) -> tuple[int, ...]:
    shape = expr.ty.shape
    if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        raise _Skip(f"{expr} has no static shape")
    return tuple(int(d) for d in shape.values)


def _dtype(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def _normalize_axis(axis, ndim: int) -> int:
    axis = int(axis)
    return axis + ndim if axis < 0 else axis


def count_uses(func: relax.Function) -> dict:
    """Var -> how many times ``func`` reads it (tuples and the return value included)."""
    counter = _UseCounter()
    counter.visit_expr(func)
    return counter.uses


@relax.expr_functor.visitor
class _UseCounter(relax.PyExprVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.uses: dict = {}

    def visit_var_(self, op: relax.Var) -> None:
        self.uses[op] = self.uses.get(op, 0) + 1

    def visit_dataflow_var_(self, op: relax.DataflowVar) -> None:
        self.uses[op] = self.uses.get(op, 0) + 1
