"""What a fused kernel is: its reduction *anchor*, the producers before it and the epilogue after.

After ``LegalizeOps → AnnotateTIROpPattern → FoldConstant → FuseOps → FuseTIR`` a fused kernel
is one PrimFunc: injective producers (``pad_temp``), one reduction block (``conv2d_nchw``,
``matmul``, a pool...) and an elementwise epilogue chain (bias ``T_add``, residual ``T_add``,
``compute`` = relu, ``T_maximum``/``T_minimum`` = clip). :func:`analyze` decides whether our
schedules apply (exactly one reduction, followed only by elementwise blocks that read its result
at their own indices, the last one writing the function's output) and reads off the roles of the
output axes from the operand accesses: the vector axis (innermost output axis), the rows (the axis
indexing the broadcast operand: output channels), the hrows (a second register-blocked axis that
shares those broadcasts: output height), the strides of the vector operands, and whether a 1x1
conv reads whole output rows (``pointwise``: its rows flatten into one vector axis). It changes
nothing; every decision after it reads the :class:`Anchor`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .. import blocked_layout

logger = logging.getLogger(__name__)

DATA_PAR = 0  # tirx.IterVar.DataPar
COMM_REDUCE = 2  # tirx.IterVar.CommReduce
#: The attribute TVM 0.27 (MetaSchedule, dlight) reads and writes on a scheduled PrimFunc.
SCHEDULED_ATTR = "tirx.is_scheduled"

@dataclass(frozen=True)
class Anchor:
    """What ``analyze`` found in a PrimFunc: the reduction block and its epilogue.

    Axis fields index ``spatial``: ``vec_axis`` is the innermost output axis (vectorized),
    ``rows_axis`` the axis that indexes the broadcast operand (output channels of a conv, rows
    of a matmul), ``hrow_axis`` a second register-blocked axis sharing those broadcasts (the
    output height of a conv); -1 when there is none. ``pointwise``: the vector operands read
    whole output rows (1x1 conv), so ``hrow_axis`` and ``vec_axis`` flatten into one.
    """

    block: str
    kind: str
    spatial: tuple[int, ...]
    reduction: tuple[int, ...]
    epilogue: tuple[str, ...]
    epilogue_operands: int
    dtype: str
    epilogue_constants: int = 0  # scalars of the epilogue (0 of relu, 0 and 6 of clip)
    producers: tuple[str, ...] = ()  # injective blocks feeding the anchor (pad_temp)
    vec_axis: int = -1
    rows_axis: int = -1
    hrow_axis: int = -1
    shared_input: bool = True  # one vector load serves every row of the tile
    vec_stride: int = 1  # stride of the vector axis in the vector operands; 0: not affine
    hrow_stride: int = 1
    pointwise: bool = False
    blocked: bool = False  # a blocked-layout conv (blocked_layout): rows = columns, hrows = blocks

    @property
    def flops(self) -> int:
        """2 x multiply-adds of the anchor."""
        return 2 * math.prod(self.spatial) * math.prod(self.reduction)

    @property
    def width(self) -> int:
        """Extent of the vector axis as scheduled (output rows flattened when pointwise)."""
        width = axis_extent(self, self.vec_axis)
        return width * axis_extent(self, self.hrow_axis) if self.pointwise else width

    @property
    def conv_only(self) -> Anchor:
        """The anchor without its epilogue's registers (operands, constants): what is live in
        the conv's own loops when the epilogue runs after the tile is stored."""
        return dataclasses.replace(self, epilogue_operands=0, epilogue_constants=0)


def analyze(func: tirx.PrimFunc) -> Anchor | None:
    """The reduction anchor of ``func``, or None when it has no single reduction block followed
    only by an elementwise epilogue chain (such functions are left alone)."""
    found = anchor_or_reason(func)
    if isinstance(found, str):
        logger.debug("the default schedules do not apply: %s", found)
        return None
    return found


def anchor_or_reason(func: tirx.PrimFunc) -> Anchor | str:
    """The Anchor, or the reason why there is none."""
    if func.attrs is not None and SCHEDULED_ATTR in func.attrs:
        return "already scheduled"
    try:
        sch = s_tir.Schedule(func)
        rvs = sch.get_child_blocks(sch.get_sblock("root"))
    except (RuntimeError, ValueError) as err:
        return f"no root block ({err})"
    blocks = [sch.get(rv) for rv in rvs]
    for rv, block in zip(rvs, blocks, strict=True):
        loops = [sch.get(lp) for lp in sch.get_loops(rv)]
        if len(loops) != len(block.iter_vars) or not all(
            isinstance(lp.extent, tirx.IntImm) and int(lp.extent) == int(iv.dom.extent)
            for lp, iv in zip(loops, block.iter_vars, strict=True)
        ):
            return f"block {block.name_hint!r} is not a plain loop nest (scheduled already?)"
        if any(iv.iter_type not in (DATA_PAR, COMM_REDUCE) for iv in block.iter_vars):
            return f"block {block.name_hint!r} has opaque iterators"
        if len(block.writes) != 1:
            return f"block {block.name_hint!r} writes {len(block.writes)} buffers"
    reductions = [i for i, b in enumerate(blocks) if _reduce_iters(b)]
    if len(reductions) != 1:
        return f"{len(reductions)} reduction blocks (need exactly one)"
    pos = reductions[0]
    anchor, producers, epilogue = blocks[pos], blocks[:pos], blocks[pos + 1 :]
    iters = list(anchor.iter_vars)
    n_spatial = len(iters) - len(_reduce_iters(anchor))
    if n_spatial == 0 or any(iv.iter_type != DATA_PAR for iv in iters[:n_spatial]):
        return f"{anchor.name_hint!r}: spatial iterators must precede reduction iterators"
    out = anchor.writes[0]
    spatial_vars = [iv.var for iv in iters[:n_spatial]]
    if not is_identity(out.region, spatial_vars):
        return f"{anchor.name_hint!r} does not write its output at its spatial iterators"
    produced = [p.writes[0].source for p in producers]
    for later in epilogue:
        if any(r.source.same_as(buf) for r in later.reads for buf in produced):
            return f"epilogue block {later.name_hint!r} reads a producer of the anchor"
    extents = tuple(int(iv.dom.extent) for iv in iters[:n_spatial])
    found = _epilogue(func, blocks[: pos + 1], epilogue, out.source, extents)
    if isinstance(found, str):
        return found
    operands, constants = found

    # Roles of the spatial axes, read off the anchor's operand accesses.
    reads = [r for r in anchor.reads if not r.source.same_as(out.source)]
    vec_var = spatial_vars[-1]
    vector_ops = [r for r in reads if reads_any(r.region, [vec_var])]
    bcast_ops = [r for r in reads if not reads_any(r.region, [vec_var])]
    rows_axis = -1
    for i in sorted(range(n_spatial - 1), key=lambda i: -extents[i]):
        if extents[i] > 1 and any(reads_any(r.region, [spatial_vars[i]]) for r in bcast_ops):
            rows_axis = i
            break
    hrow_axis = n_spatial - 2
    if (
        hrow_axis < 0
        or hrow_axis == rows_axis
        or not any(reads_any(r.region, [spatial_vars[hrow_axis]]) for r in vector_ops)
    ):
        hrow_axis = -1
    shared = rows_axis < 0 or not any(
        reads_any(r.region, [spatial_vars[rows_axis]]) for r in vector_ops
    )
    vec_stride, hrow_stride, pointwise = _vector_access(
        vector_ops, iters, n_spatial, hrow_axis, producers
    )
    found = Anchor(
        block=anchor.name_hint,
        kind=_kind(anchor, n_spatial, rows_axis, vector_ops, bcast_ops),
        spatial=extents,
        reduction=tuple(int(iv.dom.extent) for iv in iters[n_spatial:]),
        epilogue=tuple(b.name_hint for b in epilogue),
        epilogue_operands=operands,
        dtype=str(out.source.dtype),
        epilogue_constants=constants,
        producers=tuple(p.name_hint for p in producers),
        vec_axis=n_spatial - 1,
        rows_axis=rows_axis,
        hrow_axis=hrow_axis,
        shared_input=shared,
        vec_stride=vec_stride,
        hrow_stride=hrow_stride,
        pointwise=pointwise,
    )
    if anchor.name_hint in (blocked_layout.CONV_BLOCK, blocked_layout.DEPTHWISE_BLOCK):
        return _as_blocked(found, spatial_vars, vector_ops, bcast_ops)
    return found


def _as_blocked(found: Anchor, spatial_vars, vector_ops, bcast_ops) -> Anchor | str:
    """The roles of a blocked conv (``out[n, o, y, x, oi]``, see blocked_layout): the vector is
    the channel block ``oi``, the rows are the output columns ``x`` (one input broadcast each,
    or one input vector when depthwise) and the hrows are output blocks ``o`` (one weight vector
    each), after checking that the accesses are what that compute writes."""
    depthwise = found.block == blocked_layout.DEPTHWISE_BLOCK
    n, o, _, x, _ = spatial_vars if len(spatial_vars) == 5 else (None,) * 5
    weights = [r for r in vector_ops if reads_any(r.region, [o]) and not reads_any(r.region, [x])]
    inputs = [r for r in (vector_ops if depthwise else bcast_ops) if reads_any(r.region, [x])]
    if n is None or len(weights) != 1 or len(inputs) != 1 or len(vector_ops) != 1 + depthwise:
        return f"{found.block!r} does not have the accesses of a blocked conv"
    return dataclasses.replace(
        found, kind="depthwise_conv2d" if depthwise else "conv2d", vec_axis=4, rows_axis=3,
        hrow_axis=1, shared_input=not depthwise, vec_stride=1, hrow_stride=1, pointwise=False,
        blocked=True)


def _epilogue(func, earlier, epilogue, out, extents) -> tuple[int, int] | str:
    """(operands, constants) of an elementwise epilogue over the anchor's output ``out``: each
    block reads the anchor's output or earlier epilogue results at its own indices (a chain or a
    DAG such as ``y * sigmoid(y)``), and only the last block writes a function output."""
    params = list(func.params)
    internal = [out]
    operands, constants = [], []
    if epilogue and any(out.same_as(p) for p in params):
        return "the anchor's output is also a function output"
    for block in epilogue:
        if _reduce_iters(block):
            return f"epilogue block {block.name_hint!r} is a reduction"
        if tuple(int(iv.dom.extent) for iv in block.iter_vars) != extents:
            return f"epilogue block {block.name_hint!r} is not elementwise over the output"
        own = [iv.var for iv in block.iter_vars]
        if not is_identity(block.writes[0].region, own):
            return f"epilogue block {block.name_hint!r} does not write elementwise"
        uses_internal = False
        for r in block.reads:
            if any(r.source.same_as(b) for b in internal):
                if not is_identity(r.region, own):
                    return f"epilogue block {block.name_hint!r} reads {r.source.name} unaligned"
                uses_internal = True
                continue
            if any(r.source.same_as(b.writes[0].source) for b in earlier):
                return f"epilogue block {block.name_hint!r} reads an earlier intermediate"
            # A read at a constant index is a scalar (the 0 and 6 of a clip arrive as 0-d).
            is_const = all(isinstance(rg.min, tirx.IntImm) for rg in r.region)
            bucket = constants if is_const else operands
            if not any(r.source.same_as(b) for b in bucket):
                bucket.append(r.source)
        if not uses_internal:
            return f"epilogue block {block.name_hint!r} does not read the anchor's result"
        written = block.writes[0].source
        is_param = any(written.same_as(p) for p in params)
        if is_param != (block is epilogue[-1]):
            return f"epilogue block {block.name_hint!r}: only the last block may write an output"
        internal.append(written)
    if not any(internal[-1].same_as(p) for p in params):
        return f"the last block writes {internal[-1].name}, not a function output"
    immediates = {float(c.value) for b in epilogue for c in nodes(b.body, tirx.FloatImm)}
    return len(operands), len(constants) + len(immediates)


def _vector_access(vector_ops, iters, n_spatial, hrow_axis, producers):
    """(vec_stride, hrow_stride, pointwise) of the vector operands' last two indices."""
    spatial_vars = [iv.var for iv in iters[:n_spatial]]
    unit_vars = [iv.var for iv in iters[n_spatial:] if int(iv.dom.extent) == 1]
    extents = [int(iv.dom.extent) for iv in iters[:n_spatial]]
    vec_var = spatial_vars[-1]
    hrow_var = spatial_vars[hrow_axis] if hrow_axis >= 0 else None
    produced = [p.writes[0].source for p in producers]
    strides, pointwise = set(), hrow_var is not None
    for r in vector_ops:
        idx = [rg.min for rg in r.region]
        if _uses(idx[:-1], [vec_var]):
            return 0, 1, False
        coef_w, offset_w = _affine(idx[-1], vec_var, spatial_vars, unit_vars)
        coef_h, offset_h = 1, 0
        if hrow_var is not None:
            if len(idx) < 2 or _uses(idx[:-2], [hrow_var]):
                return coef_w, 1, False
            coef_h, offset_h = _affine(idx[-2], hrow_var, spatial_vars, unit_vars)
        strides.add((coef_w, coef_h))
        # Pointwise: indices (s_h * h, s_w * w) into a buffer of (s_h * H, s_w * W), which the
        # producer's de-interleave turns into (h, w) over (H, W); then rows are contiguous.
        shape = [int(d) for d in r.source.shape[-2:]]
        expected = [extents[hrow_axis] * coef_h, extents[-1] * coef_w] if pointwise else None
        strided = (coef_w, coef_h) != (1, 1)
        if (
            0 in (coef_w, coef_h)
            or (offset_w, offset_h) != (0, 0)
            or shape != expected
            or (strided and not any(r.source.same_as(b) for b in produced))
        ):
            pointwise = False
    if len(strides) != 1:
        return 0, 1, False
    ((coef_w, coef_h),) = strides
    return coef_w, coef_h, pointwise


def _affine(expr, var, spatial_vars, unit_vars) -> tuple[int, int | None]:
    """(coefficient, offset) of ``expr`` = c * var + offset, where the offset may use
    reduction variables (unit-extent ones count as 0); (0, None) when not of that form."""
    coef = tvm.sym.detect_linear_equation(expr, [var, *unit_vars])
    if len(coef) != len(unit_vars) + 2 or not isinstance(coef[0], tirx.IntImm):
        return 0, None
    base = coef[-1]
    if int(coef[0]) < 1 or _uses([base], [v for v in spatial_vars if not v.same_as(var)]):
        return 0, None
    return int(coef[0]), int(base) if isinstance(base, tirx.IntImm) else None


def _kind(block, n_spatial: int, rows_axis: int, vector_ops, bcast_ops) -> str:
    name = block.name_hint.lower()
    if "conv" in name:
        dims = n_spatial - 2
        rows_var = block.iter_vars[rows_axis].var if rows_axis >= 0 else None
        grouped = "group" in name or (
            rows_var is not None and any(reads_any(r.region, [rows_var]) for r in vector_ops)
        )
        if grouped and bcast_ops:
            weight = bcast_ops[0].source
            if len(weight.shape) > 1 and int(weight.shape[1]) == 1:
                return f"depthwise_conv{dims}d"
            return f"group_conv{dims}d"
        return f"conv{dims}d"
    if "matmul" in name or "dense" in name:
        return "batch_matmul" if n_spatial > 2 else "matmul"
    return "reduction"


def _reduce_iters(block) -> list:
    return [iv for iv in block.iter_vars if iv.iter_type == COMM_REDUCE]


def is_identity(region, variables) -> bool:
    return len(region) == len(variables) and all(
        rg.min.same_as(v) and int(rg.extent) == 1 for rg, v in zip(region, variables, strict=True)
    )


def nodes(root, cls) -> list:
    """Every node of type ``cls`` under ``root``."""
    out: list = []
    tvm_ffi.structural_walk(root, (cls, out.append), order="post")
    return out


def _uses(exprs, variables) -> bool:
    """Some of ``exprs`` uses one of ``variables``."""
    return any(v.same_as(w) for e in exprs for v in nodes(e, tirx.Var) for w in variables)


def reads_any(region, variables) -> bool:
    """Some index of a buffer ``region`` uses one of ``variables``."""
    return _uses([rg.min for rg in region], variables)


def axis_extent(anchor: Anchor, axis: int) -> int:
    return anchor.spatial[axis] if axis >= 0 else 1
