"""The schedule of a kernel of injective blocks only: a layout transform, a standalone
elementwise op (what FuseEpilogue leaves outside the conv kernels).

Everything is inlined into the last block, which iterates the blocked side of a layout transform
(contiguous vectors; measured 2-4x faster than the reverse); kernels under
:data:`SERIAL_ELEMENTS` run on one thread (a parallel launch costs ~2 us).
"""

from __future__ import annotations

import contextlib
import math

from tvm import s_tir, tirx

from .. import chips
from .anchor import DATA_PAR, SCHEDULED_ATTR, is_identity
from .loops import narrow, parallel_vectorized
from .tiles import Knobs, divisors

#: Injective kernels smaller than this run on one thread (a parallel launch costs ~2 us).
SERIAL_ELEMENTS = 1 << 14

def schedule_injective(func: tirx.PrimFunc, chip: chips.Chip) -> tirx.PrimFunc | None:
    """A kernel of injective blocks only (a layout transform, a standalone elementwise op):
    everything inlined into the last block, its outer loops parallel, the second-innermost
    unrolled in short steps and the innermost vectorized. None for any other kernel."""
    if func.attrs is not None and SCHEDULED_ATTR in func.attrs:
        return None
    sch = s_tir.Schedule(narrow(func))
    try:
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except (RuntimeError, ValueError):
        return None
    if not blocks or any(iv.iter_type != DATA_PAR for b in blocks for iv in sch.get(b).iter_vars):
        return None
    try:
        for block_rv in blocks[:-1]:
            sch.compute_inline(block_rv)
    except s_tir.schedule.ScheduleError:
        return None
    knobs = Knobs.of(chip, str(sch.get(blocks[-1]).writes[0].source.dtype))
    # A layout transform iterates its input's index space. Iterate the blocked side (the
    # buffer whose innermost axis is a channel block of at most one vector): its vectors are
    # contiguous, the other side gathers or scatters (measured 2-4x faster than the reverse).
    last = sch.get(blocks[-1])
    own = [iv.var for iv in last.iter_vars]
    out = last.writes[0].source
    short = len(out.shape) > 0 and int(out.shape[-1]) <= knobs.lanes
    if short and not is_identity(last.writes[0].region, own):
        indices = [rg.min for rg in last.writes[0].region]
        with contextlib.suppress(s_tir.schedule.ScheduleError):
            sch.transform_block_layout(blocks[-1], tirx.IndexMap(own, indices, None))
    loops = sch.get_loops(blocks[-1])
    if not loops:  # a scalar: nothing to parallelize
        return None
    if len(loops) > 2 and int(sch.get(loops[-2]).extent) > 1:
        step = max(d for d in divisors(int(sch.get(loops[-2]).extent)) if d <= 16)
        _, inner = sch.split(loops[-2], [None, step])
        sch.unroll(inner)
    small = math.prod(int(d) for d in out.shape) < SERIAL_ELEMENTS  # not worth a thread
    parallel_vectorized(sch, blocks[-1], knobs, outer=0 if small else len(loops) - 2)
    return sch.mod["main"].with_attr(SCHEDULED_ATTR, True)
