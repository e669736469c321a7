"""Default CPU schedules for fused kernels, with the epilogue on the register tile.

Untuned, TVM builds a fused conv/matmul kernel as naive scalar loops on one core. :func:`schedule`
gives it a register-blocked, vectorized, parallel loop nest, the epilogue chain (bias, residual,
activation) applied to the accumulators before the single write of the output. The package holds
one idea per module:

- :mod:`.anchor`: what the kernel is (its reduction, producers, epilogue, the roles of its axes);
- :mod:`.tiles`: which register tiles fit the chip, how they rank, what they keep live;
- :mod:`.nchw`: the NCHW schedule (and the GEMV of a single-row matmul);
- :mod:`.blocked`: the schedule of a blocked-layout conv;
- :mod:`.injective`: layout transforms and standalone elementwise kernels;
- :mod:`.spaces`: MetaSchedule design spaces of blocked convs (tuning);
- :mod:`.loops`: the loop-nest steps they share.

::

    anchor = analyze(func)                 # None: not a single-reduction kernel, left alone
    tiles = candidate_tiles(anchor, chips.get("avx512"))
    func = schedule(func, chips.get("avx512"), tiles[0], epilogue="register")
"""

from __future__ import annotations

from tvm import s_tir, tirx

from .. import chips
from ..errors import BNFoldError
from .anchor import SCHEDULED_ATTR, Anchor, analyze, anchor_or_reason
from .blocked import schedule_blocked
from .injective import schedule_injective
from .loops import narrow
from .nchw import is_gemv, schedule_nchw
from .spaces import design_spaces, sampled_tile
from .tiles import (
    Knobs,
    Tile,
    candidate_tiles,
    check_tile,
    live_vector_registers,
    register_budget,
    with_block_rows,
)

__all__ = [
    "EPILOGUE_MODES", "SCHEDULED_ATTR", "Anchor", "Tile", "analyze", "candidate_tiles",
    "design_spaces", "is_gemv", "live_vector_registers", "register_budget", "sampled_tile",
    "schedule", "schedule_injective",
]

#: Where the epilogue chain runs: on the register tile, per stored cache tile, or after the kernel.
EPILOGUE_MODES = ("register", "cache", "separate")


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
    anchor = anchor_or_reason(func)
    if isinstance(anchor, str):
        raise BNFoldError(f"schedules cannot schedule this PrimFunc: {anchor}")
    knobs = Knobs.of(chip, anchor.dtype)
    tile = with_block_rows(anchor, tile or candidate_tiles(anchor, chip)[0], knobs)
    check_tile(anchor, tile, knobs)
    sch = s_tir.Schedule(narrow(func))  # int32 indices: LoopPartition splits a tail tile
    if anchor.blocked:
        schedule_blocked(sch, anchor, epilogue, knobs, tile)
    else:
        schedule_nchw(sch, anchor, epilogue, knobs, tile)
    return sch.mod["main"].with_attr(SCHEDULED_ATTR, True)
