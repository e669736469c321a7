"""Register tiles: which tiles a kernel's accumulators may take, how they rank, what they hold live.

A :class:`Tile` is ``rows`` x ``hrows`` x ``vec`` outputs held in vector registers, and a cache
block of ``block_rows`` rows whose weights stay in L2 while the columns sweep.
:func:`candidate_tiles` lists the tiles that fit the chip's vector registers, best first, for the
register-pressure check (``fuse_epilogue.choose_schedule``) to walk down. NCHW tiles are ranked by
a throughput model of one output row (FMA and load ports, FMA latency, the tail a tile leaves,
the balance of parallel chunks over the cores: :func:`_score`); blocked tiles by the same model
per column tile, then the accumulator count nearest 16 (``Knobs.target_accumulators``: fewer
leave the FMA latency exposed). :func:`live_vector_registers` is the static estimate that check
compares with :func:`register_budget`. The numbers behind each knob are at :class:`Knobs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm

from .. import chips, register_pressure
from ..errors import BNFoldError
from .anchor import Anchor, axis_extent


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
class Knobs:
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
    def of(chip: chips.Chip, dtype: str) -> Knobs:
        if chip.kind != "cpu":
            raise BNFoldError(
                f"the default schedules are CPU schedules; chip {chip.name!r} is {chip.kind}")
        cores = int(chip.target_config.get("num-cores", 1))
        budget = register_pressure.static_budget(chip, dtype)
        return Knobs(lanes=chip.lanes(dtype), vector_regs=budget,
                      register_file=chip.vector_regs, cores=cores,
                      target_accumulators=min(16, chip.vector_regs * 3 // 4),
                      unroll_taps=chip.vector_regs >= 32, tail_tiles=chip.vector_regs < 32)


def candidate_tiles(anchor: Anchor, chip: chips.Chip) -> list[Tile]:
    """Register tiles that fit the chip's vector registers: the best first, then progressively
    smaller ones (fewer accumulators), for a register-pressure check to walk down."""
    knobs = Knobs.of(chip, anchor.dtype)
    if anchor.blocked:
        return _blocked_tiles(anchor, knobs)
    rows = axis_extent(anchor, anchor.rows_axis)
    hrows = 1 if anchor.pointwise else axis_extent(anchor, anchor.hrow_axis)
    top = max(1, min(knobs.max_vectors, -(-anchor.width // knobs.lanes)))
    scored = []
    for vec in (k * knobs.lanes for k in range(1, top + 1)):
        for r in (d for d in divisors(rows) if d <= knobs.vector_regs):
            for h in (d for d in divisors(hrows) if d <= knobs.max_hrows):
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
    return [with_block_rows(anchor, t, knobs) for t in out]


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
    :func:`.spaces.design_spaces`, whose tile is sampled)."""
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


def check_tile(anchor: Anchor, tile: Tile, knobs: Knobs) -> None:
    rows = axis_extent(anchor, anchor.rows_axis)
    hrows = 1 if anchor.pointwise else axis_extent(anchor, anchor.hrow_axis)
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


def _odd_tail(width: int, tile: Tile) -> bool:
    """The last vector of a row has a lane count that is not a power of two."""
    partial = width % tile.vec % tile.lanes
    return partial & (partial - 1) != 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _score(anchor: Anchor, tile: Tile, knobs: Knobs) -> float:
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
    chunks = outer_tiles(anchor) * (axis_extent(anchor, anchor.rows_axis) // tile.rows)
    if not anchor.pointwise:
        chunks *= axis_extent(anchor, anchor.hrow_axis) // tile.hrows
    balance = chunks / (knobs.cores * -(-chunks // knobs.cores))
    return ideal / cycles * balance


def _blocked_tiles(anchor: Anchor, knobs: Knobs) -> list[Tile]:
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
        for h in divisors(blocks) if h <= knobs.max_hrows
        for r in (range(1, cols + 1) if tails else divisors(cols))
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


def _blocked_efficiency(anchor: Anchor, tile: Tile, knobs: Knobs) -> float:
    """Modelled fraction of the FMA peak of a blocked tile: FMAs against loads (a broadcast per
    column and a weight vector per block; depthwise: an input vector per output) and latency,
    over the full tiles of a row and its tail tile, times the balance of the parallel chunks
    (a row of column tiles is one chunk when they run serially, see :func:`serial_columns`)."""

    def cycles(columns: int) -> float:
        acc = columns * tile.hrows
        loads = tile.hrows + (acc if not anchor.shared_input else columns)
        return max(acc / knobs.fma_ports, loads / knobs.load_ports, knobs.fma_latency)

    n, blocks, height, cols, _ = anchor.spatial
    full, tail = divmod(cols, tile.rows)
    ideal = cols * tile.hrows / knobs.fma_ports
    efficiency = ideal / (full * cycles(tile.rows) + (cycles(tail) if tail else 0))
    serial = serial_columns(anchor, tile.rows, tile.hrows, knobs)
    chunks = n * blocks // tile.hrows * height * (1 if serial else cols // tile.rows)
    return efficiency * chunks / (knobs.cores * -(-chunks // knobs.cores))


def serial_columns(anchor: Anchor, rows: int | None, hrows: int, knobs: Knobs) -> bool:
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


def outer_tiles(anchor: Anchor) -> int:
    """Product of the spatial extents outside the rows, hrows and vector axes (the batch)."""
    skip = {anchor.vec_axis, anchor.rows_axis, anchor.hrow_axis}
    return math.prod(e for i, e in enumerate(anchor.spatial) if i not in skip)


def with_block_rows(anchor: Anchor, tile: Tile, knobs: Knobs) -> Tile:
    """The tile with the largest cache block of rows whose weights fit ``l2_block_bytes`` while
    leaving at least two parallel chunks per core (when the rows allow it)."""
    if tile.block_rows:
        return tile
    if not anchor.shared_input:  # depthwise: nothing to share across rows; keep planes apart
        return Tile(tile.vec, tile.rows, tile.hrows, tile.lanes, tile.rows)
    rows = axis_extent(anchor, anchor.rows_axis)
    per_row = math.prod(anchor.reduction) * tvm.DataType(anchor.dtype).bits // 8
    other = outer_tiles(anchor) * (
        1 if anchor.pointwise else axis_extent(anchor, anchor.hrow_axis) // tile.hrows
    )
    best = tile.rows
    for m in divisors(rows // tile.rows):
        block = m * tile.rows
        if block * per_row > knobs.l2_block_bytes or other * rows // block < 2 * knobs.cores:
            break
        best = block
    return Tile(tile.vec, tile.rows, tile.hrows, tile.lanes, best)
