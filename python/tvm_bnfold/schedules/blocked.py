"""The schedule of a blocked-layout conv (``out[n, o, y, x, oi]``, see :mod:`..blocked_layout`).

The vector is the channel block ``oi``; the register tile is ``rows`` output columns x ``hrows``
channel blocks; the whole reduction runs per tile with the epilogue on it. Parallel over (batch,
block groups, output rows), the column tiles of a row in a serial loop inside each chunk
(:func:`..tiles.serial_columns`: 1.05x / 1.13x on ResNet-50 / MobileNetV2 on avx512). A
depthwise conv, and a dense one whose column tiles are serial, read their zero padding through a
predicate instead of a padded copy (depthwise 2-3x faster; ResNet-50's 3x3 convs 3-12%).
"""

from __future__ import annotations

from tvm import s_tir

from .anchor import Anchor
from .loops import PARTITION_HINT, hint_tails, parallel_vectorized, vectorize_nest
from .tiles import Knobs, Tile, serial_columns


def schedule_blocked(sch: s_tir.Schedule, anchor: Anchor, epilogue: str, knobs: Knobs,
                      tile: Tile | None) -> None:
    """The schedule of a blocked conv: parallel over (batch, block groups, rows), the column
    tiles of a row in a serial loop (see :func:`.tiles.serial_columns`), the whole reduction per
    register tile of ``hrows`` blocks x ``rows`` columns, the epilogue on that tile. ``tile``
    None: its two factors are sampled (a search space)."""
    serial = serial_columns(anchor, tile.rows if tile else None,
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
            parallel_vectorized(sch, sch.get_sblock(name), knobs)

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
            parallel_vectorized(sch, chain[-1], knobs)

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
        vectorize_nest(sch, b, tile_loop, knobs.lanes, 0)
    if tail:
        hint_tails(sch, anchor)
    elif inline_pad and anchor.producers and anchor.shared_input:  # (then serial too)
        # The border column tiles and kernel rows (reduction: channel blocks, kernel rows,
        # kernel columns, channels) apart from the interior. With the columns alone, two of
        # ResNet-50's 3x3 convs left their accumulators in memory (1.7x slower).
        for loop in (cols_out, reduction[1]):
            sch.annotate(loop, PARTITION_HINT, 1)
