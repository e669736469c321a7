"""Default CPU schedule for fused conv/matmul kernels, with the epilogue on the register tile.

After ``LegalizeOps → AnnotateTIROpPattern → FoldConstant → FuseOps → FuseTIR`` a fused kernel
is one PrimFunc: injective producers (``pad_temp``), one reduction *anchor* (``conv2d_nchw``,
``matmul``...) and an elementwise epilogue chain (bias ``T_add``, residual ``T_add``,
``compute`` = relu, ``T_maximum``/``T_minimum`` = clip). Untuned, TVM builds it as naive scalar
loops on one core. ``schedule`` gives it a register-blocked, vectorized, parallel loop nest::

    for blk in parallel(batch x row blocks x output rows):   # rows = output channels
        for x in columns / vec:                              # vector axis: output width
            for r in rows of the block / tile.rows:          # weights of the block stay in L2
                acc[rows][hrows][vec] = 0                    # "local" cache: vector registers
                for rc, ry, rx:                              # reduction (short loops unrolled)
                    acc[:][:][:] += W[r, rc, ry, rx] * in[rc, h + ry, x + rx : ... + vec]
                out[r, h, x : x + vec] = relu(acc + bias[r] + res[r, h, x : x + vec])

Weights are scalar broadcasts, inputs unit-stride vector loads: strided convs get their padded
input de-interleaved (``w -> (w % s, w // s)``), pointwise (1x1) convs have their output rows
flattened into one vector axis (``(h, w) -> h * W + w``) so 14x14 or 7x7 maps still fill whole
vectors. A tail that the vector tile does not divide is split off by TVM's LoopPartition (the
function is narrowed to int32 indices so its partition hints survive) and runs as a narrower
vector.

    anchor = analyze(func)                 # None: not a single-reduction kernel, left alone
    tiles = candidate_tiles(anchor, chips.get("avx512"))
    func = schedule(func, "avx512", tiles[0], epilogue="register")
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from . import blocked_layout, chips, register_pressure
from .errors import BNFoldError

logger = logging.getLogger(__name__)

EPILOGUE_MODES = ("register", "cache", "separate")
_DATA_PAR = 0  # tirx.IterVar.DataPar
_COMM_REDUCE = 2  # tirx.IterVar.CommReduce
_HINT = "pragma_loop_partition_hint"
#: Injective kernels smaller than this run on one thread (a parallel launch costs ~2 us).
_SERIAL_ELEMENTS = 1 << 14
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
        width = _extent(self, self.vec_axis)
        return width * _extent(self, self.hrow_axis) if self.pointwise else width

    @property
    def conv_only(self) -> Anchor:
        """The anchor without its epilogue's registers (operands, constants): what is live in
        the conv's own loops when the epilogue runs after the tile is stored."""
        return dataclasses.replace(self, epilogue_operands=0, epilogue_constants=0)


@dataclass(frozen=True)
class Tile:
    """A register tile of ``rows`` x ``hrows`` x ``vec`` outputs held in vector registers, and the
    cache block of ``block_rows`` rows whose weights stay in L2 while the columns sweep."""

    vec: int  # elements along the vector axis: lanes x vectors
    rows: int  # along rows_axis (output channels)
    hrows: int = 1  # along hrow_axis (output rows)
    lanes: int = 1  # vector lanes of the chip for the anchor's dtype
    block_rows: int = 0  # rows per cache block (a multiple of rows); 0: just the tile

    @property
    def vectors(self) -> int:
        """Vector registers per row of the tile."""
        return -(-self.vec // self.lanes)

    @property
    def accumulators(self) -> int:
        """Vector registers holding the accumulator tile."""
        return self.rows * self.hrows * self.vectors


@dataclass(frozen=True)
class _Knobs:
    """Per-target knobs of the schedule."""

    lanes: int
    vector_regs: int  # the register-pressure check's static budget for a tile
    register_file: int  # vector registers of the chip (a blocked tile's budget)
    cores: int
    max_vectors: int = 4  # vectors per tile row
    max_hrows: int = 4  # more output rows per tile: LLVM hoists their loads and spills
    fma_ports: int = 2
    load_ports: int = 2
    fma_latency: int = 4
    unroll_budget: int = 128  # unrolled reduction steps x accumulators (more: LLVM spills)
    l2_block_bytes: int = 256 * 1024  # weights of one cache block of rows
    max_candidates: int = 8
    target_accumulators: int = 16  # blocked tiles: fewer leave FMA latency exposed
    shapes_per_size: int = 2  # candidates per accumulator count (another shape may not spill)
    # Blocked dense convs: unroll the kernel columns. With 16 registers LLVM then keeps the
    # input broadcasts the columns share live and spills (avx2 2x4 tile: 14 moves, 0 rolled).
    unroll_taps: bool = True
    # Blocked dense convs: column tiles that leave a tail. With 16 registers the tiles that
    # divide ResNet's 56/28/14/7 columns hold 8 accumulators at most (12 = 3 x 4 needs a
    # factor 3); avx2's 3x4 tiles with a tail ran its convs 1.1-1.5x faster than 2x4 alone.
    tail_tiles: bool = False
    # Blocked dense convs: the widest kernel that reads its padding through a predicate (5x5
    # tiles that touch both borders spilled: 9x9 and 16x16 outputs, 32 -> 16 channels).
    inline_pad_taps: int = 3

    @staticmethod
    def of(chip: chips.Chip, dtype: str) -> _Knobs:
        if chip.kind != "cpu":
            raise BNFoldError(f"conv_schedule is a CPU schedule; chip {chip.name!r} is {chip.kind}")
        cores = int(chip.target_config.get("num-cores", 1))
        budget = register_pressure.static_budget(chip, dtype)
        return _Knobs(lanes=chip.lanes(dtype), vector_regs=budget,
                      register_file=chip.vector_regs, cores=cores,
                      target_accumulators=min(16, chip.vector_regs * 3 // 4),
                      unroll_taps=chip.vector_regs >= 32, tail_tiles=chip.vector_regs < 32)


# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------


def analyze(func: tirx.PrimFunc) -> Anchor | None:
    """The reduction anchor of ``func``, or None when it has no single reduction block followed
    only by an elementwise epilogue chain (such functions are left alone)."""
    found = _analyze(func)
    if isinstance(found, str):
        logger.debug("conv_schedule does not apply: %s", found)
        return None
    return found


def _analyze(func: tirx.PrimFunc) -> Anchor | str:
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
        if any(iv.iter_type not in (_DATA_PAR, _COMM_REDUCE) for iv in block.iter_vars):
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
    if n_spatial == 0 or any(iv.iter_type != _DATA_PAR for iv in iters[:n_spatial]):
        return f"{anchor.name_hint!r}: spatial iterators must precede reduction iterators"
    out = anchor.writes[0]
    spatial_vars = [iv.var for iv in iters[:n_spatial]]
    if not _is_identity(out.region, spatial_vars):
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
    vector_ops = [r for r in reads if _reads(r.region, [vec_var])]
    bcast_ops = [r for r in reads if not _reads(r.region, [vec_var])]
    rows_axis = -1
    for i in sorted(range(n_spatial - 1), key=lambda i: -extents[i]):
        if extents[i] > 1 and any(_reads(r.region, [spatial_vars[i]]) for r in bcast_ops):
            rows_axis = i
            break
    hrow_axis = n_spatial - 2
    if (
        hrow_axis < 0
        or hrow_axis == rows_axis
        or not any(_reads(r.region, [spatial_vars[hrow_axis]]) for r in vector_ops)
    ):
        hrow_axis = -1
    shared = rows_axis < 0 or not any(
        _reads(r.region, [spatial_vars[rows_axis]]) for r in vector_ops
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
    weights = [r for r in vector_ops if _reads(r.region, [o]) and not _reads(r.region, [x])]
    inputs = [r for r in (vector_ops if depthwise else bcast_ops) if _reads(r.region, [x])]
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
        if not _is_identity(block.writes[0].region, own):
            return f"epilogue block {block.name_hint!r} does not write elementwise"
        uses_internal = False
        for r in block.reads:
            if any(r.source.same_as(b) for b in internal):
                if not _is_identity(r.region, own):
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
    immediates = {float(c.value) for b in epilogue for c in _nodes(b.body, tirx.FloatImm)}
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
            rows_var is not None and any(_reads(r.region, [rows_var]) for r in vector_ops)
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
    return [iv for iv in block.iter_vars if iv.iter_type == _COMM_REDUCE]


def _is_identity(region, variables) -> bool:
    return len(region) == len(variables) and all(
        rg.min.same_as(v) and int(rg.extent) == 1 for rg, v in zip(region, variables, strict=True)
    )


def _nodes(root, cls) -> list:
    """Every node of type ``cls`` under ``root``."""
    out: list = []
    tvm_ffi.structural_walk(root, (cls, out.append), order="post")
    return out


def _uses(exprs, variables) -> bool:
    """Some of ``exprs`` uses one of ``variables``."""
    return any(v.same_as(w) for e in exprs for v in _nodes(e, tirx.Var) for w in variables)


def _reads(region, variables) -> bool:
    """Some index of a buffer ``region`` uses one of ``variables``."""
    return _uses([rg.min for rg in region], variables)


def _extent(anchor: Anchor, axis: int) -> int:
    return anchor.spatial[axis] if axis >= 0 else 1


# --------------------------------------------------------------------------------------------
# Register tiles
# --------------------------------------------------------------------------------------------


def candidate_tiles(anchor: Anchor, chip: chips.Chip) -> list[Tile]:
    """Register tiles that fit the chip's vector registers: the best first, then progressively
    smaller ones (fewer accumulators), for a register-pressure check to walk down."""
    knobs = _Knobs.of(chip, anchor.dtype)
    if anchor.blocked:
        return _blocked_tiles(anchor, knobs)
    rows = _extent(anchor, anchor.rows_axis)
    hrows = 1 if anchor.pointwise else _extent(anchor, anchor.hrow_axis)
    top = max(1, min(knobs.max_vectors, -(-anchor.width // knobs.lanes)))
    scored = []
    for vec in (k * knobs.lanes for k in range(1, top + 1)):
        for r in (d for d in _divisors(rows) if d <= knobs.vector_regs):
            for h in (d for d in _divisors(hrows) if d <= knobs.max_hrows):
                tile = Tile(vec=vec, rows=r, hrows=h, lanes=knobs.lanes)
                if live_vector_registers(anchor, tile, chip) <= knobs.vector_regs:
                    scored.append((_score(anchor, tile, knobs), tile))
    if not scored:  # a one-vector tile is all there is
        scored = [(0.0, Tile(vec=knobs.lanes, rows=1, hrows=1, lanes=knobs.lanes))]
    best = max(scored, key=lambda st: (round(st[0], 3), st[1].accumulators, st[1].vec))[1]
    out = [best]
    for _, tile in sorted(scored, key=lambda st: (-st[1].accumulators, -st[0], -st[1].vec)):
        same = sum(t.accumulators == tile.accumulators for t in out)
        fits = tile.accumulators <= best.accumulators and same < knobs.shapes_per_size
        if fits and tile not in out and len(out) < knobs.max_candidates:
            out.append(tile)
    return [_with_block_rows(anchor, t, knobs) for t in out]


def live_vector_registers(anchor: Anchor, tile: Tile, chip: chips.Chip,
                          broadcasts_live: bool = False) -> int:
    """Static estimate of the vector registers the fused kernel keeps live: the accumulator
    tile, the epilogue's operands (bias, residual) and constants (0 of relu, 0 and 6 of clip),
    and the temporaries of one reduction step (input vectors or weight broadcasts).

    A blocked conv counts its two phases apart, each with every register it holds (checked
    against the whole register file, see :func:`register_budget`): the reduction (the
    accumulators, the broadcasts of the tile's columns or the weight vectors of its blocks,
    whichever are fewer, as the loop order keeps them, and one streaming operand) and the
    epilogue (the accumulators, its operands and constants, and the value being computed).
    ``broadcasts_live``: the loop order keeps every column's broadcast live (the order of
    :func:`design_spaces`, whose tile is sampled)."""
    del chip  # the tile carries the chip's lanes
    if anchor.blocked:
        # Dense: the fewer of the columns' broadcasts and the blocks' weight vectors, one
        # streaming operand. Depthwise: a weight vector per block (reused across the columns),
        # the input vector streaming through, one spare.
        fewer = tile.rows if broadcasts_live else min(tile.rows, tile.hrows)
        shared = fewer + 1 if anchor.shared_input else tile.hrows + 2
        epilogue = anchor.epilogue_operands + anchor.epilogue_constants + 1
        return tile.accumulators + max(shared, epilogue)
    # Shared inputs: either the step's input vectors stay live while the weight broadcasts
    # stream, or the broadcasts stay live while the inputs stream (LLVM picks the cheaper one).
    # Depthwise: a broadcast per channel row (reused across its vectors), the input, one spare.
    shared = min(tile.rows, tile.hrows * tile.vectors) + 1
    temporaries = shared if anchor.shared_input else tile.rows + 2
    return tile.accumulators + temporaries + anchor.epilogue_operands + anchor.epilogue_constants


def register_budget(anchor: Anchor, chip: chips.Chip) -> int:
    """The budget :func:`live_vector_registers` of ``anchor`` is checked against: a blocked
    conv's estimate counts every register it holds, so the whole vector register file; any
    other tile's leaves ``register_pressure.CPU_RESERVE`` registers free."""
    if anchor.blocked:
        return chip.vector_regs
    return register_pressure.static_budget(chip, anchor.dtype)


def _odd_tail(width: int, tile: Tile) -> bool:
    """The last vector of a row has a lane count that is not a power of two."""
    partial = width % tile.vec % tile.lanes
    return partial & (partial - 1) != 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _score(anchor: Anchor, tile: Tile, knobs: _Knobs) -> float:
    """Estimated fraction of the FMA peak: a throughput model of the reduction steps of one
    output row (full tiles plus the tail), times the balance of the parallel chunks."""

    def step_cycles(vectors: int) -> float:
        acc = tile.rows * tile.hrows * vectors
        inputs = tile.hrows * vectors * (1 if anchor.shared_input else tile.rows)
        if anchor.vec_stride != 1 and not anchor.pointwise:
            inputs *= 1 if anchor.vec_stride > 1 else knobs.lanes  # >1: de-interleaved
        loads = tile.rows + inputs
        return max(acc / knobs.fma_ports, loads / knobs.load_ports, knobs.fma_latency)

    width = anchor.width
    full, tail = divmod(width, tile.vec)
    cycles = full * step_cycles(tile.vectors)
    if tail:  # a non-power-of-two last vector is split by LLVM: count one more vector op
        cycles += step_cycles(-(-tail // knobs.lanes) + _odd_tail(width, tile))
    ideal = tile.rows * tile.hrows * width / (knobs.fma_ports * knobs.lanes)
    chunks = _outer_tiles(anchor) * (_extent(anchor, anchor.rows_axis) // tile.rows)
    if not anchor.pointwise:
        chunks *= _extent(anchor, anchor.hrow_axis) // tile.hrows
    balance = chunks / (knobs.cores * -(-chunks // knobs.cores))
    return ideal / cycles * balance


def _blocked_tiles(anchor: Anchor, knobs: _Knobs) -> list[Tile]:
    """Tiles of a blocked conv: ``rows`` output columns x ``hrows`` channel blocks, one vector
    each; ``rows`` divides the columns, or with ``knobs.tail_tiles`` (dense convs) leaves a
    narrower tail tile. Best first: the highest modelled FMA efficiency, then the accumulator
    count nearest ``knobs.target_accumulators`` (enough independent FMAs to cover the latency,
    measured fastest here), then no tail, then more blocks per broadcast; then every smaller
    tile in that order."""
    cols, blocks = anchor.spatial[3], anchor.spatial[1]
    tails = knobs.tail_tiles and anchor.shared_input
    tiles = [
        Tile(vec=knobs.lanes, rows=r, hrows=h, lanes=knobs.lanes, block_rows=r)
        for h in _divisors(blocks) if h <= knobs.max_hrows
        for r in (range(1, cols + 1) if tails else _divisors(cols))
    ]
    # Tiles whose reduction fits (the register-pressure check decides where the epilogue goes).
    conv_only = anchor.conv_only
    tiles = [t for t in tiles if live_vector_registers(conv_only, t, None) <= knobs.register_file]
    if not tiles:
        return [Tile(vec=knobs.lanes, rows=1, hrows=1, lanes=knobs.lanes, block_rows=1)]

    def key(tile: Tile):
        return (-round(_blocked_efficiency(anchor, tile, knobs), 2),
                abs(tile.accumulators - knobs.target_accumulators), cols % tile.rows > 0,
                -tile.hrows)

    tiles.sort(key=key)
    out = [t for t in tiles if t.accumulators <= tiles[0].accumulators]
    return out[: knobs.max_candidates]


def _blocked_efficiency(anchor: Anchor, tile: Tile, knobs: _Knobs) -> float:
    """Modelled fraction of the FMA peak of a blocked tile: FMAs against loads (a broadcast per
    column and a weight vector per block; depthwise: an input vector per output) and latency,
    over the full tiles of a row and its tail tile, times the balance of the parallel chunks
    (a row of column tiles is one chunk when they run serially, see :func:`_serial_columns`)."""

    def cycles(columns: int) -> float:
        acc = columns * tile.hrows
        loads = tile.hrows + (acc if not anchor.shared_input else columns)
        return max(acc / knobs.fma_ports, loads / knobs.load_ports, knobs.fma_latency)

    n, blocks, height, cols, _ = anchor.spatial
    full, tail = divmod(cols, tile.rows)
    ideal = cols * tile.hrows / knobs.fma_ports
    efficiency = ideal / (full * cycles(tile.rows) + (cycles(tail) if tail else 0))
    serial = _serial_columns(anchor, tile.rows, tile.hrows, knobs)
    chunks = n * blocks // tile.hrows * height * (1 if serial else cols // tile.rows)
    return efficiency * chunks / (knobs.cores * -(-chunks // knobs.cores))


def _serial_columns(anchor: Anchor, rows: int | None, hrows: int, knobs: _Knobs) -> bool:
    """A blocked conv's column tiles (``rows`` columns each; None: sampled, dividing the
    columns) run in a serial loop inside each parallel chunk of (batch, block group, output
    row): always when they leave a tail tile (LoopPartition splits that loop), else unless
    those chunks are fewer than two per core (then the column tiles are parallel chunks too).
    Side by side in the model (outputs bit-identical), serial column tiles ran ResNet-50 /
    MobileNetV2 1.05x / 1.13x faster on avx512 and 1.03x / 1.23x on avx2, up to 1.19x on a
    56x56 1x1 conv alone: one chunk sweeps a row of column tiles with its blocks' weights in
    L1."""
    n, blocks, height, cols, _ = anchor.spatial
    if rows is not None and cols % rows:
        return True
    return n * (blocks // hrows) * height >= 2 * knobs.cores


def _outer_tiles(anchor: Anchor) -> int:
    """Product of the spatial extents outside the rows, hrows and vector axes (the batch)."""
    skip = {anchor.vec_axis, anchor.rows_axis, anchor.hrow_axis}
    return math.prod(e for i, e in enumerate(anchor.spatial) if i not in skip)


def _with_block_rows(anchor: Anchor, tile: Tile, knobs: _Knobs) -> Tile:
    """The tile with the largest cache block of rows whose weights fit ``l2_block_bytes`` while
    leaving at least two parallel chunks per core (when the rows allow it)."""
    if tile.block_rows:
        return tile
    if not anchor.shared_input:  # depthwise: nothing to share across rows; keep planes apart
        return Tile(tile.vec, tile.rows, tile.hrows, tile.lanes, tile.rows)
    rows = _extent(anchor, anchor.rows_axis)
    per_row = math.prod(anchor.reduction) * tvm.DataType(anchor.dtype).bits // 8
    other = _outer_tiles(anchor) * (
        1 if anchor.pointwise else _extent(anchor, anchor.hrow_axis) // tile.hrows
    )
    best = tile.rows
    for m in _divisors(rows // tile.rows):
        block = m * tile.rows
        if block * per_row > knobs.l2_block_bytes or other * rows // block < 2 * knobs.cores:
            break
        best = block
    return Tile(tile.vec, tile.rows, tile.hrows, tile.lanes, best)


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------


def schedule(
    func: tirx.PrimFunc, chip: chips.Chip, tile: Tile | None = None, epilogue: str = "register"
) -> tirx.PrimFunc:
    """``func`` with a register-tiled, vectorized, parallel CPU schedule (``tirx.is_scheduled``).

    ``epilogue``: ``"register"`` applies the epilogue chain to the register tile before the
    single write of the output; ``"cache"`` stores the register tile and runs the epilogue per
    cache block of rows; ``"separate"`` runs it as its own loop nest after the whole anchor.
    Raises BNFoldError when ``func`` has no anchor (see ``analyze``) or ``tile`` does not fit.
    """
    if epilogue not in EPILOGUE_MODES:
        raise BNFoldError(f"unknown epilogue mode {epilogue!r}; one of {', '.join(EPILOGUE_MODES)}")
    anchor = _analyze(func)
    if isinstance(anchor, str):
        raise BNFoldError(f"conv_schedule cannot schedule this PrimFunc: {anchor}")
    knobs = _Knobs.of(chip, anchor.dtype)
    tile = _with_block_rows(anchor, tile or candidate_tiles(anchor, chip)[0], knobs)
    _check_tile(anchor, tile, knobs)
    if anchor.blocked:
        sch = s_tir.Schedule(_narrow(func))  # int32 indices: LoopPartition splits a tail tile
        _schedule_blocked(sch, anchor, epilogue, knobs, tile)
        return sch.mod["main"].with_attr(SCHEDULED_ATTR, True)
    sch = s_tir.Schedule(_narrow(func))

    # Step 1. Producers: inline plain copies, de-interleave strided inputs, parallelize the rest.
    for name in anchor.producers:
        _schedule_producer(sch, name, anchor, knobs)
    if is_gemv(anchor, knobs.cores):
        _schedule_gemv(sch, anchor, epilogue, knobs)
        return sch.mod["main"].with_attr(SCHEDULED_ATTR, True)

    # Step 2. Pointwise: flatten the output rows (h, w) -> h * W + w into one vector axis.
    if anchor.pointwise:
        _flatten_rows(sch, anchor)
    n_spatial = len(anchor.spatial) - anchor.pointwise
    vec_axis, hrow_axis = n_spatial - 1, -1 if anchor.pointwise else anchor.hrow_axis

    # Step 3. Tile: parallel blocks, columns, rows within the block, reduction, register tile.
    block = sch.get_sblock(anchor.block)
    # A flattened function output gets its local cache (the register tile) before the tiling:
    # cached after it, the cache would span the tiles' relaxed region, rows past the last, and
    # its write-back would store them beyond the output (a race between parallel chunks).
    flat_output = anchor.pointwise and not anchor.epilogue
    if flat_output:
        writeback = sch.cache_write(block, 0, "local")
        local = sch.get(block).writes[0].source
        flat = _flat_map(anchor, len(anchor.spatial), _index_dtype(local))
        sch.transform_layout(block, ("write", 0), flat)
        sch.transform_block_layout(writeback, flat)
    loops = sch.get_loops(block)
    spatial, reduction = loops[:n_spatial], loops[n_spatial:]
    outer, inner = [], []
    rows_in_block = vec_outer = vec_parts = None
    for axis, loop in enumerate(spatial):
        if axis == anchor.rows_axis:
            r_blk, r_in, r_tile = sch.split(loop, [None, tile.block_rows // tile.rows, tile.rows])
            outer.append(r_blk)
            rows_in_block = r_in
            inner.append(r_tile)
        elif axis == hrow_axis:
            h_out, h_tile = sch.split(loop, [None, tile.hrows])
            outer.append(h_out)
            inner.insert(0, h_tile)
        elif axis == vec_axis:
            vec_outer, *vec_parts = sch.split(loop, [None, tile.vec // tile.lanes, tile.lanes])
        else:
            outer.insert(0, loop)
    middle = [vec_outer] + ([rows_in_block] if rows_in_block is not None else [])
    sch.reorder(*outer, *middle, *reduction, *inner, *vec_parts)

    # Step 4. Parallel chunks over the cores; the columns join them when rows are too few.
    tail = anchor.width % tile.vec
    chunks = math.prod(int(sch.get(lp).extent) for lp in outer)
    if not outer or (chunks < 2 * knobs.cores and not tail):
        outer.append(vec_outer)
        middle.pop(0)
    par = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    middle = middle or [par]
    sch.parallel(par)
    tile_loop = middle[-1]

    # Step 5. Accumulate in a local cache (the register tile) and place the epilogue chain.
    if not flat_output:
        writeback = sch.cache_write(block, 0, "local")
    chain = [sch.get_sblock(name) for name in anchor.epilogue]
    if epilogue == "register" and chain:
        sch.compute_inline(writeback)  # the first epilogue block reads the register tile
        for b in chain[:-1]:
            sch.compute_inline(b)
        sch.reverse_compute_at(chain[-1], tile_loop)
        on_tile = [chain[-1]]
    else:
        sch.reverse_compute_at(writeback, tile_loop)
        on_tile = [writeback]
        for b in chain[:-1]:
            sch.compute_inline(b)
        if chain and epilogue == "cache":
            sch.reverse_compute_at(chain[-1], par)
            _vectorize_nest(sch, chain[-1], par, tile.lanes, tail)
        elif chain:
            _parallel_vectorized(sch, chain[-1], knobs)

    # Step 6. Unroll the register tile and the short reduction loops, vectorize the lanes.
    for loop in [*inner, vec_parts[0]]:
        sch.unroll(loop)
    sch.vectorize(vec_parts[1])
    # Unrolled kernel rows would let LLVM keep the input rows that several output rows share
    # (h + ry) live across steps: with hrows > 1 only the innermost tap loop is unrolled.
    steps = tile.accumulators
    for loop in list(reversed(reduction[1:]))[: 1 if tile.hrows > 1 else None]:
        steps *= int(sch.get(loop).extent)
        if steps > knobs.unroll_budget:
            break
        sch.unroll(loop)
    init = sch.decompose_reduction(block, reduction[0])
    for b in (init, *on_tile):
        _vectorize_nest(sch, b, tile_loop, tile.lanes, tail)

    # Step 7. A tail the vector tile does not divide: let LoopPartition split it off, so the
    # full tiles carry no predicate and the tail runs as a narrower vector. Every loop around a
    # predicated vector gets the hint (a partition below an unhinted loop would leave a
    # vector of symbolic length); a tail on the parallel loop stays predicated (scalar).
    if tail and sch.get(middle[0]).kind != tirx.ForKind.PARALLEL:
        _hint_tails(sch, anchor)
    return sch.mod["main"].with_attr(SCHEDULED_ATTR, True)


def _hint_tails(sch: s_tir.Schedule, anchor: Anchor) -> None:
    """Give every serial loop of the anchor and its epilogue the LoopPartition hint, so that a
    tail the vectors or tiles do not divide is split off (see step 7 of :func:`schedule`)."""
    for b in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(b).name_hint not in anchor.producers:
            for loop in sch.get_loops(b):
                if sch.get(loop).kind != tirx.ForKind.PARALLEL:
                    sch.annotate(loop, _HINT, 1)


def is_gemv(anchor: Anchor, cores: int) -> bool:
    """A matrix-vector product worth splitting across the cores: a matmul with one output row
    and one reduction axis that the cores divide, over at least ``_SERIAL_ELEMENTS`` weights.
    Its weights are read once (memory-bound), and a single row gives the column tiles alone
    too few parallel chunks (none when they leave a tail, see step 4 of :func:`schedule`)."""
    (k,) = anchor.reduction if len(anchor.reduction) == 1 else (0,)
    return (anchor.kind == "matmul" and math.prod(anchor.spatial[:-1]) == 1 and k % cores == 0
            and cores > 1 and k * anchor.width >= _SERIAL_ELEMENTS)


def _schedule_gemv(sch: s_tir.Schedule, anchor: Anchor, epilogue: str, knobs: _Knobs) -> None:
    """The schedule of a GEMV (:func:`is_gemv`): the reduction split into one contiguous slab
    of weight rows per core (``rfactor``), each core accumulating all the columns in vectors
    of partial sums while it streams its slab in order; then the partial sums added up per
    vector, the epilogue on that vector (``"register"``, ``"cache"``) or in a loop nest of
    its own (``"separate"``). Side by side on ResNet-50's 2048x1000 fc with its weights out of
    cache (2 cores), 2.06x (avx512) / 2.24x (avx2) faster than the column tiles on one core
    it replaces."""
    block = sch.get_sblock(anchor.block)
    *_, k = sch.get_loops(block)
    part = sch.split(k, [knobs.cores, None])[0]
    partial = sch.rfactor(part, 0)
    *p_spatial, p_part, p_k = sch.get_loops(partial)
    p_vec = _split_lanes(sch, p_spatial[-1], knobs.lanes)
    sch.reorder(p_part, *p_spatial[:-1], p_k, *p_vec)
    sch.parallel(p_part)
    sch.vectorize(p_vec[-1])
    sch.decompose_reduction(partial, p_k)
    # The sum of the partial sums, one vector at a time (the anchor block after rfactor).
    *spatial, part = sch.get_loops(block)
    vec = _split_lanes(sch, spatial[-1], knobs.lanes)
    sch.reorder(*spatial[:-1], *vec[:-1], part, vec[-1])
    sch.vectorize(vec[-1])
    sch.decompose_reduction(block, part)
    chain = [sch.get_sblock(name) for name in anchor.epilogue]
    for b in chain[:-1]:
        sch.compute_inline(b)
    if chain and epilogue == "separate":
        _parallel_vectorized(sch, chain[-1], knobs, outer=0)
    elif chain:
        sch.reverse_compute_at(chain[-1], vec[0])
        sch.vectorize(sch.get_loops(chain[-1])[-1])
    _hint_tails(sch, anchor)  # a tail of the columns


def _split_lanes(sch: s_tir.Schedule, loop, lanes: int) -> list:
    """``loop`` split into vectors of ``lanes`` (the last one a tail when they do not divide
    it), or ``[loop]`` when it is no longer than a vector."""
    return [loop] if int(sch.get(loop).extent) <= lanes else sch.split(loop, [None, lanes])


def design_spaces(sch: s_tir.Schedule, chip: chips.Chip) -> list[s_tir.Schedule] | None:
    """MetaSchedule design spaces of a blocked conv kernel (``ms.space_generator.ScheduleFn``):
    our schedule with the register tile sampled (``sample_perfect_tile`` of the columns and of
    the channel blocks, which MetaSchedule's tile-size mutator explores), one space per
    epilogue level (on the register tile, on the stored tile); and one fixed schedule per
    candidate tile with a tail (which a perfect tile cannot sample) and level. None for any
    other kernel."""
    anchor = _analyze(sch.mod["main"])
    if isinstance(anchor, str) or not anchor.blocked:
        return None
    knobs = _Knobs.of(chip, anchor.dtype)
    tails = [t for t in candidate_tiles(anchor, chip) if anchor.spatial[3] % t.rows]
    spaces = []
    for level in ("register", "cache") if anchor.epilogue else ("register",):
        for tile in (None, *tails):
            space = sch.copy()
            _schedule_blocked(space, anchor, level, knobs, tile)
            spaces.append(space)
    return spaces


def sampled_tile(sch: s_tir.Schedule, anchor: Anchor, chip: chips.Chip) -> Tile | None:
    """The register tile a schedule of :func:`design_spaces` sampled (its two tile-size
    decisions: channel blocks, then columns); None for a schedule of another space."""
    if not anchor.blocked:
        return None
    trace = sch.trace
    sampled = [trace.decisions[i] for i in trace.insts if i.kind.name == "SamplePerfectTile"]
    if len(sampled) != 2:
        return None
    lanes = chip.lanes(anchor.dtype)
    (_, hrows), (_, rows) = ([int(f) for f in d] for d in sampled)
    return Tile(vec=lanes, rows=rows, hrows=hrows, lanes=lanes, block_rows=rows)


def _schedule_blocked(sch: s_tir.Schedule, anchor: Anchor, epilogue: str, knobs: _Knobs,
                      tile: Tile | None) -> None:
    """The schedule of a blocked conv: parallel over (batch, block groups, rows), the column
    tiles of a row in a serial loop (see :func:`_serial_columns`), the whole reduction per
    register tile of ``hrows`` blocks x ``rows`` columns, the epilogue on that tile. ``tile``
    None: its two factors are sampled (a search space)."""
    serial = _serial_columns(anchor, tile.rows if tile else None,
                             tile.hrows if tile else knobs.max_hrows, knobs)
    tail = tile is not None and anchor.spatial[3] % tile.rows > 0
    # The kernel columns unrolled, except around a channel loop shorter than a vector (a
    # stem's 3 channels, which LLVM unrolls itself: both unrolled spilled 26-132 moves).
    taps_unrolled = anchor.reduction[-1] >= knobs.lanes and knobs.unroll_taps
    # Step 1. Producers. A conv reads its zero padding through a predicate (the pad inlined)
    # instead of a padded copy: a depthwise conv always (memory-bound: 2-3x faster), a dense
    # one where its column tiles run in a serial loop, which LoopPartition splits into the
    # border tiles and the interior ones that carry no predicate, and its kernel columns are
    # unrolled, at most ``inline_pad_taps`` of them (ResNet-50's 3x3 convs alone: 3-12% faster
    # on avx512). Other convs keep the copy, filled in parallel vectors (decompose_padding
    # measured no faster, and its trace does not print in TVM 0.27, which MetaSchedule needs):
    # the stem (inlined: 9% slower), 5x5 kernels (their border tiles spilled), a conv with a
    # tail tile (its LoopPartition hints on the unrolled loops would split them at the border
    # too, into loops of symbolic length that cannot be unrolled).
    inline_pad = not anchor.shared_input or (
        serial and not tail and taps_unrolled and anchor.reduction[2] <= knobs.inline_pad_taps)
    for name in anchor.producers:
        if inline_pad:
            sch.compute_inline(sch.get_sblock(name))
        else:
            _parallel_vectorized(sch, sch.get_sblock(name), knobs)

    # Step 2. Tile: block groups outermost, so each core keeps its blocks' weights in cache.
    block = sch.get_sblock(anchor.block)
    n, blocks, height, cols, lanes, *reduction = sch.get_loops(block)
    if tile is None:
        hrows = sch.sample_perfect_tile(blocks, n=2, max_innermost_factor=knobs.max_hrows)
        rows = sch.sample_perfect_tile(cols, n=2, max_innermost_factor=knobs.vector_regs)
    else:
        hrows, rows = [None, tile.hrows], [None, tile.rows]
    blocks_out, blocks_in = sch.split(blocks, hrows)
    cols_out, cols_in = sch.split(cols, rows)
    # The fewer of the tile's broadcasts (columns) and weight vectors (blocks) stay live across
    # the inner loop: that one goes innermost (what live_vector_registers counts).
    inner = [blocks_in, cols_in]
    if tile is not None and tile.rows > tile.hrows:
        inner.reverse()
    sch.reorder(n, blocks_out, height, cols_out, *reduction, *inner, lanes)
    # The column tiles of a row run in a serial loop inside each parallel chunk. A tail tile
    # needs that loop: LoopPartition splits it into the full tiles and the tail (every loop
    # around the predicated tile gets the hint).
    par = sch.fuse(n, blocks_out, height, *([] if serial else [cols_out]))
    sch.parallel(par)
    tile_loop = cols_out if serial else par

    # Step 3. Accumulate in the register tile; place the epilogue chain.
    writeback = sch.cache_write(block, 0, "local")
    chain = [sch.get_sblock(name) for name in anchor.epilogue]
    if epilogue == "register" and chain:
        sch.compute_inline(writeback)
        for b in chain[:-1]:
            sch.compute_inline(b)
        sch.reverse_compute_at(chain[-1], tile_loop, preserve_unit_loops=True)
        on_tile = [chain[-1]]
    else:
        sch.reverse_compute_at(writeback, tile_loop, preserve_unit_loops=True)
        on_tile = [writeback]
        for b in chain[:-1]:
            sch.compute_inline(b)
        if chain and epilogue == "cache":  # after the tile is stored, still in L1
            sch.reverse_compute_at(chain[-1], tile_loop, preserve_unit_loops=True)
            on_tile.append(chain[-1])
        elif chain:
            _parallel_vectorized(sch, chain[-1], knobs)

    # Step 4. Unroll the tile and the kernel columns, vectorize the channel block.
    sch.unroll(blocks_in)
    sch.unroll(cols_in)
    sch.vectorize(lanes)
    if not anchor.shared_input:
        sch.unroll(reduction[-1])
    elif taps_unrolled:
        sch.unroll(reduction[-2])
    init = sch.decompose_reduction(block, reduction[0])
    for b in (init, *on_tile):
        _vectorize_nest(sch, b, tile_loop, knobs.lanes, 0)
    if tail:
        _hint_tails(sch, anchor)
    elif inline_pad and anchor.producers and anchor.shared_input:  # (then serial too)
        # The border column tiles and kernel rows (reduction: channel blocks, kernel rows,
        # kernel columns, channels) apart from the interior. With the columns alone, two of
        # ResNet-50's 3x3 convs left their accumulators in memory (1.7x slower).
        for loop in (cols_out, reduction[1]):
            sch.annotate(loop, _HINT, 1)


def _check_tile(anchor: Anchor, tile: Tile, knobs: _Knobs) -> None:
    rows = _extent(anchor, anchor.rows_axis)
    hrows = 1 if anchor.pointwise else _extent(anchor, anchor.hrow_axis)
    problems = []
    if tile.lanes != knobs.lanes or tile.vec % tile.lanes or tile.vec < 1:
        problems.append(f"vec must be a multiple of the chip's {knobs.lanes} lanes")
    if anchor.blocked and not 1 <= tile.rows <= rows:  # a tail tile is split off
        problems.append(f"rows must be 1..{rows}")
    elif not anchor.blocked and (
        rows % tile.rows or tile.block_rows % tile.rows or rows % tile.block_rows
    ):
        problems.append(f"rows and block_rows must divide {rows}")
    if hrows % tile.hrows:
        problems.append(f"hrows must divide {hrows}")
    if problems:
        raise BNFoldError(f"tile {tile} does not fit {anchor.block!r}: {'; '.join(problems)}")


def _narrow(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with int32 indices when its buffers allow: LoopPartition finds its hints only on
    int32 loops (NarrowDataType renames int64 loop variables and loses the hint)."""
    sizes = [math.prod(int(d) for d in p.ty.shape) for p in func.params if hasattr(p.ty, "shape")]
    if max(sizes, default=0) >= 2**31 - 1:
        return func
    mod = tirx.transform.ForceNarrowIndexToInt32()(tvm.IRModule({"main": func}))
    return mod["main"]


def _schedule_producer(sch: s_tir.Schedule, name: str, anchor: Anchor, knobs: _Knobs) -> None:
    """Inline a plain copy; give a strided vector operand a de-interleaved copy; split a pad
    into a zero fill and an unconditional (vectorized) copy of the interior."""
    block_rv = sch.get_sblock(name)
    buf = sch.get(block_rv).writes[0].source
    anchor_rv = sch.get_sblock(anchor.block)
    anchor_block = sch.get(anchor_rv)
    vec_var = anchor_block.iter_vars[anchor.vec_axis].var
    reads = [
        i
        for i, r in enumerate(anchor_block.reads)
        if r.source.same_as(buf) and _reads(r.region, [vec_var])
    ]
    s_h = anchor.hrow_stride if anchor.hrow_axis >= 0 and len(buf.shape) >= 2 else 1
    s_w = anchor.vec_stride
    # A pool (no broadcast operand) reuses nothing: where its vectors are unit-stride (the
    # channel block of a blocked layout) and not padded it reads the pad through a predicate,
    # no copies (ResNet-50's blocked max pool: 374 -> 88 us); otherwise it keeps the copies (a
    # predicate in its vectors leaves LoopPartition symbolic vector lengths).
    lanes_padded = any(int(r.source.shape[-1]) != int(buf.shape[-1])
                       for r in sch.get(block_rv).reads)
    inline_pad = anchor.rows_axis < 0 and s_w == 1 and not lanes_padded
    if reads and max(s_h, s_w) > 1 and min(s_h, s_w) >= 1 and not inline_pad:
        copy = sch.cache_read(anchor_rv, reads[0], "global")
        _deinterleave(sch, copy, s_h, s_w, knobs)
    if _is_copy(sch.get(block_rv)) or inline_pad:
        sch.compute_inline(block_rv)
        return
    loops = sch.get_loops(block_rv)
    if sch.can_decompose_padding(block_rv, loops[0]):
        fill = sch.decompose_padding(block_rv, loops[0])
        _parallel_vectorized(sch, fill, knobs)
    _parallel_vectorized(sch, block_rv, knobs)


def _deinterleave(sch: s_tir.Schedule, copy, s_h: int, s_w: int, knobs: _Knobs) -> None:
    """Lay the copy out as ``(..., h % s_h, w % s_w, h // s_h, w // s_w)`` so that a strided
    conv reads unit-stride rows, and iterate the copy in that layout (contiguous stores)."""
    buf = sch.get(copy).writes[0].source
    shape = [int(d) for d in buf.shape]
    rank = len(shape)

    def deinterleave(*i):
        h, w = (i[-2], i[-1]) if rank >= 2 else (None, i[-1])
        phases = ([h % s_h] if s_h > 1 else []) + [w % s_w]
        rows = ([h // s_h] if s_h > 1 else [h]) if h is not None else []
        return (*i[: rank - len(rows) - 1], *phases, *rows, w // s_w)

    index_map = tirx.IndexMap.from_func(deinterleave, ndim=rank, index_dtype=_index_dtype(buf))
    divisible = shape[-1] % s_w == 0 and (rank < 2 or shape[-2] % s_h == 0)
    sch.transform_layout(copy, ("write", 0), index_map, pad_value=None if divisible else 0.0)
    if divisible:
        sch.transform_block_layout(copy, index_map)
    _parallel_vectorized(sch, copy, knobs)


def schedule_injective(func: tirx.PrimFunc, chip: chips.Chip) -> tirx.PrimFunc | None:
    """A kernel of injective blocks only (a layout transform, a standalone elementwise op):
    everything inlined into the last block, its outer loops parallel, the second-innermost
    unrolled in short steps and the innermost vectorized. None for any other kernel."""
    if func.attrs is not None and SCHEDULED_ATTR in func.attrs:
        return None
    sch = s_tir.Schedule(_narrow(func))
    try:
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except (RuntimeError, ValueError):
        return None
    if not blocks or any(iv.iter_type != _DATA_PAR for b in blocks for iv in sch.get(b).iter_vars):
        return None
    try:
        for block_rv in blocks[:-1]:
            sch.compute_inline(block_rv)
    except s_tir.schedule.ScheduleError:
        return None
    knobs = _Knobs.of(chip, str(sch.get(blocks[-1]).writes[0].source.dtype))
    # A layout transform iterates its input's index space. Iterate the blocked side (the
    # buffer whose innermost axis is a channel block of at most one vector): its vectors are
    # contiguous, the other side gathers or scatters (measured 2-4x faster than the reverse).
    last = sch.get(blocks[-1])
    own = [iv.var for iv in last.iter_vars]
    out = last.writes[0].source
    short = len(out.shape) > 0 and int(out.shape[-1]) <= knobs.lanes
    if short and not _is_identity(last.writes[0].region, own):
        indices = [rg.min for rg in last.writes[0].region]
        with contextlib.suppress(s_tir.schedule.ScheduleError):
            sch.transform_block_layout(blocks[-1], tirx.IndexMap(own, indices, None))
    loops = sch.get_loops(blocks[-1])
    if not loops:  # a scalar: nothing to parallelize
        return None
    if len(loops) > 2 and int(sch.get(loops[-2]).extent) > 1:
        step = max(d for d in _divisors(int(sch.get(loops[-2]).extent)) if d <= 16)
        _, inner = sch.split(loops[-2], [None, step])
        sch.unroll(inner)
    small = math.prod(int(d) for d in out.shape) < _SERIAL_ELEMENTS  # not worth a thread
    _parallel_vectorized(sch, blocks[-1], knobs, outer=0 if small else len(loops) - 2)
    return sch.mod["main"].with_attr(SCHEDULED_ATTR, True)


def _parallel_vectorized(sch: s_tir.Schedule, block_rv, knobs: _Knobs,
                         outer: int | None = None) -> None:
    """A root injective nest: outer loops fused and parallel (the first ``outer`` of them, else
    all but the innermost), the innermost vectorized (split into vectors of lanes; a tail is
    left to LoopPartition)."""
    loops = sch.get_loops(block_rv)
    outer = len(loops) - 1 if outer is None else outer
    if outer > 1:
        sch.parallel(sch.fuse(*loops[:outer]))
    elif outer == 1:
        sch.parallel(loops[0])
    last = loops[-1]
    extent = int(sch.get(last).extent)
    if extent == 1:
        return
    if extent <= knobs.lanes:
        sch.vectorize(last)
    elif extent % knobs.lanes == 0:
        sch.vectorize(sch.split(last, [None, knobs.lanes])[1])
    else:
        outer, lane = sch.split(last, [None, knobs.lanes])
        sch.vectorize(lane)
        sch.annotate(outer, _HINT, 1)
        sch.annotate(lane, _HINT, 1)


def _is_copy(block) -> bool:
    """The block is ``B[i...] = A[i...]`` with equal shapes (a pad of zero width)."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tvm.ir.TensorLoad):
        return False
    load = store.value
    same_shape = [int(a) for a in load.source.shape] == [int(b) for b in store.buffer.shape]
    return same_shape and all(
        a.same_as(b) for a, b in zip(load.indices, store.indices, strict=True)
    )


def _flatten_rows(sch: s_tir.Schedule, anchor: Anchor) -> None:
    """Rewrite the anchor, the epilogue blocks and the intermediates between them from
    ``(..., h, w)`` to ``(..., h * W + w)``: buffer regions of a register tile that spans row
    ends then stay exact (a tile of a (h, w) box would make ``reverse_compute_at`` cover, and
    write, the whole box)."""
    final = anchor.epilogue[-1] if anchor.epilogue else anchor.block
    dtype = _index_dtype(sch.get(sch.get_sblock(anchor.block)).writes[0].source)
    for name in (anchor.block, *anchor.epilogue):
        if name != final:
            sch.transform_layout(name, ("write", 0), _flat_map(anchor, len(anchor.spatial), dtype))
    for name in (anchor.block, *anchor.epilogue):
        n_iters = len(sch.get(sch.get_sblock(name)).iter_vars)
        sch.transform_block_layout(name, _flat_map(anchor, n_iters, dtype))


def _flat_map(anchor: Anchor, ndim: int, dtype: str) -> tirx.IndexMap:
    """``(..., h, w, rest...) -> (..., h * W + w, rest...)`` over ``ndim`` indices."""
    width, h = anchor.spatial[anchor.vec_axis], len(anchor.spatial) - 2

    def index_map(*i):
        return (*i[:h], i[h] * width + i[h + 1], *i[h + 2 :])

    return tirx.IndexMap.from_func(index_map, ndim=ndim, index_dtype=dtype)


def _index_dtype(buf) -> str:
    """The index dtype of a buffer's shape (int32 after ``_narrow``)."""
    return str(buf.shape[0].ty) if len(buf.shape) else "int64"


def _vectorize_nest(sch: s_tir.Schedule, block_rv, above, lanes: int, tail: int) -> None:
    """Below loop ``above``: split the innermost loop of ``block_rv`` into vectors of lanes,
    vectorize the lanes and unroll the rest of the nest."""
    loops = sch.get_loops(block_rv)
    above_stmt = sch.get(above)
    start = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(above_stmt)) + 1
    nest = loops[start:]
    if not nest:
        return
    last = nest[-1]
    extent = int(sch.get(last).extent)
    if sch.get(last).kind != tirx.ForKind.SERIAL or extent == 1:
        return
    lanes = lanes if extent % lanes == 0 or tail else math.gcd(extent, lanes)
    *vectors, lane = sch.split(last, [None, lanes]) if extent > lanes else [last]
    unrolled = nest[:-1] + vectors
    for loop in unrolled:
        if int(sch.get(loop).extent) <= 64:
            sch.unroll(loop)
    sch.vectorize(lane)
