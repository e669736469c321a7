"""MetaSchedule tuning per chip, and ``build()`` that reuses the tuning databases.

    mod = FuseEpilogue("avx2")(FoldBN()(load_onnx("model.onnx")))
    db = tune(mod, "avx2", work_dir="tuning_logs/avx2/resnet50", max_trials=2000)
    ex = build(mod, "avx2", model="resnet50")      # tuned kernels where the database has them

Tasks are the conv/matmul kernels of the module with their fused epilogues, in their unscheduled
form (FuseEpilogue keeps it as the ``bnfold.workload`` attribute of each scheduled kernel; a
graph-fused, unscheduled module works too). The search is MetaSchedule's evolutionary search with
the XGBoost cost model. A blocked conv (see blocked_layout) is searched in our own space: the
default schedule with its register tile (columns x channel blocks) sampled, one design space per
epilogue placement (on the register tile, or on the stored tile); every other kernel in the
default CPU space, whose MultiLevelTiling (``SSRSRS``) may fuse the epilogue at tile level 1 or
2 or leave it as its own loop nest. :class:`RegisterBudget` is the register-pressure check as a
postprocessor: a candidate whose register tile does not fit the chip's registers is discarded
before it is built or measured.

The databases are MetaSchedule's standard ``database_workload.json`` and
``database_tuning_record.json`` in ``work_dir``; stock ``relax.transform.MetaScheduleApplyDatabase``
reads them too. Next to them, ``bnfold_default_schedules.json`` holds the measured latency of
each kernel's default schedule: build() keeps a tuned schedule only where it measured faster;
``chip.json`` names the chip the records were made for and the machine they were measured on
(MetaSchedule itself ignores the target when it looks a record up): build() refuses a database
of another ISA and warns, naming both chips, where the CPU or the core count differs. A machine
with no database of its own (``tuning_logs/<chip>/<model>/``) uses a committed one of its ISA
that way, as a start; ``tune`` on it writes its own directory.
A re-run resumes: records already there count towards ``max_trials`` and are never measured
again; Ctrl-C ends a run after committing the batch in flight. A kill leaves at most a
truncated last line, which is dropped with a warning; any other bad line is a
:class:`DatabaseError` naming file and line.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import importlib
import importlib.machinery
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import types
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax, s_tir
from tvm.ir import IRModule
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from . import chips, register_pressure, schedules
from .errors import BNFoldError
from .fuse_epilogue import WORKLOAD_ATTR, schedule_kernels

logger = logging.getLogger(__name__)

#: ``tuning_logs/<chip>/<model>/`` of the repository.
TUNING_LOGS = Path(__file__).resolve().parents[2] / "tuning_logs"
WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
LOCK_FILE = ".tune.lock"
#: Measured latency of the default schedule of each tuned workload (not a MetaSchedule file).
DEFAULTS_FILE = "bnfold_default_schedules.json"
#: The chip a database was made for and the machine it was measured on.
CHIP_FILE = "chip.json"
_SCHEDULED = schedules.SCHEDULED_ATTR


class TuningError(BNFoldError):
    """Tuning cannot run as asked (no kernels, chip not measurable here...)."""


class DatabaseError(TuningError):
    """A tuning database file has a bad line; ``path`` and ``line`` (1-based) name it."""

    def __init__(self, path, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line = str(path), line


class ChipMismatchError(TuningError):
    """A database was made for another chip (its ``chip.json`` says which)."""


class TuningLockedError(TuningError):
    """Another tuning run holds the work directory."""


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


def kernels(mod: tvm.IRModule) -> dict[tvm.ir.GlobalVar, tvm.tirx.PrimFunc]:
    """The unscheduled form (the tuning workload) of every conv/matmul kernel of ``mod``: the
    ``bnfold.workload`` attribute of a kernel FuseEpilogue scheduled, or an unscheduled kernel
    itself."""
    out = {}
    for gvar, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        attrs = func.attrs or {}
        workload = unpack_workload(attrs[WORKLOAD_ATTR]) if WORKLOAD_ATTR in attrs else func
        if _SCHEDULED not in (workload.attrs or {}) and is_kernel(workload):
            out[gvar] = workload
    return out


def unpack_workload(packed: str) -> tvm.tirx.PrimFunc:
    """The PrimFunc of a ``bnfold.workload`` attribute (see fuse_epilogue.WORKLOAD_ATTR)."""
    return tvm.ir.load_json(zlib.decompress(base64.b64decode(str(packed))).decode())


def is_kernel(func: tvm.tirx.PrimFunc) -> bool:
    """An unscheduled conv/matmul kernel (with its epilogue), not another reduction (pooling,
    mean)."""
    anchor = schedules.analyze(func)
    return anchor is not None and anchor.kind != "reduction"


def workload_module(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every conv/matmul kernel replaced by its unscheduled form."""
    out = mod.clone()
    for gvar, func in kernels(mod).items():
        out.update_func(gvar, func)
    return out


def _strip_workloads(mod: tvm.IRModule) -> tvm.IRModule:
    out = mod.clone()
    for gvar, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs and WORKLOAD_ATTR in func.attrs:
            out.update_func(gvar, func.without_attr(WORKLOAD_ATTR))
    return out


# --------------------------------------------------------------------------------------------
# Database files
# --------------------------------------------------------------------------------------------


def check_database(work_dir, repair: bool = False) -> int:
    """Validate the two database files of ``work_dir`` line by line; returns the record count.

    A truncated last line (no newline: what a kill mid-write leaves) is dropped with a warning
    (removed from the file when ``repair``, else left for :func:`load_database` to skip); any
    other line that does not parse as a MetaSchedule workload / tuning record raises
    :class:`DatabaseError` naming file and line."""
    work_dir = Path(work_dir)
    workloads, records = [], 0
    for name in (WORKLOAD_FILE, RECORD_FILE):
        path = work_dir / name
        if not path.exists():
            continue
        for number, line in _read_lines(path, repair):
            if name == WORKLOAD_FILE:
                workloads.append(_parse(path, number, line, ms.database.Workload.from_json))
            else:
                _parse(path, number, line, lambda obj: _record(obj, workloads))
                records += 1
    return records


def _read_lines(path: Path, repair: bool) -> list[tuple[int, str]]:
    """Non-empty lines with their numbers; a truncated last line is left out (and cut from the
    file when ``repair``)."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        number = data[:cut].count(b"\n") + 1
        try:
            json.loads(data[cut:])  # a complete last line without its newline: keep it
        except ValueError:
            warnings.warn(f"{path}:{number}: truncated last line (an interrupted write) "
                          f"{'removed' if repair else 'skipped'}", stacklevel=3)
            if repair:
                with open(path, "r+b") as f:
                    f.truncate(cut)
            data = data[:cut]
    return [(i, line) for i, line in enumerate(data.decode("utf-8", "replace").split("\n"), 1)
            if line.strip()]


def _parse(path: Path, number: int, line: str, make):
    try:
        obj = json.loads(line)
    except ValueError as err:
        raise DatabaseError(path, number, f"not JSON ({err})") from None
    try:
        return make(obj)
    except DatabaseError:
        raise
    except Exception as err:  # TVM raises several types on a malformed record
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise DatabaseError(path, number, f"not a MetaSchedule entry ({reason})") from None


def _record(obj, workloads: list):
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int)):
        raise ValueError("expected [workload_index, record]")
    if not 0 <= obj[0] < len(workloads):
        raise ValueError(f"workload index {obj[0]} out of range ({len(workloads)} workloads)")
    return ms.database.TuningRecord.from_json(obj[1], workloads[obj[0]])


def load_database(work_dir, repair: bool = False) -> ms.database.JSONDatabase:
    """The validated JSONDatabase of ``work_dir`` (see :func:`check_database`). When a
    truncated last line is not repaired, the database is read from a clean copy."""
    work_dir = Path(work_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_database(work_dir, repair)
    for w in caught:
        warnings.warn(w.message, stacklevel=2)
    source = work_dir
    if not repair and caught:
        source = Path(tempfile.mkdtemp(prefix="bnfold_db_"))
        for name in (WORKLOAD_FILE, RECORD_FILE):
            if (work_dir / name).exists():
                lines = _read_lines(work_dir / name, False)
                (source / name).write_text("".join(line + "\n" for _, line in lines))
    return ms.database.JSONDatabase(path_workload=str(source / WORKLOAD_FILE),
                                    path_tuning_record=str(source / RECORD_FILE))


@contextlib.contextmanager
def work_dir_lock(work_dir) -> Iterator[None]:
    """Hold ``work_dir``'s lock file for one tuning run; a second run gets TuningLockedError."""
    path = Path(work_dir) / LOCK_FILE
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise TuningLockedError(
                f"{work_dir} is being tuned by {holder} (lock {path}); wait for it to finish "
                "or tune into another directory") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------
# Search-space pieces
# --------------------------------------------------------------------------------------------


class _Counter:
    """Discarded candidates per task, shared by the clones of a postprocessor."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, task: str) -> None:
        with self.lock:
            self.counts[task] = self.counts.get(task, 0) + 1


def register_tile(sch: s_tir.Schedule, block: str, lanes: int) -> int:
    """Vector registers of the accumulator tile of ``block`` in ``sch``: the spatial loops
    nested inside its innermost reduction loop (extent > 1), in vectors of ``lanes``."""
    block_rv = sch.get_sblock(block)
    realize = _realize(sch.mod["main"], block)
    reduce_vars, spatial_vars = set(), set()
    for iv, value in zip(realize.block.iter_vars, realize.iter_values, strict=True):
        used = _vars(value)
        (reduce_vars if int(iv.iter_type) == 2 else spatial_vars).update(used)
    loops = [sch.get(rv) for rv in sch.get_loops(block_rv)]
    inner = 0
    for i, loop in enumerate(loops):
        if loop.loop_var in reduce_vars and _extent(loop) > 1:
            inner = i + 1
    elements = math.prod(_extent(lp) for lp in loops[inner:] if lp.loop_var in spatial_vars)
    return -(-elements // lanes)


def _extent(loop) -> int:
    return int(loop.extent) if isinstance(loop.extent, tvm.tirx.IntImm) else 1 << 30


def _realize(func: tvm.tirx.PrimFunc, name: str):
    found: list = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, found.append), order="post")
    for node in found:
        if node.block.name_hint == name:
            return node
    raise TuningError(f"block {name!r} not found")


def _vars(expr) -> set:
    out: list = []
    tvm_ffi.structural_walk(expr, (tvm.tirx.Var, out.append), order="post")
    return set(out)


@derived_object
class RegisterBudget(ms.postproc.PyPostproc):
    """The register-pressure check as a MetaSchedule postprocessor: discards a candidate before
    it is built or measured when, in our blocked space, FuseEpilogue's static estimate exceeds
    ``schedules.register_budget``, or elsewhere, its register tile
    (:func:`register_tile`) plus the epilogue's operands exceeds
    ``register_pressure.static_budget(chip, dtype)``."""

    def __init__(self, chip: chips.Chip, counter: _Counter | None = None) -> None:
        super().__init__()
        self.chip = chip
        self.counter = counter or _Counter()
        self.task, self.anchor, self.budget = "", None, 0

    def _initialize_with_tune_context(self, context) -> None:
        self.task = str(context.task_name)
        self.anchor = schedules.analyze(context.mod["main"])
        if self.anchor is not None:
            self.budget = register_pressure.static_budget(self.chip, self.anchor.dtype)

    def apply(self, sch) -> bool:
        if self.anchor is None:
            return True
        sampled = schedules.sampled_tile(sch, self.anchor, self.chip)
        budget = self.budget
        if sampled is not None:  # our blocked space: FuseEpilogue's own static estimate
            need = schedules.live_vector_registers(self.anchor, sampled, self.chip,
                                                       broadcasts_live=True)
            budget = schedules.register_budget(self.anchor, self.chip)
        else:
            try:
                tile = register_tile(sch, self.anchor.block, self.chip.lanes(self.anchor.dtype))
            except (TuningError, RuntimeError, ValueError):
                return True  # not the shape we know: leave it to the other postprocessors
            need = tile + self.anchor.epilogue_operands
        if need > budget:
            self.counter.add(self.task)
            return False
        return True

    def clone(self) -> RegisterBudget:
        other = RegisterBudget(self.chip, self.counter)
        other.task, other.anchor, other.budget = self.task, self.anchor, self.budget
        return other


def design_space(workload: IRModule, chip: chips.Chip, postprocs: list
                 ) -> ms.space_generator.SpaceGenerator:
    """The search space of one task: for a blocked conv, our schedule with its register tile
    sampled and one space per epilogue level (:func:`schedules.design_spaces`); for any
    other kernel, MetaSchedule's default CPU space (MultiLevelTiling ``SSRSRS``, whose write
    reuse places the epilogue on the inner or outer tile or leaves it separate)."""
    if schedules.design_spaces(s_tir.Schedule(workload["main"]), chip) is not None:
        return ms.space_generator.ScheduleFn(
            functools.partial(schedules.design_spaces, chip=chip), sch_rules=[],
            postprocs=postprocs, mutator_probs="from-target")
    return ms.space_generator.PostOrderApply(
        sch_rules="from-target", postprocs=postprocs, mutator_probs="from-target")


@derived_object
class SkipMeasured(ms.postproc.PyPostproc):
    """Discards a candidate identical to one the database already measured (MetaSchedule's
    evolutionary search only remembers what it measured in the current run)."""

    def __init__(self, known: set | None = None) -> None:
        super().__init__()
        self.known = known or set()

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch) -> bool:
        return not self.known or tvm_ffi.structural_hash(sch.mod) not in self.known

    def clone(self) -> SkipMeasured:
        return SkipMeasured(self.known)


def _measured_hashes(records) -> set:
    out = set()
    for record in records:
        sch = s_tir.Schedule(record.workload.mod)
        with contextlib.suppress(Exception):
            record.trace.apply_to_schedule(sch, remove_postproc=False)
            out.add(tvm_ffi.structural_hash(sch.mod))
    return out


@derived_object
class Progress(ms.measure_callback.PyMeasureCallback):
    """Prints tasks done, trials done / total, the best latency so far and an ETA."""

    def __init__(self, names: list[str], weights: list[float], done: int, total: int,
                 quiet: bool) -> None:
        super().__init__()
        self.names, self.weights, self.quiet = names, weights, quiet
        self.done, self.total, self.start_done = done, total, done
        self.best: dict[int, float] = {}
        self.start = time.monotonic()

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
              runner_results) -> None:
        self.done += len(measure_candidates)
        for result in runner_results:
            if result.run_secs:
                secs = sum(float(s) for s in result.run_secs) / len(result.run_secs)
                self.best[task_id] = min(self.best.get(task_id, math.inf), secs)
        if self.quiet:
            return
        elapsed = time.monotonic() - self.start
        rate = (self.done - self.start_done) / max(elapsed, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else math.inf
        best = sum(self.weights[t] * s for t, s in self.best.items())
        print(f"[tune] task {len(self.best)}/{len(self.names)} tuned "
              f"(last: {self.names[task_id]}), trials {self.done}/{self.total}, "
              f"best {self.best[task_id] * 1e3 if task_id in self.best else math.nan:.3f} ms "
              f"for it, {best * 1e3:.2f} ms for the tuned kernels, "
              f"ETA {_fmt(eta)}", flush=True)


@derived_object
class CommitEachBatch(ms.task_scheduler.PyTaskScheduler):
    """MetaSchedule's gradient-based task scheduler, except that every batch is joined (its
    records committed to the database) before the next one starts: the stock one holds all
    results of its first round-robin pass until the pass ends, so a kill loses them.

    ``best``: best latency per task already in the database (its tasks skip the round-robin
    pass; their gradient starts from it)."""

    def __init__(self, best: dict[int, float], stop: threading.Event | None = None,
                 alpha: float = 0.2, window: int = 3) -> None:
        super().__init__()
        self.stop = stop or threading.Event()
        self.history = {t: [s] for t, s in best.items()}
        self.alpha, self.window = alpha, window
        self.in_flight: set[int] = set()
        self.picked: set[int] = set()

    def next_task_id(self) -> int:
        outer = self._outer()  # the TVM object: its task records
        for task_id in sorted(self.in_flight):
            if not outer.tasks_[task_id].is_terminated:
                secs = [_mean(r.run_secs) for r in self.join_running_task(task_id)
                        if r.run_secs and not r.error_msg]
                if secs:
                    last = self.history.get(task_id, [math.inf])[-1]
                    self.history.setdefault(task_id, []).append(min([last, *secs]))
        self.in_flight.clear()
        if self.stop.is_set():  # interrupted: the batches in flight are committed; stop
            return -1
        alive = []
        for task_id in range(len(outer.tasks_)):
            outer.touch_task(task_id)
            if not outer.tasks_[task_id].is_terminated:
                alive.append(task_id)
        if not alive:
            return -1
        fresh = [t for t in alive if t not in self.history and t not in self.picked]
        task_id = fresh[0] if fresh else max(alive, key=self._gradient)
        self.picked.add(task_id)
        self.in_flight.add(task_id)
        return task_id

    def _gradient(self, task_id: int) -> float:
        best = self.history.get(task_id)
        if not best or not math.isfinite(best[-1]):
            return -math.inf
        n, w = len(best), self.window
        g1 = (best[-1 - w] - best[-1]) / w if n > w else 0.0
        return (self.alpha * g1 + (1 - self.alpha) * best[-1] / n) * float(
            self._outer().tasks_[task_id].task_weight)


def _mean(secs) -> float:
    return sum(float(s) for s in secs) / len(secs)


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


# --------------------------------------------------------------------------------------------
# Builder: MetaSchedule's LocalBuilder without importing every tensor intrinsic per batch
# --------------------------------------------------------------------------------------------


def _cpu_tensor_intrin() -> None:
    """Import only the CPU tensor intrinsics (x86, Arm) in place of ``tvm.s_tir.tensor_intrin``,
    whose CUDA part alone takes a minute and a half to import on this host: MetaSchedule imports
    it in every TuneContext and every build worker."""
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        return
    spec = importlib.machinery.PathFinder.find_spec(name, s_tir.__path__)
    if spec is None or spec.submodule_search_locations is None:
        return
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    sys.modules[name] = module
    s_tir.tensor_intrin = module
    importlib.import_module(name + ".arm_cpu")
    importlib.import_module(name + ".x86")


def build_kernel(mod: tvm.IRModule, target, _params=None):
    """MetaSchedule's default_build, with only the CPU tensor intrinsics imported."""
    _cpu_tensor_intrin()
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


@derived_object
class InProcessBuilder(ms.builder.PyBuilder):
    """Builds the candidates one after the other in this process: no worker pool to start per
    batch (each start re-imports TVM), at the price of no build timeout or isolation."""

    def build(self, build_inputs):
        from tvm.s_tir.meta_schedule.builder.local_builder import default_export

        results = []
        for item in build_inputs:
            try:
                artifact = default_export(build_kernel(item.mod, item.target))
                results.append(ms.builder.BuilderResult(artifact, None))
            except Exception as err:  # a candidate that does not build is a failed trial
                results.append(ms.builder.BuilderResult(None, f"InProcessBuilder: {err}"))
        return results


# --------------------------------------------------------------------------------------------
# tune / build
# --------------------------------------------------------------------------------------------


def tune(
    mod: tvm.IRModule,
    chip,
    work_dir,
    max_trials: int = 2000,
    quiet: bool = False,
    *,
    runner: ms.runner.Runner | None = None,
    builder: ms.builder.Builder | None = None,
    rpc_tracker: str | None = None,
    rpc_key: str | None = None,
    num_trials_per_iter: int = 16,
    population_size: int = 128,
    genetic_num_iters: int = 3,
    build_timeout_s: float = 120.0,
    seed: int | None = None,
) -> ms.database.JSONDatabase:
    """Tune the conv/matmul kernels of ``mod`` for ``chip``; returns the database in
    ``work_dir``. ``max_trials`` counts the records already there (a re-run resumes).

    ``runner``: a MetaSchedule runner; else an RPC runner when ``rpc_tracker``/``rpc_key`` are
    given, else the local one (only for chips that run on this host). ``builder``: MetaSchedule's
    LocalBuilder (worker processes) unless given (:class:`InProcessBuilder` is faster on a small
    machine).
    """
    chip = chips.get(chip)
    if chip.kind != "cpu":
        raise TuningError(f"tune() supports CPU chips; {chip.name!r} is {chip.kind} (its kernels "
                          "keep dlight's schedules and the ptxas check)")
    if max_trials < 1:
        raise TuningError(f"max_trials must be >= 1, got {max_trials}")
    if runner is None and (rpc_tracker or rpc_key):
        if not (rpc_tracker and rpc_key):
            raise TuningError("rpc_tracker and rpc_key go together")
        from . import rpc

        runner = rpc.make_runner(rpc_tracker, rpc_key)
    if runner is None and not chip.runs_here:
        raise TuningError(
            f"chip {chip.name!r} cannot run on this host (needs the {chip.needs or 'its own'} "
            "hardware), so its candidates cannot be measured locally: pass rpc_tracker/rpc_key "
            "(or a runner) for a machine of that kind")
    _cpu_tensor_intrin()
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    with work_dir_lock(work_dir):
        return _tune_locked(mod, chip, work_dir, max_trials, quiet, runner, builder,
                            num_trials_per_iter, population_size, genetic_num_iters,
                            build_timeout_s, seed)


def _tune_locked(mod, chip, work_dir, max_trials, quiet, runner, builder, num_trials_per_iter,
                 population_size, genetic_num_iters, build_timeout_s, seed):
    _claim(work_dir, chip, measured_here=runner is None)
    db = load_database(work_dir, repair=True)
    with chip.target:
        tasks = ms.relax_integration.extract_tasks(workload_module(mod), chip.target)
    tasks = [t for t in tasks if is_kernel(t.dispatched[0]["main"])]
    if not tasks:
        raise TuningError("no conv/matmul kernel to tune in the module")
    say = (lambda *a: None) if quiet else (lambda *a: print("[tune]", *a, flush=True))
    names = [t.task_name for t in tasks]
    records, best = {}, {}
    for i, task in enumerate(tasks):
        if db.has_workload(task.dispatched[0]):
            token = db.commit_workload(task.dispatched[0])
            records[task.task_name] = [r for r in db.get_all_tuning_records()
                                       if r.workload.same_as(token)]
            secs = [_mean(r.run_secs) for r in records[task.task_name] if r.run_secs]
            if secs:
                best[i] = min(secs)
    done = sum(len(r) for r in records.values())
    remaining = max_trials - done
    say(f"{chip.name}: {len(tasks)} tasks, {done} trials already in {work_dir}, "
        f"{max(remaining, 0)} to run")
    cores = chip.cores
    builder = builder or ms.builder.LocalBuilder(
        max_workers=cores, timeout_sec=build_timeout_s, f_build=build_kernel)
    if runner is None:
        # The runner's worker processes start their TVM thread pool from the environment:
        # measure on the cores the code is built for (TVM's own default is half of them on x86).
        os.environ.setdefault("TVM_NUM_THREADS", str(min(cores, chips.usable_cores())))
        runner = ms.runner.LocalRunner()
    if any(func.same_as(mod[gvar]) for gvar, func in kernels(mod).items()):
        with chip.target:  # unscheduled kernels: their default schedule, as build() gives it
            mod, _ = schedule_kernels(mod, chip, measure=False)
    _measure_defaults(mod, chip, work_dir, builder, runner, say)
    if remaining <= 0:
        return db
    counter = _Counter()
    loggers = _task_loggers(work_dir, names)
    contexts, weights = [], []
    seeds = ms.utils.fork_seed(seed, n=len(tasks))
    for task, task_logger, rand in zip(tasks, loggers, seeds, strict=True):
        known = _measured_hashes(records.get(task.task_name, []))
        space = design_space(task.dispatched[0], chip, [
            RegisterBudget(chip, counter), *ms.postproc.Postproc.create("llvm"),
            SkipMeasured(known)])
        strategy = ms.search_strategy.EvolutionarySearch(
            population_size=population_size, genetic_num_iters=genetic_num_iters,
            init_min_unmeasured=min(50, population_size // 2))
        contexts.append(ms.TuneContext(
            mod=task.dispatched[0], target=chip.target, space_generator=space,
            search_strategy=strategy, task_name=task.task_name, logger=task_logger,
            rand_state=rand, num_threads=chips.usable_cores()).clone())
        weights.append(float(task.weight))
    progress = Progress(names, weights, done, max_trials, quiet)
    start = time.monotonic()
    stop = threading.Event()
    with _stop_on_sigint(stop):
        _run_tasks(contexts, weights, work_dir, remaining, num_trials_per_iter, builder, runner,
                   db, cores, progress, CommitEachBatch(best, stop))
    for name in names:
        message = (f"task {name}: register-pressure check discarded "
                   f"{counter.counts.get(name, 0)} candidates")
        logger.info(message)
        say(message)
    say(f"{'interrupted' if stop.is_set() else 'done'}: {progress.done - done} trials in "
        f"{_fmt(time.monotonic() - start)}, {progress.done} in {work_dir}")
    if stop.is_set():
        raise KeyboardInterrupt(f"tuning interrupted; {work_dir} holds {progress.done} trials, "
                                "re-run to resume")
    return db


@contextlib.contextmanager
def _stop_on_sigint(stop: threading.Event) -> Iterator[None]:
    """Ctrl-C (SIGINT) sets ``stop``: the run ends after the batch in flight is committed
    (MetaSchedule would otherwise swallow the KeyboardInterrupt). A second one is the default
    KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        stop.set()
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_tasks(contexts, weights, work_dir, remaining, num_trials_per_iter, builder, runner,
               db, cores, progress, scheduler) -> None:
    ms.tune_tasks(
        tasks=contexts, task_weights=weights, work_dir=str(work_dir),
        max_trials_global=remaining, num_trials_per_iter=num_trials_per_iter,
        builder=builder,
        runner=runner,
        database=db,
        cost_model=ms.cost_model.XGBModel(num_tuning_cores=cores, adaptive_training=True),
        measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"), progress],
        task_scheduler=scheduler,
    )


def workload_key(workload: tvm.tirx.PrimFunc) -> str:
    """Key of a workload in the defaults file: its structural hash."""
    return str(tvm_ffi.structural_hash(workload))


def _measure_defaults(mod, chip, work_dir: Path, builder, runner, say) -> None:
    """Measure the module's current (default) schedule of every kernel not measured yet, with
    the tuning runner, into ``work_dir/bnfold_default_schedules.json``: build() keeps a tuned
    schedule only where it measured faster than that."""
    path = work_dir / DEFAULTS_FILE
    known = json.loads(path.read_text()) if path.exists() else {}
    todo = {}
    for gvar, workload in kernels(mod).items():
        func = mod[gvar]
        if (func.attrs or {}).get(WORKLOAD_ATTR) and workload_key(workload) not in known:
            todo[workload_key(workload)] = (gvar.name_hint, func.without_attr(WORKLOAD_ATTR))
    if not todo:
        return
    say(f"measuring the default schedule of {len(todo)} kernels")
    items = list(todo.items())
    inputs = [ms.builder.BuilderInput(IRModule({"main": f.with_attr("global_symbol", "main")}),
                                      chip.target) for _, (_, f) in items]
    built = builder.build(inputs)
    ok = [(key, result) for (key, _), result in zip(items, built, strict=True)
          if result.error_msg is None]
    futures = runner.run([ms.runner.RunnerInput(
        result.artifact_path, "cpu", ms.arg_info.ArgInfo.from_prim_func(todo[key][1]))
        for key, result in ok])
    for (key, _), future in zip(ok, futures, strict=True):
        result = future.result()
        if result.run_secs and not result.error_msg:
            known[key] = {"kernel": todo[key][0], "secs": _mean(result.run_secs)}
    path.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")


def _task_loggers(work_dir: Path, names: list[str]) -> list[logging.Logger]:
    """One logger per task writing MetaSchedule's search log to ``work_dir/logs/`` only (TVM's
    own get_loggers_from_work_dir fails when called twice in a process under pytest)."""
    (work_dir / "logs").mkdir(exist_ok=True)
    out = []
    for i, name in enumerate(names):
        task_logger = logging.getLogger(f"{__name__}.task.{work_dir}.{i}")
        for handler in list(task_logger.handlers):
            task_logger.removeHandler(handler)
            handler.close()
        handler = logging.FileHandler(work_dir / "logs" / f"task_{i:02d}_{name[:100]}.log")
        handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] %(message)s"))
        task_logger.addHandler(handler)
        task_logger.setLevel(logging.INFO)
        task_logger.propagate = False
        out.append(task_logger)
    return out


def database_dir(chip: chips.Chip, work_dir=None, model: str | None = None) -> Path | None:
    """Where ``chip``'s database of ``model`` lives (and ``tune`` writes): ``work_dir``, else
    ``tuning_logs/<chip>/<model>/`` when ``model`` is given."""
    if work_dir is not None:
        return Path(work_dir)
    if model is not None:
        return TUNING_LOGS / chip.name / model
    return None


def find_database(chip: chips.Chip, model: str) -> Path | None:
    """The database ``build`` uses for ``chip``'s ``model``: its own, else one committed for
    another chip of the same ISA (build() warns, naming both); None when there is neither."""
    own = database_dir(chip, model=model)
    if _has_records(own):
        return own
    for path in sorted(TUNING_LOGS.glob(f"*/{model}")):
        made_for = _chip_file(path)
        if _has_records(path) and made_for is not None and made_for.get("isa") == chip.isa:
            return path
    return None


def _has_records(path: Path) -> bool:
    records = path / RECORD_FILE
    return records.is_file() and records.stat().st_size > 0


def chip_entry(chip: chips.Chip, measured_here: bool = True) -> dict:
    """What ``chip.json`` says: the chip the code is for, and the machine that measured it."""
    entry = {"chip": chip.name, "cpu": chip.cpu, "isa": chip.isa, "cores": chip.cores,
             "target": str(chip.target)}
    if measured_here:
        entry["measured_on"] = {"cpu": tvm.target.codegen.llvm_get_system_cpu(),
                                "cores": chips.usable_cores()}
    return entry


def _chip_file(path: Path) -> dict | None:
    try:
        entry = json.loads((path / CHIP_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise DatabaseError(path / CHIP_FILE, 1, f"not a chip record: {err}") from err
    if not isinstance(entry, dict) or not {"chip", "cpu", "isa", "cores"} <= entry.keys():
        raise DatabaseError(path / CHIP_FILE, 1, "a chip record needs chip, cpu, isa and cores")
    return entry


def _describe(entry: dict) -> str:
    where = entry.get("measured_on")
    measured = f", measured on {where['cpu']} with {where['cores']} cores" if where else ""
    return f"{entry['chip']} ({entry['cpu']}, {entry['isa'].upper()}, {entry['cores']} cores" \
        f"{measured})"


def check_chip(path: Path, chip: chips.Chip) -> None:
    """A database made for another ISA is a :class:`ChipMismatchError`; one of another CPU or core
    count of the same ISA is used with a warning naming both chips."""
    made_for = _chip_file(path)
    if made_for is None:
        warnings.warn(f"{path} does not say which chip it was measured on ({CHIP_FILE} is "
                      f"missing); using it for {chip.describe()}", stacklevel=3)
        return
    if made_for["isa"] != chip.isa:
        raise ChipMismatchError(f"{path} holds records for {_describe(made_for)}, not usable "
                                f"for {chip.describe()}: tune for it into a directory of its own")
    if (made_for["cpu"], made_for["cores"]) != (chip.cpu, chip.cores):
        warnings.warn(f"using the database of {_describe(made_for)} for {chip.describe()}: "
                      f"its tiles were chosen on another CPU; tune this machine's own with "
                      f"`tvm-bnfold tune MODEL --chip {chip.name}`", stacklevel=3)


def _claim(work_dir: Path, chip: chips.Chip, measured_here: bool) -> None:
    """Write ``chip.json`` into a new database directory; refuse one of another chip."""
    made_for = _chip_file(work_dir)
    if made_for is None:
        tmp = work_dir / f".{CHIP_FILE}.tmp"
        tmp.write_text(json.dumps(chip_entry(chip, measured_here), indent=1) + "\n")
        os.replace(tmp, work_dir / CHIP_FILE)
    elif (made_for["chip"], made_for["cpu"], made_for["isa"], made_for["cores"]) != \
            (chip.name, chip.cpu, chip.isa, chip.cores):
        raise ChipMismatchError(f"{work_dir} holds the database of {_describe(made_for)}; "
                                f"tune {chip.describe()} into a directory of its own")


def apply_database(mod: tvm.IRModule, chip, work_dir=None, model: str | None = None
                   ) -> tuple[tvm.IRModule, list[str], list[str], list[str]]:
    """``mod`` with every conv/matmul kernel scheduled: the tuned schedule where the database
    has its workload and it measured faster than the default schedule, else the default one
    (one warning naming the kernels without a record). Returns the module and the names of
    the tuned kernels, of those whose default schedule measured faster, and of the missing."""
    chip = chips.get(chip)
    with chip.target:
        if any(func.same_as(mod[gvar]) for gvar, func in kernels(mod).items()):
            mod, _ = schedule_kernels(mod, chip, measure=False)  # unscheduled kernels
    found = kernels(mod)
    path = database_dir(chip, work_dir, model)
    tuned: list[str] = []
    slower: list[str] = []  # tuned, but the default schedule measured faster
    if path is not None and (path / RECORD_FILE).exists():
        check_chip(path, chip)
        db = load_database(path)
        defaults = (json.loads((path / DEFAULTS_FILE).read_text())
                    if (path / DEFAULTS_FILE).exists() else {})
        with chip.target, db:
            applied = relax.transform.MetaScheduleApplyDatabase()(workload_module(mod))
        mod = mod.clone()
        for gvar, workload in found.items():
            func = applied[gvar]
            if not (func.attrs and func.attrs.get(_SCHEDULED, False)):
                continue
            default = defaults.get(workload_key(workload), {}).get("secs")
            record = db.query_tuning_record(_normalize(workload), chip.target, gvar.name_hint)
            if default is not None and record is not None and record.run_secs and \
                    _mean(record.run_secs) >= default:
                slower.append(gvar.name_hint)
                continue
            mod.update_func(gvar, func)
            tuned.append(gvar.name_hint)
    if slower:
        logger.info("default schedule measured faster than the tuned one, kept for: %s",
                    ", ".join(sorted(slower)))
    missing = sorted(g.name_hint for g in found if g.name_hint not in tuned + slower)
    if path is not None and missing:
        warnings.warn(f"{len(missing)} kernel(s) have no tuning record in {path} and keep the "
                      f"default schedule: {', '.join(missing)}", stacklevel=2)
    return _strip_workloads(mod), sorted(tuned), sorted(slower), missing


def _normalize(func: tvm.tirx.PrimFunc) -> IRModule:
    """The module MetaSchedule keys a PrimFunc's records by (as MetaScheduleApplyDatabase)."""
    return ms.tune_context._normalize_mod(func)


def build(mod: tvm.IRModule, chip, work_dir=None, model: str | None = None):
    """Compile ``mod`` (after FoldBN+FuseEpilogue) for ``chip`` with the tuned schedules of
    ``work_dir`` (or ``tuning_logs/<chip>/<model>/``) where present; returns the executable."""
    chip = chips.get(chip)
    scheduled, *_ = apply_database(mod, chip, work_dir, model)
    return tvm.compile(scheduled, target=chip.target)
