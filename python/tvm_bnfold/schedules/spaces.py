"""MetaSchedule design spaces of a blocked conv: our schedule with its register tile sampled.

``tuning`` searches these (a ``ScheduleFn``) instead of MetaSchedule's generic rules: the two
``sample_perfect_tile`` decisions (columns, channel blocks) are what its tile-size mutator
explores, one space per epilogue level; tiles with a tail (which a perfect tile cannot sample)
come as fixed schedules. :func:`sampled_tile` reads a tuned schedule's tile back for the
register-pressure check of a tuning candidate.
"""

from __future__ import annotations

from tvm import s_tir

from .. import chips
from .anchor import Anchor, anchor_or_reason
from .blocked import schedule_blocked
from .tiles import Knobs, Tile, candidate_tiles


def design_spaces(sch: s_tir.Schedule, chip: chips.Chip) -> list[s_tir.Schedule] | None:
    """MetaSchedule design spaces of a blocked conv kernel (``ms.space_generator.ScheduleFn``):
    our schedule with the register tile sampled (``sample_perfect_tile`` of the columns and of
    the channel blocks, which MetaSchedule's tile-size mutator explores), one space per
    epilogue level (on the register tile, on the stored tile); and one fixed schedule per
    candidate tile with a tail (which a perfect tile cannot sample) and level. None for any
    other kernel."""
    anchor = anchor_or_reason(sch.mod["main"])
    if isinstance(anchor, str) or not anchor.blocked:
        return None
    knobs = Knobs.of(chip, anchor.dtype)
    tails = [t for t in candidate_tiles(anchor, chip) if anchor.spatial[3] % t.rows]
    spaces = []
    for level in ("register", "cache") if anchor.epilogue else ("register",):
        for tile in (None, *tails):
            space = sch.copy()
            schedule_blocked(space, anchor, level, knobs, tile)
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
