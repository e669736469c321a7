"""The NCHW schedule of a conv / matmul / pool kernel, and the GEMV schedule of a single-row matmul.

::

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
vectors. A matmul with one output row (the fc of a batch-1 CNN) splits its reduction across the
cores instead (:func:`is_gemv`: 2.06x / 2.24x on ResNet-50's fc).
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx

from .anchor import Anchor, reads_any
from .injective import SERIAL_ELEMENTS
from .loops import (
    hint_tails,
    index_dtype,
    parallel_vectorized,
    split_lanes,
    vectorize_nest,
)
from .tiles import Knobs, Tile


def schedule_nchw(sch: s_tir.Schedule, anchor: Anchor, epilogue: str, knobs: Knobs,
                  tile: Tile) -> None:
    """The NCHW schedule (the loop nest of the module docstring) of ``anchor`` with ``tile``,
    or the GEMV schedule where :func:`is_gemv`; ``epilogue`` as in :func:`..schedule`."""
    # Step 1. Producers: inline plain copies, de-interleave strided inputs, parallelize the rest.
    for name in anchor.producers:
        _schedule_producer(sch, name, anchor, knobs)
    if is_gemv(anchor, knobs.cores):
        _schedule_gemv(sch, anchor, epilogue, knobs)
        return

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
        flat = _flat_map(anchor, len(anchor.spatial), index_dtype(local))
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
            vectorize_nest(sch, chain[-1], par, tile.lanes, tail)
        elif chain:
            parallel_vectorized(sch, chain[-1], knobs)

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
        vectorize_nest(sch, b, tile_loop, tile.lanes, tail)

    # Step 7. A tail the vector tile does not divide: let LoopPartition split it off, so the
    # full tiles carry no predicate and the tail runs as a narrower vector. Every loop around a
    # predicated vector gets the hint (a partition below an unhinted loop would leave a
    # vector of symbolic length); a tail on the parallel loop stays predicated (scalar).
    if tail and sch.get(middle[0]).kind != tirx.ForKind.PARALLEL:
        hint_tails(sch, anchor)


def _schedule_producer(sch: s_tir.Schedule, name: str, anchor: Anchor, knobs: Knobs) -> None:
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
        if r.source.same_as(buf) and reads_any(r.region, [vec_var])
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
        parallel_vectorized(sch, fill, knobs)
    parallel_vectorized(sch, block_rv, knobs)


def _deinterleave(sch: s_tir.Schedule, copy, s_h: int, s_w: int, knobs: Knobs) -> None:
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

    index_map = tirx.IndexMap.from_func(deinterleave, ndim=rank, index_dtype=index_dtype(buf))
    divisible = shape[-1] % s_w == 0 and (rank < 2 or shape[-2] % s_h == 0)
    sch.transform_layout(copy, ("write", 0), index_map, pad_value=None if divisible else 0.0)
    if divisible:
        sch.transform_block_layout(copy, index_map)
    parallel_vectorized(sch, copy, knobs)


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
    dtype = index_dtype(sch.get(sch.get_sblock(anchor.block)).writes[0].source)
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


def is_gemv(anchor: Anchor, cores: int) -> bool:
    """A matrix-vector product worth splitting across the cores: a matmul with one output row
    and one reduction axis that the cores divide, over at least ``SERIAL_ELEMENTS`` weights.
    Its weights are read once (memory-bound), and a single row gives the column tiles alone
    too few parallel chunks (none when they leave a tail, see step 4 of :func:`schedule_nchw`)."""
    (k,) = anchor.reduction if len(anchor.reduction) == 1 else (0,)
    return (anchor.kind == "matmul" and math.prod(anchor.spatial[:-1]) == 1 and k % cores == 0
            and cores > 1 and k * anchor.width >= SERIAL_ELEMENTS)


def _schedule_gemv(sch: s_tir.Schedule, anchor: Anchor, epilogue: str, knobs: Knobs) -> None:
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
    p_vec = split_lanes(sch, p_spatial[-1], knobs.lanes)
    sch.reorder(p_part, *p_spatial[:-1], p_k, *p_vec)
    sch.parallel(p_part)
    sch.vectorize(p_vec[-1])
    sch.decompose_reduction(partial, p_k)
    # The sum of the partial sums, one vector at a time (the anchor block after rfactor).
    *spatial, part = sch.get_loops(block)
    vec = split_lanes(sch, spatial[-1], knobs.lanes)
    sch.reorder(*spatial[:-1], *vec[:-1], part, vec[-1])
    sch.vectorize(vec[-1])
    sch.decompose_reduction(block, part)
    chain = [sch.get_sblock(name) for name in anchor.epilogue]
    for b in chain[:-1]:
        sch.compute_inline(b)
    if chain and epilogue == "separate":
        parallel_vectorized(sch, chain[-1], knobs, outer=0)
    elif chain:
        sch.reverse_compute_at(chain[-1], vec[0])
        sch.vectorize(sch.get_loops(chain[-1])[-1])
    hint_tails(sch, anchor)  # a tail of the columns
