"""Blocked channel layout for CPU convs: activations in ``NCHW{b}c``, weights packed once.

With the vector along the output width (plain NCHW), a 14- or 7-wide feature map wastes most of
a 16-lane register. In ``NCHW{b}c`` (``b`` = the chip's fp32 lanes) the innermost axis is a
block of ``b`` channels: a conv's register tile is a few output columns x one or more channel
blocks, each accumulator one full vector, whatever the map size (ONNX Runtime's NCHWc road)::

    out[n, o, y, x, oi] += data[n, c, y*s + ry, x*s + rx, ci] * W[o, c, ry, rx, ci, oi]
    #   one vector        broadcast scalar                      one vector (OIHW{b}i{b}o)

Before (after FoldBN)::

    lv = R.nn.conv2d(x, W)                       # NCHW / OIHW
    y = R.nn.relu(R.add(lv, b))

After::

    x1 = R.layout_transform(x, NCHW -> NCHW16c)   # once where the blocked region starts
    lv = R.call_tir(conv2d_NCHWc, (x1, W'))       # W' packed OIHW16i16o: a constant
    y = R.nn.relu(R.add(lv, b'))                  # b' a (1, C/16, 1, 1, 16) constant

Step 1 raises the importer's clip kernels back to Relax ops (TVM's ONNX frontend writes Clip as
``call_tir`` of topi maximum / minimum, which ConvertLayout cannot see through). Step 2 pads
channel counts that the block does not divide (MobileNetV2's 24) with zero channels: the
producing convs get zero output filters, the consuming convs zero weights for those channels,
so the padded channels never reach a real output (exact for finite activations). Step 3 is
TVM's ConvertLayout: every conv2d whose channels split into blocks, and the elementwise ops,
pools, spatial means and channel concats between them, move to the blocked layout. Any other op
(a 5-D reshape, ConvTranspose, a grouped conv, anything unknown: :func:`carry_reason`) is
legalized first, so that ConvertLayout sees an opaque kernel and ends the region there with
one layout transform, never applying a layout rule that fails or is wrong for it; each such op
is a :class:`LayoutRecord`. A resize of a blocked tensor is TOPI's blocked resize in its own
kernel, and the region goes on through it. ConvertLayout gives a concat its first input's
layout, so an NCHW stem pool that starts a chain of concats (DenseNet) kept a whole block in
NCHW, with a transform at each conv and concat: such a connected NCHW region moves to the
blocked layout where that leaves fewer transforms than it removes. A stem conv whose input
channels do not block (RGB) then writes the blocked layout itself, through its epilogue and max
pool; a head conv whose output channels do not block (a 1000-class classifier) reads the
blocked layout itself, its kernel's first stage gathering it into NCHW (the transform
ConvertLayout writes before it cancels against that read); a transform of a 1x1 map (pooled
features, a squeeze-excitation gate) is a reshape, and so is the flatten of a blocked map a
classifier's matmul reads (its weight rows permuted). Step 4
legalizes the blocked convs with our compute (groups = 1 and depthwise).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, te, topi

from .canonicalize import is_static
from .errors import BNFoldError
from .fold_bn import constant, count_uses, values

logger = logging.getLogger(__name__)

#: Block names of the blocked conv computes (schedules.anchor recognizes them).
CONV_BLOCK = "conv2d_NCHWc"
DEPTHWISE_BLOCK = "depthwise_conv2d_NCHWc"
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@dataclass(frozen=True)
class LayoutRecord:
    """Ops of one kind (``count`` of them) where a blocked region ends, and why."""

    op: str
    count: int
    reason: str

    def __str__(self) -> str:
        if not self.op:
            return self.reason
        return f"{self.op} x{self.count}: {self.reason}; the blocked region ends there"


def to_blocked(
    mod: tvm.IRModule, block: int, legalize: dict | None = None
) -> tuple[tvm.IRModule, list[LayoutRecord]]:
    """``mod`` with its conv2ds in ``NCHW{block}c`` and legalized (every op a ``call_tir``;
    ``legalize``: op name -> legalization for the other ops, over TVM's own), and where the
    blocked regions end and why."""
    if block < 2:
        raise BNFoldError(f"to_blocked: the channel block must be >= 2, got {block}")
    legalize = legalize or {}
    ends = _EndRegions(block, legalize)
    passes = [
        # Step 1. The importer's clip kernels back to relax.maximum / relax.minimum.
        _RaiseClip(),
        relax.transform.FoldConstant(),
        # Step 2. Channel counts the block does not divide: zero channels up to a multiple.
        _PadChannels(block),
        # Step 3. Blocked layout for conv2d and what lies between convs (every op it cannot
        # carry legalized first: a region ends there); fold the packed weights.
        ends,
        relax.transform.ConvertLayout({"relax.nn.conv2d": [f"NCHW{block}c", f"OIHW{block}o"]}),
        relax.transform.Normalize(),
        relax.transform.EliminateCommonSubexpr(),
        _CancelTransforms(),
        _SpreadBlocked(block),
        _PackConstants(),
        relax.transform.FoldConstant(),
        _BlockStems(block),
        relax.transform.RewriteDataflowReshape(),  # the reshapes legalized in Step 3: views
        _TransformsAsReshapes(block),
        _FlattenBlocked(block),
        # Step 4. Legalize, blocked convs with our compute; pack the weights once.
        relax.transform.LegalizeOps({**legalize, "relax.nn.conv2d": _legalize_conv2d}),
        relax.transform.FoldConstant(),
        relax.transform.DeadCodeElimination(),
    ]
    try:
        out = tvm.transform.Sequential(passes)(mod)
    except BNFoldError:
        raise
    except (RuntimeError, ValueError, TypeError) as err:  # tvm.error.InternalError among them
        # A TVM layout rule failed on an op we let through: keep the whole model in NCHW.
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        logger.warning("blocked layout not applied: %s", first)
        notes = [LayoutRecord("", 0, f"blocked layout not applied, NCHW kept: {first}")]
        return relax.transform.LegalizeOps(legalize)(mod), notes
    return out, ends.records


def _graph_functions(mod: tvm.IRModule):
    """``(gvar, func)`` of each Relax function of ``mod`` that is not a primitive one (a fused
    kernel)."""
    for gvar, func in mod.functions.items():
        if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs):
            yield gvar, func


def _rewrite_functions(mod: tvm.IRModule, rewrite) -> tvm.IRModule:
    """A copy of ``mod`` with ``rewrite(func)`` for each of its :func:`_graph_functions`."""
    out = mod.clone()
    for gvar, func in _graph_functions(mod):
        out.update_func(gvar, rewrite(func))
    return out


def _rewrite_marked(mod: tvm.IRModule, mark, rewriter) -> tvm.IRModule:
    """``mod`` with each of its :func:`_graph_functions` that ``mark(func)`` finds something in
    rewritten by ``rewriter(marks)``; ``mod`` itself when none is."""
    out = mod
    for gvar, func in _graph_functions(mod):
        marks = mark(func)
        if marks:
            out = out.clone() if out is mod else out
            out.update_func(gvar, rewriter(marks).visit_expr(func))
    return out


# --------------------------------------------------------------------------------------------
# Step 1: clip kernels -> Relax ops
# --------------------------------------------------------------------------------------------

_CLIP_OPS = ((topi.maximum, relax.op.maximum), (topi.minimum, relax.op.minimum))


@tvm.transform.module_pass(opt_level=0, name="RaiseClip")
class _RaiseClip:
    """``call_tir(f, (x, s))`` -> ``relax.maximum(x, s)`` (or minimum) where ``f`` is exactly
    topi's maximum / minimum of ``x`` and a 0-d ``s`` (what the ONNX importer emits for Clip)."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        out = mod.clone()
        for gvar, func in mod.functions.items():
            if isinstance(func, relax.Function):
                out.update_func(gvar, _ClipRaiser(mod).visit_expr(func))
        return relax.transform.DeadCodeElimination()(out)


@relax.expr_functor.mutator
class _ClipRaiser(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _CALL_TIR or len(call.args[1].fields) != 2:
            return call
        callee = self.mod[call.args[0]]
        x, s = call.args[1].fields
        for te_op, relax_op in _CLIP_OPS:
            if _is_topi(callee, te_op, x, s):
                return relax_op(x, s)
        return call


def _is_topi(func, te_op, x: relax.Expr, s: relax.Expr) -> bool:
    """``func`` is structurally topi's ``te_op(x, s)`` for a 0-d ``s`` of ``x``'s dtype."""
    tx, ts = x.ty, s.ty
    if not (isinstance(func, tvm.tirx.PrimFunc) and len(func.params) == 3
            and isinstance(tx, relax.TensorType) and isinstance(ts, relax.TensorType)):
        return False
    if tx.shape is None or ts.ndim != 0 or tx.dtype != ts.dtype:
        return False
    a = te.placeholder(list(tx.shape.values), str(tx.dtype), "x")
    b = te.placeholder((), str(ts.dtype), "s")
    ref = te.create_prim_func([a, b, te_op(a, b)]).without_attr("global_symbol")
    return tvm_ffi.structural_equal(ref, func, map_free_vars=True)


# --------------------------------------------------------------------------------------------
# Step 2: channel padding
# --------------------------------------------------------------------------------------------

#: Elementwise ops that map finite values to finite values channel by channel: a padded channel
#: stays finite, and the zero weights of every consuming conv cancel it exactly.
_UNARY = {"relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh", "relax.nn.silu",
          "relax.nn.gelu", "relax.nn.leakyrelu"}
_BINARY = {"relax.add", "relax.subtract", "relax.multiply", "relax.maximum", "relax.minimum"}
_CONV2D = "relax.nn.conv2d"


@tvm.transform.module_pass(opt_level=0, name="PadChannels")
class _PadChannels:
    """Pad the channels of every NCHW tensor region whose channel count ``block`` does not
    divide: the tensors produced by plain convs (groups 1) and the elementwise ops and
    depthwise convs between them, as long as every tensor of the region is consumed only by
    such ops or by convs; any other use reads a slice of the real channels."""

    def __init__(self, block: int) -> None:
        self.block = block

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        return _rewrite_marked(mod, lambda f: _channel_regions(f, self.block),
                               lambda regions: _Padder(regions, self.block))


def _channel_regions(func: relax.Function, block: int) -> dict:
    """Region member var -> its real channel count, for the regions that can be padded."""
    bindings = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
    users: dict = {}
    for var, value in bindings.items():
        for arg in _args(value):
            users.setdefault(arg, []).append(var)
    members: dict = {}
    for var, value in bindings.items():
        if var in members or not _is_producer(value, block):
            continue
        region, ok = _grow(var, bindings, users, block)
        # Worth it only where a conv reads the padded channels (else every use is a slice).
        if ok and any(_is_conv2d(bindings[u]) and bindings[u].attrs.groups == 1
                      for v in region for u in users.get(v, [])):
            members.update(region)
    return members


def _grow(start, bindings, users, block) -> tuple[dict, bool]:
    """The region around ``start`` (a producer conv's output), and whether it can be padded:
    each member is a producer conv, a depthwise conv or an allowed elementwise op whose tensor
    operands are members too; uses outside read a slice."""
    channels = _channels(start)
    region, todo = {}, [start]
    while todo:
        var = todo.pop()
        if var in region:
            continue
        value = bindings.get(var)
        if _channels(var) != channels or value is None or not isinstance(var, relax.DataflowVar):
            return region, False  # a function input, an output binding: not ours to change
        if not (_is_producer(value, block) or _joins(value, channels)):
            return region, False
        region[var] = channels
        if not _is_producer(value, block):  # its tensor operands are padded too
            todo.extend(a for a in _args(value)
                        if isinstance(a, relax.Var) and _channels(a) == channels)
        # Users: channel-by-channel ops join; plain convs read the padded tensor with zero
        # weights (and start their own region if they are producers); others (an output
        # binding among them) read a slice.
        todo.extend(u for u in users.get(var, [])
                    if isinstance(u, relax.DataflowVar) and _joins(bindings[u], channels))
    return region, True


def _is_producer(value, block: int) -> bool:
    """A plain conv2d (NCHW / OIHW, groups 1, constant weight) whose output channels ``block``
    does not divide."""
    return (_is_conv2d(value) and value.attrs.groups == 1 and _constant(value.args[1])
            and _channels(value) % block != 0)


def _joins(value, channels: int) -> bool:
    """Channel by channel on tensors of ``channels`` channels: an allowed unary op, a binary
    op with a scalar or per-channel constant or another tensor, or a depthwise conv."""
    if not isinstance(value, relax.Call) or _channels(value) != channels:
        return False
    name = value.op.name if isinstance(value.op, tvm.ir.Op) else ""
    if name in _UNARY:
        return True
    if name in _BINARY:
        return all(_channels(a) == channels or _per_channel(a, channels) for a in value.args)
    return (_is_conv2d(value) and value.attrs.groups == channels and _constant(value.args[1])
            and int(value.args[1].ty.shape.values[1]) == 1)


def _is_conv2d(value) -> bool:
    if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get(_CONV2D)):
        return False
    attrs = value.attrs
    return (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) == (
        "NCHW", "OIHW", "NCHW") and _channels(value.args[0]) is not None


def _channels(expr) -> int | None:
    """Channel count (axis 1) of a static 4-D tensor, else None."""
    return _channels_of(expr.ty if hasattr(expr, "ty") else None)


def _channels_of(ty) -> int | None:
    if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.ndim != 4:
        return None
    dims = ty.shape.values
    return int(dims[1]) if all(isinstance(d, tvm.tirx.IntImm) for d in dims) else None


def _constant(expr) -> bool:
    return isinstance(expr, tvm.ir.expr.GenericConst)


def _per_channel(expr, channels: int) -> bool:
    """A constant scalar, or a constant of shape (1, C, 1, 1) / (C, 1, 1) / all-ones."""
    if not _constant(expr):
        return False
    shape = [int(d) for d in expr.value.shape]
    return shape in ([1, channels, 1, 1], [channels, 1, 1]) or all(d == 1 for d in shape)


def _args(value) -> list:
    return list(value.args) if isinstance(value, relax.Call) else (
        [value] if isinstance(value, relax.Var) else [])


@relax.expr_functor.mutator
class _Padder(relax.PyExprMutator):
    """Rebuild the region bindings on padded tensors; other users read the real channels."""

    def __init__(self, regions: dict, block: int) -> None:
        super().__init__()
        self.regions, self.block = regions, block
        self.padded: dict = {}  # member var -> its padded var
        self.sliced: dict = {}  # member var -> its slice to the real channels

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var, value = binding.var, binding.value
        if var in self.regions:
            new = self.builder_.emit(self._padded_call(value, self.regions[var]))
            self.padded[var] = new
            return
        if isinstance(value, relax.Call) and _is_conv2d(value) and value.args[0] in self.padded:
            value = self._consumer(value)
        elif any(a in self.padded for a in _args(value)):
            value = self._with_slices(value)
        else:
            super().visit_var_binding_(binding)
            return
        self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(value)))

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self._slice(var) if var in self.padded else super().visit_var_(var)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        return self._slice(var) if var in self.padded else super().visit_dataflow_var_(var)

    def _target(self, channels: int) -> int:
        return -(-channels // self.block) * self.block

    def _padded_call(self, value: relax.Call, channels: int) -> relax.Expr:
        extra = self._target(channels) - channels
        if _is_conv2d(value) and value.attrs.groups == 1:  # producer (maybe a consumer too)
            data = value.args[0]
            weight = values(value.args[1])
            if data in self.padded:
                weight = _pad_axis(weight, 1, self._target(_channels(data)) - weight.shape[1])
            args = [self.padded.get(data, data), constant(_pad_axis(weight, 0, extra))]
            return relax.Call(value.op, args, value.attrs, value.ty_args)
        if _is_conv2d(value):  # depthwise: one zero filter per padded channel
            attrs = value.attrs
            weight = _pad_axis(values(value.args[1]), 0, extra)
            return relax.op.nn.conv2d(
                self.padded[value.args[0]], constant(weight), attrs.strides, attrs.padding,
                attrs.dilation, self._target(channels), "NCHW", "OIHW", "NCHW",
                _out_dtype(attrs))
        args = []
        for arg in value.args:
            if arg in self.padded:
                args.append(self.padded[arg])
            elif _constant(arg) and len(arg.value.shape) >= 3 and int(arg.value.shape[-3]) > 1:
                args.append(constant(_pad_axis(values(arg), arg.value.ndim - 3, extra)))
            else:
                args.append(arg)
        return relax.Call(value.op, args, value.attrs, value.ty_args)

    def _consumer(self, value: relax.Call) -> relax.Call:
        """A conv reading a padded tensor: zero weights for the padded input channels."""
        data = value.args[0]
        weight = values(value.args[1])
        weight = _pad_axis(weight, 1, self._target(_channels(data)) - weight.shape[1])
        return relax.Call(value.op, [self.padded[data], constant(weight)], value.attrs,
                          value.ty_args)

    def _with_slices(self, value):
        if isinstance(value, relax.Var):
            return self._slice(value)
        return relax.Call(value.op, [self.visit_expr(a) for a in value.args], value.attrs,
                          value.ty_args)

    def _slice(self, var: relax.Var) -> relax.Expr:
        if var not in self.sliced:
            self.sliced[var] = self.builder_.emit(relax.op.strided_slice(
                self.padded[var], axes=[1], begin=[0], end=[self.regions[var]]))
        return self.sliced[var]


def _pad_axis(array, axis: int, extra: int):
    if extra <= 0:
        return array
    width = [(0, 0)] * array.ndim
    width[axis] = (0, extra)
    return np.pad(array, width)


# --------------------------------------------------------------------------------------------
# Step 3a: where a region ends
# --------------------------------------------------------------------------------------------

_POOLS = {"relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d"}


@tvm.transform.module_pass(opt_level=0, name="EndRegions")
class _EndRegions:
    """Legalize now (into an opaque ``call_tir``) every op the blocked layout does not carry,
    so that ConvertLayout ends the region before it with one layout transform instead of
    applying a layout rule that fails or is wrong for it (a 5-D reshape, a rank-3 broadcast,
    Resize, ConvTranspose, anything unknown). :func:`carry_reason` says which ops are
    carried; ``records`` says which ended a region and why."""

    def __init__(self, block: int, legalize: dict) -> None:
        self.block, self.legalize = block, legalize
        self.records: list[LayoutRecord] = []

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        ends: Counter = Counter()
        ender = _RegionEnder(mod, self.block, self.legalize, ends)
        for gvar, func in _graph_functions(mod):
            ender.builder_.update_func(gvar, ender.visit_expr(func))
        out = ender.builder_.get()
        self.records = [LayoutRecord(op, n, why) for (op, why), n in sorted(ends.items())]
        for record in self.records:
            logger.info("%s", record)
        return out


def carry_reason(call: relax.Call, block: int) -> str | None:
    """None when the blocked layout carries ``call`` (ConvertLayout has a rule for it that is
    right for these shapes), else why not."""
    name = call.op.name
    out = _channels(call)
    if name == _CONV2D:
        if not _is_conv2d(call):
            return "not NCHW / OIHW"
        groups, cin = int(call.attrs.groups), _channels(call.args[0])
        if groups != 1 and not (groups == cin == out and int(call.args[1].ty.shape.values[1]) == 1):
            return f"grouped conv (groups={groups}) has no blocked compute"
        return None if out % block == 0 else f"{out} output channels, not a multiple of {block}"
    if name in _UNARY:
        return None
    if out is None:
        return "not a static 4-D tensor"
    if out % block:
        return f"{out} channels, not a multiple of {block}"
    shape = [int(d) for d in call.ty.shape.values]
    if name in _BINARY or name == "relax.divide":
        for arg in call.args:
            ty = arg.ty
            if not isinstance(ty, relax.TensorType) or ty.shape is None:
                return "an operand of unknown shape"
            dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else -1 for d in ty.shape.values]
            if not (dims == shape or all(d == 1 for d in dims) or dims == [1, out, 1, 1]):
                return f"broadcast of a {tuple(dims)} operand to {tuple(shape)}"
        return None
    if name in _POOLS:
        return None if str(call.attrs.layout) == "NCHW" else f"layout {call.attrs.layout}"
    if name == "relax.mean":
        axes = sorted(int(a) % 4 for a in call.attrs.axis or [])
        return None if axes == [2, 3] and call.attrs.keepdims else "not a spatial mean"
    if name == "relax.concat":
        fields = call.args[0].ty.fields if isinstance(call.args[0].ty, relax.TupleType) else []
        channels = [_channels_of(f) for f in fields]
        if int(call.attrs.axis) % 4 != 1 or not fields:
            return "not a channel concat"
        if any(c is None or c % block for c in channels):
            return f"inputs of {channels} channels, not all multiples of {block}"
        return None
    return "no blocked-layout rule"


@relax.expr_functor.mutator
class _RegionEnder(relax.PyExprMutator):
    def __init__(self, mod, block: int, legalize: dict, ends: Counter) -> None:
        super().__init__(mod)
        self.block, self.legalize, self.ends = block, legalize, ends

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.builder_.normalize(super().visit_call_(call))
        if not isinstance(call.op, tvm.ir.Op) or call.op == _CALL_TIR:
            return call
        reason = carry_reason(call, self.block)
        if reason is None:
            return call
        if not any(_channels(a) is not None for a in _tensor_args(call)):
            reason = ""  # after the regions (a classifier): nothing to end, legalized all the same
        rule = self.legalize.get(call.op.name) or call.op.get_attr("FLegalize")
        if rule is None:
            return call
        if self._is_blocked_resize(call):
            return self._resize(call, rule)
        if reason:
            self.ends[(call.op.name, reason)] += 1
        if self._is_head(call):
            return self._head(call)
        return rule(self.builder_, call)

    def _is_blocked_resize(self, call: relax.Call) -> bool:
        """A resize of a tensor that will be blocked (a feature pyramid's upsampling)."""
        channels = _channels(call)
        return (call.op.name == "relax.image.resize2d" and str(call.attrs.layout) == "NCHW"
                and channels is not None and channels % self.block == 0
                and self._blocked(call.args[0]))

    def _resize(self, call: relax.Call, rule) -> relax.Expr:
        """The resize as one kernel on ``NCHW{b}c`` (TOPI's blocked resize) between a transform
        in and one out, which cancel against ConvertLayout's: the region goes on through it."""
        b, a = self.block, call.attrs
        blocked = self.builder_.emit(relax.op.layout_transform(
            call.args[0], lambda n, c, h, w: (n, c // b, h, w, c % b)))
        resize = self.builder_.normalize(relax.op.image.resize2d(
            blocked, call.args[1], tuple(float(r) for r in a.roi), f"NCHW{b}c", a.method,
            a.coordinate_transformation_mode, a.rounding_method, a.cubic_alpha, a.cubic_exclude,
            a.extrapolation_value, a.out_dtype))
        out = self.builder_.emit(rule(self.builder_, resize))
        return relax.op.layout_transform(out, lambda n, c, h, w, ci: (n, c * b + ci, h, w))

    def _is_head(self, call: relax.Call) -> bool:
        """A plain conv whose output channels do not block but whose input does and comes out
        of a blocked region: a classifier's 1000-class 1x1 conv."""
        if call.op.name != _CONV2D or not _is_conv2d(call) or int(call.attrs.groups) != 1:
            return False
        data = call.args[0]
        return _channels(data) is not None and not _channels(data) % self.block and (
            self._blocked(data))

    def _blocked(self, var, depth: int = 8) -> bool:
        """``var`` will be blocked: the layout carries the op that makes it, and that op is a
        conv2d or reads such a tensor (through at most ``depth`` ops)."""
        value = self.lookup_binding(var) if isinstance(var, relax.Var) else None
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op != _CALL_TIR and carry_reason(value, self.block) is None):
            return False
        return value.op.name == _CONV2D or (depth > 0 and any(
            self._blocked(a, depth - 1) for a in _tensor_args(value)))

    def _head(self, call: relax.Call) -> relax.Expr:
        """The head conv as one kernel that reads ``NCHW{b}c`` (ConvertLayout's transform back
        to NCHW before it then meets this one and both cancel, see :class:`_CancelTransforms`)."""
        b, attrs = self.block, call.attrs
        blocked = self.builder_.emit(relax.op.layout_transform(
            call.args[0], lambda n, c, h, w: (n, c // b, h, w, c % b)))
        return self.builder_.call_te(
            conv2d_nchw_of_blocked, blocked, call.args[1],
            strides=[int(s) for s in attrs.strides], padding=[int(p) for p in attrs.padding],
            dilation=[int(d) for d in attrs.dilation],
            out_dtype=_out_dtype(attrs) or str(call.args[0].ty.dtype),
            primfunc_name_hint="conv2d_of_blocked")


def _tensor_args(call: relax.Call) -> list:
    args = []
    for arg in call.args:
        args.extend(arg.fields if isinstance(arg, relax.Tuple) else [arg])
    return args


@tvm.transform.module_pass(opt_level=0, name="CancelTransforms")
class _CancelTransforms:
    """``layout_transform(layout_transform(x, m1), m2)`` is ``x`` where ``m2`` undoes ``m1``
    (no padding either way): the pair ConvertLayout writes where a region's blocked tensor
    meets an op that takes it blocked again (a head conv, :meth:`_RegionEnder._head`)."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        canceller = _Canceller(mod)
        for gvar, func in _graph_functions(mod):
            canceller.builder_.update_func(gvar, canceller.visit_expr(func))
        if not canceller.cancelled:
            return mod
        return tvm.transform.Sequential([relax.transform.CanonicalizeBindings(),
                                         relax.transform.DeadCodeElimination()])(
            canceller.builder_.get())


@relax.expr_functor.mutator
class _Canceller(relax.PyExprMutator):
    """A transform that undoes the one before it is that one's input (an alias, canonicalized
    away)."""

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.cancelled = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.builder_.normalize(super().visit_call_(call))
        if not (_is_transform(call) and isinstance(call.args[0], relax.Var)):
            return call
        inner = self.lookup_binding(call.args[0])
        if not (_is_transform(inner) and _undoes(call, inner)):
            return call
        self.cancelled += 1
        return inner.args[0]


def _is_transform(value) -> bool:
    return (isinstance(value, relax.Call) and value.op == _LAYOUT_TRANSFORM
            and value.attrs.pad_value is None)


def _undoes(outer: relax.Call, inner: relax.Call) -> bool:
    """``outer``'s index map composed with ``inner``'s is the identity on ``inner``'s input."""
    source, result = inner.args[0].ty, outer.ty
    if not (isinstance(source, relax.TensorType) and isinstance(result, relax.TensorType)
            and source.shape is not None and result.shape is not None
            and tvm_ffi.structural_equal(source.shape, result.shape)):
        return False
    first, second = inner.attrs.index_map, outer.attrs.index_map
    analyzer = tvm.sym.Analyzer()
    for var, extent in zip(first.initial_indices, source.shape.values, strict=True):
        analyzer.bind(var, tvm.ir.Range(0, extent))
    composed = second.map_indices(first.map_indices(first.initial_indices))
    return all(analyzer.can_prove_equal(c, v)
               for c, v in zip(composed, first.initial_indices, strict=True))


# --------------------------------------------------------------------------------------------
# Step 3b: NCHW regions that ConvertLayout left between blocked tensors
# --------------------------------------------------------------------------------------------


@tvm.transform.module_pass(opt_level=0, name="SpreadBlocked")
class _SpreadBlocked:
    """ConvertLayout gives an op the layout of its (first) input, so an NCHW tensor that meets
    blocked ones in a concat keeps everything after it in NCHW: DenseNet's stem pool starts its
    first dense block, whose every conv then reads a transform and whose every concat a
    transform back. Move each connected region of such carried NCHW ops (:func:`carry_reason`)
    to the blocked layout where that leaves fewer layout transforms than it removes."""

    def __init__(self, block: int) -> None:
        self.block = block

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        out = _rewrite_marked(mod, lambda f: _nchw_regions(f, self.block),
                              lambda members: _Spreader(members, self.block))
        if out is mod:
            return mod
        return tvm.transform.Sequential([relax.transform.CanonicalizeBindings(),
                                         relax.transform.DeadCodeElimination()])(out)


def _nchw_regions(func: relax.Function, block: int) -> set:
    """The NCHW vars to move to the blocked layout: every region (ops connected through their
    operands) where the transforms it removes (blocking ones of its tensors, unblocking ones it
    alone reads) outnumber the ones it needs (blocking its other operands, unblocking a tensor
    that something outside the region reads)."""
    bindings = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
    users: dict = {}
    for var, value in bindings.items():
        for arg in relax.analysis.free_vars(value):
            users.setdefault(arg, []).append(var)
    for arg in relax.analysis.free_vars(func.body.body):
        users.setdefault(arg, []).append(None)  # the return value: outside every region
    carried = {v for v, value in bindings.items() if _carried_nchw(v, value, block)}
    region_of: dict = {}
    for var in carried:  # union by flood fill over operands and users
        if var in region_of:
            continue
        region, todo = set(), [var]
        while todo:
            v = todo.pop()
            if v in region:
                continue
            region.add(v)
            todo.extend(a for a in _tensor_args(bindings[v]) if a in carried)
            todo.extend(u for u in users.get(v, []) if u in carried)
        region_of.update(dict.fromkeys(region, frozenset(region)))
    members: set = set()
    for region in set(region_of.values()):
        removed, needed, blocked_inputs = 0, 0, set()
        for var in region:
            outside = [u for u in users.get(var, []) if u not in region]
            blocking = [u for u in outside if u is not None and _is_transform(bindings[u])
                        and _is_blocking(bindings[u], block)]
            removed += len(blocking)
            needed += len(outside) > len(blocking)
            for arg in _tensor_args(bindings[var]):
                if arg in region or not isinstance(arg, relax.Var):
                    continue
                source = bindings.get(arg)
                if _is_transform(source) and _is_unblocking(source, block):
                    removed += all(u in region for u in users[arg])
                elif _channels(arg) and arg not in blocked_inputs:
                    blocked_inputs.add(arg)
                    needed += 1
        if removed > needed:
            members |= region
    return members


def _carried_nchw(var, value, block: int) -> bool:
    """``var = value`` is an NCHW op the blocked layout carries (not a conv: ConvertLayout
    decided those), on channels that ``block`` divides."""
    if not (isinstance(var, relax.DataflowVar) and isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op) and value.op.name not in (_CONV2D, _CALL_TIR.name)
            and value.op != _LAYOUT_TRANSFORM):
        return False
    channels = _channels(var)
    if channels is None or channels % block or carry_reason(value, block) is not None:
        return False
    if value.op.name == "relax.concat":
        return isinstance(value.args[0], relax.Tuple)
    return all(_channels(a) in (None, 1) or _channels(a) == channels
               for a in _tensor_args(value))


@relax.expr_functor.mutator
class _Spreader(relax.PyExprMutator):
    """Re-emit each member in the blocked layout; an outside reader gets one transform back."""

    def __init__(self, members: set, block: int) -> None:
        super().__init__()
        self.members, self.block = members, block
        self.blocked: dict = {}  # var -> its blocked var (members and blocked operands)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var, value, b = binding.var, binding.value, self.block
        if var in self.members:
            args = [self._operand(a) for a in value.args]
            self.blocked[var] = self.builder_.emit(_blocked_op(value, args, b))
            back = relax.op.layout_transform(self.blocked[var],
                                             lambda n, c, h, w, ci: (n, c * b + ci, h, w))
            self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(back)))
        elif (_is_transform(value) and value.args[0] in self.members
              and _is_blocking(value, b)):
            self.builder_.emit_normalized(relax.VarBinding(var, self.blocked[value.args[0]]))
        else:
            super().visit_var_binding_(binding)

    def _operand(self, arg: relax.Expr) -> relax.Expr:
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([self._operand(f) for f in arg.fields])
        if arg in self.blocked:
            return self.blocked[arg]
        source = self.lookup_binding(arg) if isinstance(arg, relax.Var) else None
        if _is_transform(source) and _is_unblocking(source, self.block):
            return source.args[0]
        if not _channels(arg) or _channels(arg) == 1 or _constant(arg):
            return arg  # a scalar, an all-ones broadcast; constants: _blocked_op
        b = self.block
        self.blocked[arg] = self.builder_.emit(relax.op.layout_transform(
            self.visit_expr(arg), lambda n, c, h, w: (n, c // b, h, w, c % b)))
        return self.blocked[arg]


_BLOCKED_POOLS = {"relax.nn.max_pool2d": relax.op.nn.max_pool2d,
                  "relax.nn.avg_pool2d": relax.op.nn.avg_pool2d}


def _blocked_op(value: relax.Call, args: list, block: int) -> relax.Expr:
    """``value`` (an op :func:`carry_reason` carries, on NCHW) on the blocked ``args``; its
    per-channel and full-size constants are repacked into ``NCHW{block}c``."""
    name, attrs, layout = value.op.name, value.attrs, f"NCHW{block}c"
    if name in _BLOCKED_POOLS:
        return _BLOCKED_POOLS[name](args[0], attrs.pool_size, attrs.strides, attrs.padding,
                                    attrs.dilation, attrs.ceil_mode, attrs.count_include_pad,
                                    layout, layout)
    if name == "relax.nn.adaptive_avg_pool2d":
        return relax.op.nn.adaptive_avg_pool2d(args[0], attrs.output_size, layout, layout)
    if name == "relax.concat":
        return relax.op.concat(args[0], axis=1)
    if name == "relax.mean":  # spatial, kept dims (carry_reason)
        return relax.op.mean(args[0], axis=[2, 3], keepdims=True)
    packed = []
    for arg in args:
        if _constant(arg) and arg.value.ndim == 4 and int(arg.value.shape[1]) > 1:
            x = values(arg)  # (1, C, H|1, W|1) -> (1, C/b, H|1, W|1, b)
            n, c, h, w = x.shape
            arg = constant(np.ascontiguousarray(
                x.reshape(n, c // block, block, h, w).transpose(0, 1, 3, 4, 2)))
        packed.append(arg)
    return relax.Call(value.op, packed, attrs, value.ty_args)


# --------------------------------------------------------------------------------------------
# Step 3c: layout transforms of 1x1 maps are reshapes
# --------------------------------------------------------------------------------------------


@tvm.transform.module_pass(opt_level=0, name="TransformsAsReshapes")
class _TransformsAsReshapes:
    """``layout_transform`` between NCHW and ``NCHW{b}c`` of a 1x1 map (the pooled features
    before a classifier, a squeeze-excitation gate) moves no element: it is a reshape (a view,
    not a kernel); a reshape of a reshape is one reshape."""

    def __init__(self, block: int) -> None:
        self.block = block

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        return _rewrite_functions(mod, lambda func: _ReshapeRewriter(self.block).visit_expr(func))


@relax.expr_functor.mutator
class _ReshapeRewriter(relax.PyExprMutator):
    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.builder_.normalize(super().visit_call_(call))
        if call.op == _RESHAPE and isinstance(call.args[0], relax.Var):
            inner = self.builder_.lookup_binding(call.args[0])
            if isinstance(inner, relax.Call) and inner.op == _RESHAPE:  # one view of the source
                return relax.op.reshape(inner.args[0], call.args[1])
            return call
        if call.op != _LAYOUT_TRANSFORM or call.attrs.pad_value is not None:
            return call
        src, dst = call.args[0].ty, call.ty
        if not (is_static(src) and is_static(dst)):
            return call
        src_shape = [int(d) for d in src.shape.values]
        if src_shape[2:4] != [1, 1]:
            return call
        if _is_blocking(call, self.block) or _is_unblocking(call, self.block):
            return relax.op.reshape(call.args[0], dst.shape)
        return call


# --------------------------------------------------------------------------------------------
# Step 3e: a flattened blocked map before a matmul is a view
# --------------------------------------------------------------------------------------------


@tvm.transform.module_pass(opt_level=0, name="FlattenBlocked")
class _FlattenBlocked:
    """``matmul(reshape(layout_transform(x, NCHW{b}c -> NCHW), (N, C*H*W)), W)`` with a
    constant ``W`` (VGG's and AlexNet's classifier) -> ``matmul(reshape(x, (N, C*H*W)), W')``:
    the flatten of the blocked map is a view, and ``W'`` holds ``W``'s rows in the blocked
    order (a permutation: exact). Where the transform or the flatten has another use, nothing
    changes (the NCHW map is needed anyway)."""

    def __init__(self, block: int) -> None:
        self.block = block

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        # The transforms left unused go in Step 4's DeadCodeElimination.
        return _rewrite_functions(
            mod, lambda func: _Flattener(mod, func, self.block).visit_expr(func))


@relax.expr_functor.mutator
class _Flattener(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, func: relax.Function, block: int) -> None:
        super().__init__(mod)
        self.mod, self.block, self.uses = mod, block, count_uses(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _CALL_TIR or len(call.args[1].fields) != 2:
            return call
        flat, weight = call.args[1].fields
        reshape = self.lookup_binding(flat) if isinstance(flat, relax.Var) else None
        if not (isinstance(reshape, relax.Call) and reshape.op == _RESHAPE
                and isinstance(reshape.args[0], relax.Var) and self.uses.get(flat) == 1
                and self.uses.get(reshape.args[0]) == 1 and _constant(weight)):
            return call
        transform = self.lookup_binding(reshape.args[0])
        if not (isinstance(transform, relax.Call) and transform.op == _LAYOUT_TRANSFORM
                and transform.attrs.pad_value is None and _is_unblocking(transform, self.block)
                and is_static(transform.args[0].ty) and is_static(flat.ty)):
            return call
        n, blocks, h, w, b = (int(d) for d in transform.args[0].ty.shape.values)
        if [int(d) for d in flat.ty.shape.values] != [n, blocks * b * h * w]:
            return call
        if not _is_matmul(self.mod[call.args[0]], flat, weight):
            return call
        rows = np.arange(blocks * b * h * w).reshape(blocks, b, h, w).transpose(0, 2, 3, 1)
        view = self.builder_.emit(relax.op.reshape(transform.args[0], flat.ty.shape))
        weight = constant(values(weight)[rows.ravel()])
        return relax.Call(call.op, [call.args[0], relax.Tuple([view, weight])], call.attrs,
                          call.ty_args)


def _is_matmul(func, a: relax.Expr, b: relax.Expr) -> bool:
    """``func`` is the legalized ``relax.matmul`` of 2-D ``a`` and ``b`` (``b``'s rows are
    the contracted axis)."""
    if not isinstance(func, tvm.tirx.PrimFunc) or b.ty.ndim != 2:
        return False
    x, y = relax.Var("a", a.ty), relax.Var("b", b.ty)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        bb.emit_func_output(relax.op.matmul(x, y))
    legalized = relax.transform.LegalizeOps()(bb.get())
    refs = [f for f in legalized.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return len(refs) == 1 and tvm_ffi.structural_equal(
        refs[0].without_attr("global_symbol"), func.without_attr("global_symbol"),
        map_free_vars=True)


def _is_unblocking(call: relax.Call, block: int) -> bool:
    """``call`` is ``layout_transform`` NCHW{block}c -> NCHW."""
    index_map = call.attrs.index_map
    if len(index_map.initial_indices) != 5:
        return False
    ref = tvm.tirx.IndexMap.from_func(lambda n, c, h, w, ci: (n, c * block + ci, h, w),
                                      index_dtype=str(index_map.initial_indices[0].ty))
    return tvm_ffi.structural_equal(index_map, ref, map_free_vars=True)


# --------------------------------------------------------------------------------------------
# Step 3d: layout transforms of constants, in numpy
# --------------------------------------------------------------------------------------------


@tvm.transform.module_pass(opt_level=0, name="PackConstants")
class _PackConstants:
    """``layout_transform(constant)`` -> the transformed constant, computed in numpy (FoldConstant
    would build and run one kernel per weight: 3 s of a ResNet-50's compile)."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        return _rewrite_functions(mod, lambda func: _ConstantPacker().visit_expr(func))


@relax.expr_functor.mutator
class _ConstantPacker(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _LAYOUT_TRANSFORM or not _constant(call.args[0]):
            return call
        packed = pack(values(call.args[0]), call.attrs.index_map, call.attrs.pad_value)
        return call if packed is None else constant(packed)


def pack(array: np.ndarray, index_map: tvm.tirx.IndexMap, pad_value=None) -> np.ndarray | None:
    """``array`` laid out by ``index_map`` (a bijection of split / fuse / reorder indices), or
    None where it is not one this evaluates (padding, other expressions)."""
    if pad_value is not None or len(index_map.initial_indices) != array.ndim:
        return None
    shape = [int(d) for d in index_map.map_shape(list(array.shape))]
    if int(np.prod(shape)) != array.size:
        return None
    # Open grids: each output index is evaluated on the input axes it reads, then broadcast
    # once into the flat output position (ResNet-50's 156 weights: 1.2 s with full grids).
    grid = np.indices(array.shape, dtype=np.int64, sparse=True)
    env = {var: grid[k] for k, var in enumerate(index_map.initial_indices)}
    flat = np.zeros((1,) * array.ndim, np.int64)
    try:
        for expr, extent in zip(index_map.final_indices, shape, strict=True):
            index = _evaluate(expr, env)
            if np.min(index) < 0 or np.max(index) >= extent:
                return None
            flat = flat * extent + index
    except _NotAffine:
        return None
    flat = np.broadcast_to(flat, array.shape).ravel()
    hit = np.zeros(array.size, bool)
    hit[flat] = True
    if not hit.all():  # not a bijection: some element written twice, some never
        return None
    out = np.empty(array.size, array.dtype)
    out[flat] = array.ravel()
    return out.reshape(shape)


class _NotAffine(Exception):
    pass


_EVAL = {
    tvm.tirx.Add: np.add, tvm.tirx.Sub: np.subtract, tvm.tirx.Mul: np.multiply,
    tvm.tirx.FloorDiv: np.floor_divide, tvm.tirx.FloorMod: np.mod,
}


def _evaluate(expr, env: dict):
    if isinstance(expr, tvm.tirx.IntImm):
        return np.int64(expr.value)
    if isinstance(expr, tvm.tirx.Var):
        if expr not in env:
            raise _NotAffine(expr)
        return env[expr]
    op = _EVAL.get(type(expr))
    if op is None:
        raise _NotAffine(type(expr).__name__)
    return op(_evaluate(expr.a, env), _evaluate(expr.b, env))


# --------------------------------------------------------------------------------------------
# Step 3b: stems write the blocked layout
# --------------------------------------------------------------------------------------------


@tvm.transform.module_pass(opt_level=0, name="BlockStems")
class _BlockStems:
    """``layout_transform(chain(conv2d(x)))`` into ``NCHW{b}c``, where the conv reads a plain
    ``x`` whose channels do not block (ConvertLayout leaves such a stem in NCHW) and ``chain``
    is channel-wise (the ops of :func:`_joins`, a max pool) with no other use: the conv writes
    the blocked layout itself (weights packed ``OIHW{C}i{b}o``) and the chain runs on it."""

    def __init__(self, block: int) -> None:
        self.block = block

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        out = _rewrite_marked(mod, lambda f: _stems(f, self.block),
                              lambda stems: _StemRewriter(stems, self.block))
        # The transform's var is now an alias of the stem's result: gone, so that the stem's
        # conv and its epilogue fuse where the chain is empty.
        return out if out is mod else relax.transform.CanonicalizeBindings()(out)


def _stems(func: relax.Function, block: int) -> dict:
    """Role of each var to rewrite: "conv" (the stem), "chain" (its channel-wise ops); the
    layout transform's var maps to the var whose blocked value replaces it."""
    bindings = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
    uses = count_uses(func)
    out: dict = {}
    for var, value in bindings.items():
        if not (isinstance(value, relax.Call) and value.op == _LAYOUT_TRANSFORM
                and _is_blocking(value, block)):
            continue
        chain, v = [], value.args[0]
        while isinstance(v, relax.DataflowVar) and v in bindings and uses.get(v, 0) == 1:
            val = bindings[v]
            if _is_conv2d(val):
                if (val.attrs.groups == 1 and _constant(val.args[1])
                        and _channels(val) % block == 0 and _channels(val.args[0]) % block):
                    out.update({v: "conv", **dict.fromkeys(chain, "chain"),
                                var: chain[-1] if chain else v})
                break
            tensors = [a for a in _args(val) if isinstance(a, relax.Var)]
            if len(tensors) != 1 or not (_joins(val, _channels(val) or 0) or _is_max_pool(val)):
                break  # (a residual add would mix the layouts)
            chain.insert(0, v)
            v = tensors[0]
    return out


_LAYOUT_TRANSFORM = tvm.ir.Op.get("relax.layout_transform")
_RESHAPE = tvm.ir.Op.get("relax.reshape")


def _is_blocking(call: relax.Call, block: int) -> bool:
    """``call`` is ``layout_transform`` NCHW -> NCHW{block}c."""
    if call.attrs.pad_value is not None or _channels(call.args[0]) is None:
        return False
    index_map = call.attrs.index_map
    if len(index_map.initial_indices) != 4:
        return False
    ref = tvm.tirx.IndexMap.from_func(lambda n, c, h, w: (n, c // block, h, w, c % block),
                                      index_dtype=str(index_map.initial_indices[0].ty))
    return tvm_ffi.structural_equal(index_map, ref, map_free_vars=True)


def _is_max_pool(value) -> bool:
    return (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.nn.max_pool2d")
            and str(value.attrs.layout) == "NCHW" and str(value.attrs.out_layout) == "NCHW")


@relax.expr_functor.mutator
class _StemRewriter(relax.PyExprMutator):
    """Re-emit each stem and its chain in the blocked layout; the transform takes the result."""

    def __init__(self, stems: dict, block: int) -> None:
        super().__init__()
        self.stems, self.block = stems, block
        self.blocked: dict = {}  # old var -> its blocked var

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var, value, role = binding.var, binding.value, self.stems.get(binding.var)
        if role == "conv":
            self.blocked[var] = self.builder_.emit(self._conv(value))
        elif role == "chain":
            self.blocked[var] = self.builder_.emit(self._chain_op(value))
        elif role is not None:  # the layout transform: now the chain's blocked result
            self.builder_.emit_normalized(relax.VarBinding(var, self.blocked[role]))
        else:
            super().visit_var_binding_(binding)

    def _conv(self, value: relax.Call) -> relax.Expr:
        b, attrs = self.block, value.attrs
        weight = values(value.args[1])
        o, c, kh, kw = weight.shape  # -> (O/b, 1, KH, KW, C, b)
        packed = weight.reshape(o // b, b, 1, c, kh, kw).transpose(0, 2, 4, 5, 3, 1)
        return relax.op.nn.conv2d(
            self.visit_expr(value.args[0]), constant(np.ascontiguousarray(packed)), attrs.strides,
            attrs.padding, attrs.dilation, 1, "NCHW", f"OIHW{c}i{b}o", f"NCHW{b}c",
            _out_dtype(attrs))

    def _chain_op(self, value: relax.Call) -> relax.Expr:
        return _blocked_op(value, [self.blocked.get(a, a) for a in value.args], self.block)


# --------------------------------------------------------------------------------------------
# Step 4: legalization of blocked conv2d
# --------------------------------------------------------------------------------------------


def _legalize_conv2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A blocked conv2d -> our compute (groups 1 or depthwise), else the default legalization
    (plain layouts)."""
    from tvm.relax.transform.legalize_ops.nn import _nn_conv2d

    attrs = call.attrs
    block = _block_of(attrs)
    if block is None:
        return _nn_conv2d(bb, call)
    data, weight = call.args
    out_dtype = _out_dtype(attrs) or str(data.ty.dtype)
    args = dict(strides=[int(s) for s in attrs.strides],
                padding=[int(p) for p in attrs.padding],
                dilation=[int(d) for d in attrs.dilation], out_dtype=out_dtype)
    if str(attrs.data_layout) == "NCHW":  # a stem, its weights packed by _BlockStems
        return bb.call_te(conv2d_nchwc, data, weight, **args, primfunc_name_hint=CONV_BLOCK)
    channels = int(data.ty.shape.values[1]) * block
    out_channels = int(weight.ty.shape.values[0]) * block
    if attrs.groups == 1:
        packed = relax.op.layout_transform(
            weight, lambda o, i, y, x, oi: (o, i // block, y, x, i % block, oi))
        packed = bb.emit(_ConstantPacker().visit_expr(packed) if _constant(weight) else packed)
        return bb.call_te(conv2d_nchwc, data, packed, **args, primfunc_name_hint=CONV_BLOCK)
    if attrs.groups == channels == out_channels and int(weight.ty.shape.values[1]) == 1:
        return bb.call_te(depthwise_conv2d_nchwc, data, weight, **args,
                          primfunc_name_hint=DEPTHWISE_BLOCK)
    raise BNFoldError(  # Step 3 legalized every other conv before ConvertLayout
        f"blocked conv2d with groups={attrs.groups} of {channels} channels has no compute")


def _block_of(attrs) -> int | None:
    """``b`` of a conv2d in ``NCHW{b}c`` / ``OIHW{b}o``, or of a stem (``NCHW`` /
    ``OIHW{C}i{b}o`` -> ``NCHW{b}c``); None for any other layout."""
    layout, kernel, out = str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)
    if not (out.startswith("NCHW") and out.endswith("c") and out[4:-1].isdigit()):
        return None
    block = int(out[4:-1])
    if layout == out and kernel == f"OIHW{block}o":
        return block
    inner = kernel.removeprefix("OIHW").removesuffix(f"i{block}o")
    stem = kernel == f"OIHW{inner}i{block}o" and inner.isdigit()
    return block if layout == "NCHW" and stem else None


def _out_dtype(attrs) -> str | None:
    dtype = attrs.out_dtype
    return None if dtype is None or str(dtype) in ("", "void") else str(dtype)


def _padded(data: te.Tensor, padding) -> te.Tensor:
    top, left, bottom, right = padding
    if not any(padding):
        return data
    rest = [0] * (len(data.shape) - 4)
    return topi.nn.pad(data, [0, 0, top, left, *rest], [0, 0, bottom, right, *rest],
                       name="pad_temp")


def _out_size(size: int, kernel: int, stride: int, dilation: int, pad: int) -> int:
    return (size + pad - dilation * (kernel - 1) - 1) // stride + 1


def conv2d_nchwc(data: te.Tensor, weight: te.Tensor, strides, padding, dilation,
                 out_dtype: str) -> te.Tensor:
    """``data`` (N, C/b, H, W, b) x ``weight`` (O/b, C/b, KH, KW, b, b) -> (N, O/b, OH, OW, b);
    a stem's ``data`` (N, C, H, W) with ``weight`` (O/b, 1, KH, KW, C, b) likewise."""
    n, _, h, w = (int(d) for d in data.shape[:4])
    blocks_out, blocks_in, kh, kw, block_in, block_out = (int(d) for d in weight.shape)
    (sh, sw), (dh, dw) = strides, dilation
    oh = _out_size(h, kh, sh, dh, padding[0] + padding[2])
    ow = _out_size(w, kw, sw, dw, padding[1] + padding[3])
    pad = _padded(data, padding)
    rco = te.reduce_axis((0, blocks_in), "rco")
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    rci = te.reduce_axis((0, block_in), "rci")
    def read(b, y, x):
        if len(data.shape) == 4:
            return pad[b, rco * block_in + rci, y, x]
        return pad[b, rco, y, x, rci]

    return te.compute(
        (n, blocks_out, oh, ow, block_out),
        lambda b, o, y, x, oi: te.sum(
            read(b, y * sh + ry * dh, x * sw + rx * dw).astype(out_dtype)
            * weight[o, rco, ry, rx, rci, oi].astype(out_dtype),
            axis=[rco, ry, rx, rci]),
        name=CONV_BLOCK)


def conv2d_nchw_of_blocked(data: te.Tensor, weight: te.Tensor, strides, padding, dilation,
                           out_dtype: str) -> te.Tensor:
    """``data`` (N, C/b, H, W, b) x ``weight`` (O, C, KH, KW) -> (N, O, OH, OW): an NCHW conv
    whose first stage gathers its blocked input into NCHW (what a layout transform kernel
    would write), in the same kernel."""
    n, blocks, h, w, b = (int(d) for d in data.shape)
    plain = te.compute((n, blocks * b, h, w),
                       lambda i, c, y, x: data[i, c // b, y, x, c % b], name="unblocked")
    return topi.nn.conv2d_nchw(plain, weight, strides, padding, dilation, out_dtype)


def depthwise_conv2d_nchwc(data: te.Tensor, weight: te.Tensor, strides, padding, dilation,
                           out_dtype: str) -> te.Tensor:
    """``data`` (N, C/b, H, W, b) x ``weight`` (C/b, 1, KH, KW, b) -> (N, C/b, OH, OW, b)."""
    n, blocks, h, w, block = (int(d) for d in data.shape)
    _, _, kh, kw, _ = (int(d) for d in weight.shape)
    (sh, sw), (dh, dw) = strides, dilation
    oh = _out_size(h, kh, sh, dh, padding[0] + padding[2])
    ow = _out_size(w, kw, sw, dw, padding[1] + padding[3])
    pad = _padded(data, padding)
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    return te.compute(
        (n, blocks, oh, ow, block),
        lambda b, c, y, x, ci: te.sum(
            pad[b, c, y * sh + ry * dh, x * sw + rx * dw, ci].astype(out_dtype)
            * weight[c, 0, ry, rx, ci].astype(out_dtype),
            axis=[ry, rx]),
        name=DEPTHWISE_BLOCK)
