"""rpc: tracker address checks, make_runner on a loopback fleet (a tracker and two servers, real
TVM RPC subprocesses), tuning over RPC, and what a run does when a server is killed or hangs.

The fleet is shared by the module; the last two tests break servers on purpose and start
replacements when they need two live servers."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.s_tir import meta_schedule as ms
from tvm.support.tar import tar

from _util import function, tensor_var
from tvm_bnfold import FuseEpilogue, chips, rpc
from tvm_bnfold.rpc import RPCFleetError

CHIP = chips.get("avx2")
pytestmark = pytest.mark.skipif(not CHIP.runs_here, reason="avx2 does not run here")
FAILED = 1e10  # MetaSchedule's run_secs for a candidate that failed to build or run


def _matmul(n: int = 64) -> tvm.tirx.PrimFunc:
    a = te.placeholder((n, n), name="A")
    b = te.placeholder((n, n), name="B")
    r = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    return te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")


def _builder() -> ms.builder.LocalBuilder:
    """LocalBuilder without MetaSchedule's import of every tensor intrinsic (over a minute here,
    in every fresh build worker); a nested function, so cloudpickle ships it by value."""

    def build(mod, target, _params):
        from tvm.driver import build as tvm_build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target)

    return ms.builder.LocalBuilder(f_build=build, max_workers=1)


def _unblock_metaschedule_logging() -> None:
    """pytest attaches unnamed capture handlers to every non-propagating logger, MetaSchedule's
    among them once it has set up logging in this process; its next logging setup then fails
    (``handler.get_name()`` is None). Drop them (this test's MetaSchedule log is not captured)."""
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in [h for h in ms_logger.handlers if h.get_name() is None]:
        ms_logger.removeHandler(handler)


def _evaluator(min_repeat_ms: int) -> ms.runner.EvaluatorConfig:
    return ms.runner.EvaluatorConfig(number=1, repeat=1, min_repeat_ms=min_repeat_ms)


def _live(fleet: rpc.LocalFleet, n: int = 2) -> list[int]:
    """Indices of the fleet's live servers, after starting new ones until there are ``n``."""
    while sum(p.poll() is None for p in fleet.servers) < n:
        fleet.add_server()
    return [i for i, p in enumerate(fleet.servers) if p.poll() is None]


def _sessions(fleet: rpc.LocalFleet, i: int) -> int:
    """How many modules server ``i`` has loaded: one per measurement session."""
    return fleet.log(i).count("load_module")


def _measuring(fleet: rpc.LocalFleet, i: int, after: int) -> bool:
    """Server ``i`` has loaded its ``after + 1``-th module and not finished that session yet."""
    lines = fleet.log(i).strip().splitlines()
    return _sessions(fleet, i) > after and bool(lines) and "load_module" in lines[-1]


def _records(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def _run_secs(line: str) -> list[float]:
    return json.loads(line)[1][1]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with rpc.LocalFleet(2, log_dir=tmp_path_factory.mktemp("fleet")) as local:
        yield local


@pytest.fixture(scope="module")
def matmul_input(tmp_path_factory) -> ms.runner.RunnerInput:
    """A built 64x64 matmul, exported the way MetaSchedule's builder does (tar)."""
    func = _matmul()
    path = tmp_path_factory.mktemp("artifact") / "matmul.tar"
    tvm.tirx.build(tvm.IRModule({"main": func}), target=CHIP.target).export_library(
        str(path), fcompile=tar)
    return ms.runner.RunnerInput(str(path), "cpu", ms.arg_info.ArgInfo.from_prim_func(func))


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:9190", ("127.0.0.1", 9190)),
    ("tracker.lan:1", ("tracker.lan", 1)),
    ("[::1]:9190", ("::1", 9190)),
])
def test_parse_tracker(text, expected):
    assert rpc.parse_tracker(text) == expected


@pytest.mark.parametrize("text", ["localhost", "host:", ":9190", "host:0", "host:65536",
                                  "host:91x0", "my host:9190", 9190])
def test_parse_tracker_rejects_malformed_addresses(text):
    with pytest.raises(RPCFleetError, match=f"RPC tracker address {text!r}"):
        rpc.parse_tracker(text)


@pytest.mark.parametrize("key", ["", "two words", "a:b"])
def test_make_runner_rejects_a_bad_key(key):
    with pytest.raises(RPCFleetError, match="RPC key"):
        rpc.make_runner("127.0.0.1:9190", key)


def test_unreachable_tracker_is_a_clear_error():
    port = rpc._free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RPCFleetError, match=f"no RPC tracker reachable at 127.0.0.1:{port}"):
        rpc.make_runner(f"127.0.0.1:{port}", "avx2")
    assert time.monotonic() - start < 10  # TVM's own connect retries for 60 s


def test_unknown_key_names_key_and_tracker(fleet):
    port = fleet.tracker.split(":")[1]
    with pytest.raises(RPCFleetError,
                       match=f"no RPC server registered under key 'nope' at 127.0.0.1:{port} "
                             rf"\(keys registered there: {fleet.key}\)"):
        rpc.make_runner(fleet.tracker, "nope")


def test_make_runner_measures_on_the_fleet(fleet, matmul_input):
    assert rpc.count_servers(fleet.tracker, fleet.key) == 2
    runner = rpc.make_runner(fleet.tracker, fleet.key, session_timeout_s=7,
                             evaluator_config=_evaluator(10))
    assert isinstance(runner, ms.runner.RPCRunner)
    config = runner.rpc_config
    assert (config.tracker_host, config.tracker_port, config.tracker_key) == (
        "127.0.0.1", int(fleet.tracker.split(":")[1]), fleet.key)
    assert config.session_timeout_sec == 7
    assert runner.pool._timeout == 14  # client-side bound: twice the session timeout
    results = [f.result() for f in runner.run([matmul_input] * 3)]
    assert [r.error_msg for r in results] == [None] * 3
    assert all(_sessions(fleet, i) for i in range(2))  # both servers measured
    assert all(0 < float(r.run_secs[0]) < 1 for r in results)


def test_tune_over_rpc(fleet, tmp_path):
    """tvm_bnfold.tuning.tune with rpc_tracker/rpc_key measures on the fleet."""
    from tvm_bnfold.tuning import RECORD_FILE, tune

    rng = np.random.default_rng(0)
    w = relax.const(rng.normal(0, 0.3, (8, 4, 3, 3)).astype("float32"))
    mod = function([tensor_var("x", (1, 4, 8, 8))],
                   lambda bb, x: relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(x, w, padding=1))))
    with CHIP.target:
        fused = FuseEpilogue(CHIP, measure=False)(mod)
    live = _live(fleet)
    served = sum(_sessions(fleet, i) for i in live)
    _unblock_metaschedule_logging()
    tune(fused, CHIP, tmp_path, max_trials=4, quiet=True, rpc_tracker=fleet.tracker,
         rpc_key=fleet.key, num_trials_per_iter=4, population_size=16, genetic_num_iters=1,
         seed=0)
    records = _records(tmp_path / RECORD_FILE)
    assert len(records) == 4
    assert all(_run_secs(r)[0] < FAILED for r in records)
    assert sum(_sessions(fleet, i) for i in live) - served >= 4  # all measured on the fleet


def test_tuning_survives_a_server_killed_mid_run(fleet, tmp_path):
    """tune_tir over RPC; once the first batch is in the database, server ``victim`` is killed
    while it measures. Tuning finishes on the others, every record written before the kill is
    still there, and the database loads."""
    live = _live(fleet)
    victim = live[0]
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    record_file = tmp_path / "database_tuning_record.json"
    before_kill: list[str] = []
    done = threading.Event()

    def kill_when_measuring():
        seen = None  # the victim's session count once the first batch is in the database
        while not done.is_set():
            if seen is None and len(_records(record_file)) >= 4:
                seen = _sessions(fleet, victim)
            if seen is not None and _measuring(fleet, victim, after=seen):
                before_kill.extend(_records(record_file))
                time.sleep(0.05)
                fleet.kill(victim)
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_when_measuring, daemon=True)
    watcher.start()
    _unblock_metaschedule_logging()
    try:
        ms.tir_integration.tune_tir(
            _matmul(), CHIP.target, str(tmp_path), max_trials_global=12, num_trials_per_iter=4,
            builder=_builder(), database=db, num_tuning_cores=1, seed=0,
            strategy="replay-trace", cost_model="random",  # cheap search: RPC is under test
            runner=rpc.make_runner(fleet.tracker, fleet.key, session_timeout_s=5,
                                   evaluator_config=_evaluator(500)))
    finally:
        done.set()
        watcher.join()
    assert before_kill, "the victim server never measured after the first batch"
    assert fleet.servers[victim].poll() is not None
    assert rpc.count_servers(fleet.tracker, fleet.key) == len(live) - 1

    after = _records(record_file)
    assert after[:len(before_kill)] == before_kill  # nothing written before the kill is lost
    assert len(after) == 12  # every candidate is committed, the one killed mid-run as failed
    late = [_run_secs(r)[0] for r in after[len(before_kill):]]
    assert sum(s >= FAILED for s in late) <= 1  # only the candidate on the victim fails
    assert sum(s < FAILED for s in late) >= 7  # the rest were measured by the survivors
    reloaded = ms.database.JSONDatabase(work_dir=str(tmp_path))
    assert len(reloaded) == 12
    best = reloaded.get_top_k(reloaded.commit_workload(tvm.IRModule({"main": _matmul()})), 1)
    assert best and float(best[0].run_secs[0]) < FAILED


def test_runner_reports_a_killed_and_a_hung_server_as_failed_runs(fleet, matmul_input):
    """Killed mid-measurement: that candidate fails (no retry), the other is measured.
    Hung (SIGSTOP, no TCP reset), then no server at all: the run fails after make_runner's
    client-side timeout instead of blocking forever."""
    live = _live(fleet)
    victim, survivor = live[:2]
    runner = rpc.make_runner(fleet.tracker, fleet.key, session_timeout_s=20,
                             evaluator_config=_evaluator(1500))
    seen = _sessions(fleet, victim)
    futures = runner.run([matmul_input] * len(live))
    deadline = time.monotonic() + 60
    while not _measuring(fleet, victim, after=seen):
        assert time.monotonic() < deadline, "the victim server never measured"
        time.sleep(0.005)
    time.sleep(0.3)
    fleet.kill(victim)
    results = [f.result() for f in futures]
    errors = [r.error_msg for r in results if r.error_msg]
    assert len(errors) == 1, "\n\n".join(errors)
    assert "RPCRunner: An exception occurred" in errors[0]
    assert sum(r.run_secs is not None for r in results) == len(live) - 1

    hung = _live(fleet, n=1)  # the survivor: stop every live server, so the next run hangs
    assert survivor in hung
    runner = rpc.make_runner(fleet.tracker, fleet.key, session_timeout_s=2, timeout_s=4,
                             evaluator_config=_evaluator(10))
    try:
        for i in hung:
            os.killpg(fleet.servers[i].pid, signal.SIGSTOP)
        start = time.monotonic()
        (result,) = [f.result() for f in runner.run([matmul_input])]
        assert result.run_secs is None and "Timeout" in result.error_msg
        assert time.monotonic() - start < 30  # 4 s once the pool worker has started
    finally:
        for i in hung:
            fleet.kill(i)
    fleet.wait_for_servers(0)  # no server left: the request waits at the tracker, then fails
    (result,) = [f.result() for f in runner.run([matmul_input])]
    assert result.run_secs is None and "Timeout" in result.error_msg
