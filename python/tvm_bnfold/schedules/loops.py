"""Loop-nest steps every schedule of this package shares: int32 indices, parallel + vector nests,
and the hints that let LoopPartition split off a tail.

A tail that the vector tile does not divide is split off by TVM's LoopPartition: the full tiles
carry no predicate and the tail runs as a narrower vector. LoopPartition finds its hint
(:data:`PARTITION_HINT`) only on int32 loops, so every schedule starts from :func:`narrow`.
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx

from .anchor import Anchor
from .tiles import Knobs

PARTITION_HINT = "pragma_loop_partition_hint"

def narrow(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with int32 indices when its buffers allow: LoopPartition finds its hints only on
    int32 loops (NarrowDataType renames int64 loop variables and loses the hint)."""
    sizes = [math.prod(int(d) for d in p.ty.shape) for p in func.params if hasattr(p.ty, "shape")]
    if max(sizes, default=0) >= 2**31 - 1:
        return func
    mod = tirx.transform.ForceNarrowIndexToInt32()(tvm.IRModule({"main": func}))
    return mod["main"]


def index_dtype(buf) -> str:
    """The index dtype of a buffer's shape (int32 after ``narrow``)."""
    return str(buf.shape[0].ty) if len(buf.shape) else "int64"


def parallel_vectorized(sch: s_tir.Schedule, block_rv, knobs: Knobs,
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
        sch.annotate(outer, PARTITION_HINT, 1)
        sch.annotate(lane, PARTITION_HINT, 1)


def vectorize_nest(sch: s_tir.Schedule, block_rv, above, lanes: int, tail: int) -> None:
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


def split_lanes(sch: s_tir.Schedule, loop, lanes: int) -> list:
    """``loop`` split into vectors of ``lanes`` (the last one a tail when they do not divide
    it), or ``[loop]`` when it is no longer than a vector."""
    return [loop] if int(sch.get(loop).extent) <= lanes else sch.split(loop, [None, lanes])


def hint_tails(sch: s_tir.Schedule, anchor: Anchor) -> None:
    """Give every serial loop of the anchor and its epilogue the LoopPartition hint, so that a
    tail the vectors or tiles do not divide is split off (see step 7 of
    :func:`.nchw.schedule_nchw`)."""
    for b in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(b).name_hint not in anchor.producers:
            for loop in sch.get_loops(b):
                if sch.get(loop).kind != tirx.ForKind.PARALLEL:
                    sch.annotate(loop, PARTITION_HINT, 1)
