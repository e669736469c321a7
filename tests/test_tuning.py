"""tune() / build(): MetaSchedule tuning of the fused kernels of a tiny conv+bias+relu model,
its databases, resume, interruption, corrupt files and the register-pressure postprocessor.

One small tuning run (8 trials) is shared by the module; the rest reuses its database."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from _util import assert_close, function, run, tensor_var
from tvm_bnfold import FuseEpilogue, chips, schedules, tuning
from tvm_bnfold.fuse_epilogue import WORKLOAD_ATTR, fuse_graph
from tvm_bnfold.tuning import (
    CHIP_FILE,
    DEFAULTS_FILE,
    RECORD_FILE,
    WORKLOAD_FILE,
    ChipMismatchError,
    DatabaseError,
    InProcessBuilder,
    RegisterBudget,
    TuningError,
    TuningLockedError,
    apply_database,
    build,
    find_database,
    kernels,
    load_database,
    register_tile,
    tune,
    work_dir_lock,
    workload_key,
    workload_module,
)

R = relax.op
CHIP = chips.get("avx2")
pytestmark = pytest.mark.skipif(not CHIP.runs_here, reason="avx2 does not run here")
# Small search settings: the file has to stay within a few minutes on 2 cores.
SMALL = dict(num_trials_per_iter=4, population_size=32, genetic_num_iters=1, seed=0)
TRIALS = 8


def conv_module(cin=8, cout=16, hw=10, seed=0):
    """x -> conv3x3 -> + bias -> relu."""
    rng = np.random.default_rng(seed)
    w = relax.const(rng.normal(0, 0.3, (cout, cin, 3, 3)).astype("float32"))
    b = relax.const(rng.normal(0, 0.5, (1, cout, 1, 1)).astype("float32"))

    def body(bb, x):
        y = bb.emit(R.add(bb.emit(R.nn.conv2d(x, w, padding=1)), b))
        return R.nn.relu(y)

    x = rng.normal(size=(1, cin, hw, hw)).astype("float32")
    return function([tensor_var("x", x.shape)], body), x


def fused(mod):
    with CHIP.target:
        return FuseEpilogue(CHIP, measure=False, blocked=True)(mod)  # our design space


def vm_run(ex, x):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.strip()]


@derived_object
class CountingRunner(ms.runner.PyRunner):
    """LocalRunner that counts the candidates it is asked to measure."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ms.runner.LocalRunner()
        self.measured: list[int] = []

    def run(self, runner_inputs):
        self.measured.append(len(runner_inputs))
        return self.inner.run(runner_inputs)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(module, input, fused module, work_dir) after one small tuning run."""
    mod, x = conv_module()
    fmod = fused(mod)
    work_dir = tmp_path_factory.mktemp("tune") / "db"
    tune(fmod, CHIP, work_dir, max_trials=TRIALS, quiet=True, builder=InProcessBuilder(),
         **{**SMALL, "num_trials_per_iter": TRIALS})  # one batch
    return mod, x, fmod, work_dir


def test_scheduled_kernel_keeps_its_workload_and_still_compiles(tmp_path):
    mod, x = conv_module()
    fmod = fused(mod)
    ((gvar, workload),) = kernels(fmod).items()
    unscheduled = fuse_graph(mod, CHIP.lanes())[gvar.name_hint]
    tvm.ir.assert_structural_equal(workload, unscheduled)
    assert "bnfold.workload" in fmod.script()  # the module still prints
    again = FuseEpilogue(CHIP, measure=False, blocked=True)
    with CHIP.target:
        twice = again(fmod)
    assert str(twice[gvar].attrs[WORKLOAD_ATTR]) == str(fmod[gvar].attrs[WORKLOAD_ATTR])
    tvm.ir.assert_structural_equal(twice[gvar].body, fmod[gvar].body)
    ex = tvm.compile(fmod, target=CHIP.target)  # compiles with the attribute in place
    ex.export_library(str(tmp_path / "m.so"))
    loaded = tvm.runtime.load_module(str(tmp_path / "m.so"))
    assert_close(vm_run(loaded, x), run(mod, x))


def test_tuned_build_matches_unfused_module(tuned, tmp_path):
    mod, x, fmod, work_dir = tuned
    assert len(lines(work_dir / RECORD_FILE)) == TRIALS
    defaults = json.loads((work_dir / DEFAULTS_FILE).read_text())
    ((kernel, workload),) = kernels(fmod).items()
    assert defaults[workload_key(workload)]["secs"] > 0  # the default schedule was measured
    # Without the default's figure the tuned schedule is taken.
    shutil.copytree(work_dir, tmp_path / "db", ignore=shutil.ignore_patterns(DEFAULTS_FILE))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every kernel has a record: no warning
        scheduled, names, slower, missing = apply_database(fmod, CHIP, tmp_path / "db")
    assert names == [kernel.name_hint] and not slower and not missing
    ours = fmod[kernel].without_attr(WORKLOAD_ATTR)
    with CHIP.target, load_database(work_dir):  # the database's best record, as stock TVM does
        best = relax.transform.MetaScheduleApplyDatabase()(workload_module(fmod))
    tvm.ir.assert_structural_equal(scheduled[kernel.name_hint], best[kernel.name_hint])
    assert_close(vm_run(tvm.compile(scheduled, target=CHIP.target), x), run(mod, x))
    assert_close(vm_run(build(fmod, CHIP, work_dir=work_dir), x), run(mod, x))
    # A default schedule measured faster than every record is kept.
    key = workload_key(workload)
    (tmp_path / "db" / DEFAULTS_FILE).write_text(json.dumps({key: {"secs": 1e-12}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduled, names, slower, missing = apply_database(fmod, CHIP, tmp_path / "db")
    assert not names and slower == [kernel.name_hint] and not missing
    tvm.ir.assert_structural_equal(scheduled[kernel.name_hint], ours)


def test_database_in_context_takes_precedence_in_fuse_epilogue(tuned):
    """FuseEpilogue's phase 2: a kernel the database in context has keeps the tuned schedule
    (decision "database"); tune() can still find its workload."""
    mod, x, fmod, work_dir = tuned
    fuse = FuseEpilogue(CHIP, measure=False, blocked=True)
    with CHIP.target, load_database(work_dir):
        out = fuse(mod)
    (record,) = fuse.report
    assert record.decision == "database" and record.ops[0].startswith("conv2d")
    with CHIP.target, load_database(work_dir):
        stock = relax.transform.MetaScheduleApplyDatabase()(fuse_graph(mod, CHIP.lanes()))
    ((kernel, workload),) = kernels(out).items()
    tuned_func = out[kernel].without_attr(WORKLOAD_ATTR)
    tvm.ir.assert_structural_equal(tuned_func, stock[kernel.name_hint])
    tvm.ir.assert_structural_equal(workload, next(iter(kernels(fmod).values())))
    assert_close(vm_run(tvm.compile(out, target=CHIP.target), x), run(mod, x))


def test_database_is_standard_for_stock_apply_database(tuned):
    mod, x, _, work_dir = tuned
    assert len(lines(work_dir / WORKLOAD_FILE)) == 1
    for line in lines(work_dir / RECORD_FILE):
        index, record = json.loads(line)
        assert index == 0 and len(record) == 4  # [trace, run_secs, target, args_info]
    with CHIP.target:
        graph = fuse_graph(mod, CHIP.lanes())  # the unscheduled, graph-fused module
        applied = relax.transform.MetaScheduleApplyDatabase(str(work_dir))(graph)
    tuned_funcs = [f for f in applied.functions.values()
                   if isinstance(f, tvm.tirx.PrimFunc) and f.attrs.get("tirx.is_scheduled")]
    assert len(tuned_funcs) == 1
    assert_close(vm_run(tvm.compile(applied, target=CHIP.target), x), run(mod, x))


def test_build_warns_once_naming_the_kernels_without_records(tuned):
    _, _, _, work_dir = tuned
    other, x = conv_module(cin=4, cout=8, hw=6, seed=1)  # a workload the database lacks
    fother = fused(other)
    with pytest.warns(UserWarning, match="fused_conv2d_add_relu") as caught:
        ex = build(fother, CHIP, work_dir=work_dir)
    assert len([w for w in caught if "no tuning record" in str(w.message)]) == 1
    assert_close(vm_run(ex, x), run(other, x))


# A 2-core Zen 3 host as host_chip() would see it: AVX2 as the avx2 preset, another CPU name.
ZEN3 = chips.Chip("avx2-znver3-2c", "cpu", {"kind": "llvm", "mcpu": "znver3", "num-cores": 2},
                  256, 16, "avx2")


def test_the_database_names_the_chip_it_was_made_for(tuned):
    *_, work_dir = tuned
    entry = json.loads((work_dir / CHIP_FILE).read_text())
    assert (entry["chip"], entry["cpu"], entry["isa"], entry["cores"]) == ("avx2", "haswell",
                                                                          "avx2", 2)
    assert entry["measured_on"] == {"cpu": tvm.target.codegen.llvm_get_system_cpu(),
                                    "cores": chips.usable_cores()}


def test_a_database_of_another_cpu_is_used_with_a_warning_naming_both(tuned):
    mod, x, _, work_dir = tuned
    with ZEN3.target:
        zen3 = FuseEpilogue(ZEN3, measure=False, blocked=True)(mod)
    with pytest.warns(UserWarning, match=r"database of avx2 \(haswell, AVX2, 2 cores, measured "
                      r"on .*\) for avx2-znver3-2c \(znver3, AVX2, 2 cores\)"):
        scheduled, names, slower, missing = apply_database(zen3, ZEN3, work_dir)
    # Its records are used: the workloads are the same on the same ISA. Whether the tuned
    # schedule or the measured default wins is this host's timing (8 trials), so either counts.
    assert len(names + slower) == 1 and not missing
    assert_close(vm_run(tvm.compile(scheduled, target=ZEN3.target), x), run(mod, x))


def test_a_database_of_another_isa_is_refused(tuned):
    mod, _, _, work_dir = tuned
    avx512 = chips.get("avx512")
    with avx512.target:
        wide = FuseEpilogue(avx512, measure=False, blocked=True)(mod)
    with pytest.raises(ChipMismatchError, match=r"records for avx2 \(haswell, AVX2.*not usable "
                       r"for avx512 \(znver4, AVX512, 2 cores\)"):
        apply_database(wide, avx512, work_dir)


def test_a_database_without_a_chip_file_warns_and_a_bad_one_is_an_error(tuned, tmp_path):
    *_, fmod, work_dir = tuned
    shutil.copytree(work_dir, tmp_path / "db", ignore=shutil.ignore_patterns(CHIP_FILE))
    with pytest.warns(UserWarning, match="does not say which chip"):
        apply_database(fmod, CHIP, tmp_path / "db")
    (tmp_path / "db" / CHIP_FILE).write_text('{"chip": "avx2"}')
    with pytest.raises(DatabaseError, match=r"chip.json:1: a chip record needs"):
        apply_database(fmod, CHIP, tmp_path / "db")


def test_tuning_another_chip_into_a_database_is_refused(tuned, tmp_path):
    *_, fmod, work_dir = tuned
    shutil.copytree(work_dir, tmp_path / "db")
    before = (tmp_path / "db" / RECORD_FILE).read_text()
    with pytest.raises(ChipMismatchError,
                       match=r"holds the database of avx2 .* tune avx2-znver3-2c"):
        tune(fmod, ZEN3, tmp_path / "db", max_trials=TRIALS + 4, quiet=True, **SMALL)
    assert (tmp_path / "db" / RECORD_FILE).read_text() == before


def test_a_new_machine_finds_the_committed_database_of_its_isa(tuned, tmp_path, monkeypatch):
    *_, work_dir = tuned
    monkeypatch.setattr(tuning, "TUNING_LOGS", tmp_path)
    shutil.copytree(work_dir, tmp_path / "avx2" / "tiny")
    assert find_database(ZEN3, "tiny") == tmp_path / "avx2" / "tiny"  # no database of its own
    assert find_database(chips.get("avx512"), "tiny") is None  # another ISA: none
    assert find_database(ZEN3, "other") is None
    shutil.copytree(work_dir, tmp_path / ZEN3.name / "tiny")
    assert find_database(ZEN3, "tiny") == tmp_path / ZEN3.name / "tiny"  # its own comes first


def test_register_budget_discards_a_huge_register_tile():
    """MetaSchedule's default space (an NCHW conv): the tile nested inside the reduction."""
    mod, _ = conv_module()
    with CHIP.target:
        workload = next(iter(kernels(FuseEpilogue(CHIP, measure=False, blocked=False)(mod))
                             .values()))
    ctx = ms.TuneContext(mod=workload, target=CHIP.target, task_name="conv")
    check = RegisterBudget(CHIP)
    check._initialize_with_tune_context(ctx)

    def tiled(order):
        sch = s_tir.Schedule(ctx.mod)
        n, f, y, x, rc, ry, rx = sch.get_loops(sch.get_sblock("conv2d_nchw"))
        loops = dict(n=n, f=f, y=y, x=x, rc=rc, ry=ry, rx=rx)
        sch.reorder(*[loops[name] for name in order.split()])
        return sch

    huge = tiled("n rc ry rx f y x")  # 16 x 10 x 10 accumulators inside rx
    small = tiled("n f y rc ry rx x")  # 10 accumulators: 2 vectors of 8
    assert register_tile(huge, "conv2d_nchw", CHIP.lanes()) == 200
    assert register_tile(small, "conv2d_nchw", CHIP.lanes()) == 2
    assert not check.apply(huge)
    assert check.apply(small)
    assert check.counter.counts == {"conv": 1}


def test_register_budget_uses_the_static_estimate_in_the_blocked_space():
    """Our space for a blocked conv: a sampled tile whose live registers exceed the budget is
    discarded, one that fits is kept, and the tile read back is the one the trace sampled."""
    mod, _ = conv_module(cin=16, cout=32, hw=16)
    with CHIP.target:
        workload = next(iter(kernels(fused(mod)).values()))
    ctx = ms.TuneContext(mod=workload, target=CHIP.target, task_name="conv")
    check = RegisterBudget(CHIP)
    check._initialize_with_tune_context(ctx)
    anchor = schedules.analyze(ctx.mod["main"])
    assert anchor.blocked

    def sampled(blocks, cols):
        space = schedules.design_spaces(s_tir.Schedule(ctx.mod), CHIP)[0]
        trace = space.trace
        insts = [i for i in trace.insts if i.kind.name == "SamplePerfectTile"]
        decided = trace.with_decision(insts[0], [4 // blocks, blocks], True)
        decided = decided.with_decision(insts[1], [16 // cols, cols], True)
        sch = s_tir.Schedule(ctx.mod)
        decided.apply_to_schedule(sch, remove_postproc=False)
        return sch

    big, fits = sampled(4, 16), sampled(2, 4)
    assert schedules.sampled_tile(big, anchor, CHIP).accumulators == 64
    assert schedules.sampled_tile(fits, anchor, CHIP).accumulators == 8
    assert not check.apply(big)
    assert check.apply(fits)
    assert check.counter.counts == {"conv": 1}


def test_rerun_resumes_without_measuring_again(tuned, tmp_path, capsys):
    _, _, fmod, work_dir = tuned
    copy = tmp_path / "db"
    shutil.copytree(work_dir, copy, ignore=shutil.ignore_patterns("logs", ".tune.lock"))
    runner = CountingRunner()
    tune(fmod, CHIP, copy, max_trials=TRIALS, quiet=True, runner=runner, **SMALL)
    assert runner.measured == []  # all 8 trials are already recorded
    assert capsys.readouterr().out == ""  # quiet
    before = lines(copy / RECORD_FILE)
    tune(fmod, CHIP, copy, max_trials=TRIALS + 2, runner=runner, builder=InProcessBuilder(),
         **{**SMALL, "num_trials_per_iter": 2})
    assert sum(runner.measured) == 2
    after = lines(copy / RECORD_FILE)
    assert after[:TRIALS] == before and len(after) == TRIALS + 2
    out = capsys.readouterr().out
    assert "8 trials already" in out and "trials 10/10" in out and "ETA" in out
    # None of the new records repeats a schedule that was already measured.
    db = load_database(copy)
    mods = []
    for record in db.get_all_tuning_records():
        sch = s_tir.Schedule(record.workload.mod)
        record.trace.apply_to_schedule(sch, remove_postproc=False)
        mods.append(tvm_ffi.structural_hash(sch.mod))
    assert not set(mods[TRIALS:]) & set(mods[:TRIALS])


def test_corrupt_line_names_file_and_line(tuned, tmp_path):
    _, _, fmod, work_dir = tuned
    shutil.copytree(work_dir, tmp_path / "db", ignore=shutil.ignore_patterns("logs"))
    path = tmp_path / "db" / RECORD_FILE
    text = lines(path)
    text[2] = text[2][: len(text[2]) // 2] + "}garbage"
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(DatabaseError, match=rf"{RECORD_FILE}:3: ") as err:
        load_database(tmp_path / "db")
    assert err.value.line == 3 and err.value.path == str(path)
    with pytest.raises(DatabaseError, match=":3: "):
        build(fmod, CHIP, work_dir=tmp_path / "db")
    # Valid JSON, but not a tuning record.
    text[2] = json.dumps([0, ["not a trace"]])
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(DatabaseError, match=":3: not a MetaSchedule entry"):
        load_database(tmp_path / "db")


def test_truncated_last_line_is_skipped_with_a_warning(tuned, tmp_path):
    _, _, _, work_dir = tuned
    shutil.copytree(work_dir, tmp_path / "db", ignore=shutil.ignore_patterns("logs"))
    path = tmp_path / "db" / RECORD_FILE
    last = lines(path)[-1]
    with open(path, "a") as f:
        f.write(last[: len(last) // 2])  # what a kill in the middle of a write leaves
    with pytest.warns(UserWarning, match=rf"{RECORD_FILE}:{TRIALS + 1}: truncated"):
        db = load_database(tmp_path / "db")
    assert len(db.get_all_tuning_records()) == TRIALS
    with pytest.warns(UserWarning, match="truncated"):
        load_database(tmp_path / "db", repair=True)
    assert path.read_text().endswith("\n") and len(lines(path)) == TRIALS


def test_second_run_on_the_same_directory_is_refused(tmp_path):
    fmod = fused(conv_module()[0])
    with work_dir_lock(tmp_path), pytest.raises(TuningLockedError, match="being tuned"):
        tune(fmod, CHIP, tmp_path, max_trials=4, quiet=True, **SMALL)


@pytest.mark.parametrize("chip", ["aarch64", "avx512"])
def test_chip_that_cannot_run_here_needs_an_rpc_runner(tmp_path, chip):
    if chips.get(chip).runs_here:
        pytest.skip(f"{chip} runs here")
    fmod = fused(conv_module()[0])
    with pytest.raises(TuningError, match="cannot run on this host"):
        tune(fmod, chip, tmp_path, max_trials=4, quiet=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_run_leaves_a_database_that_loads(tmp_path, sig):
    # SIGKILL: with MetaSchedule's LocalBuilder (worker processes); SIGINT: building in process.
    builder = "None" if sig == signal.SIGKILL else "InProcessBuilder()"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_tuning import conv_module, fused, SMALL, CHIP
        from tvm_bnfold.tuning import InProcessBuilder, tune
        mod, _ = conv_module(seed=2)
        tune(fused(mod), CHIP, {str(tmp_path)!r}, max_trials=400, quiet=True,
             builder={builder}, **SMALL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                            stderr=subprocess.PIPE, text=True)
    path = tmp_path / RECORD_FILE
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and len(lines(path)) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the tuning run ended before it could be interrupted"
        assert path.exists() and len(lines(path)) >= 2, "no records within 4 minutes"
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if sig == signal.SIGINT:  # stops after committing the batch in flight, and says so
        assert proc.returncode != 0 and "tuning interrupted" in err
        assert f"holds {len(lines(path))} trials" in err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a truncated last line, if the kill cut one
        db = load_database(tmp_path, repair=True)
    assert len(db.get_all_tuning_records()) >= 2
    with work_dir_lock(tmp_path):  # the interrupted run's lock is gone with it
        pass
