"""The tvm-bnfold command: help, one-line user errors, fold, compile (.so loads and runs), demo,
bench and tune, all on a tiny ONNX model."""

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

import tvm_bnfold
from _util import assert_close
from test_report import tiny_model
from tvm_bnfold import bench, cli
from tvm_bnfold.models import load_onnx, random_inputs

COMMANDS = ("fold", "compile", "tune", "bench", "report", "demo")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cli") / "tiny.onnx"
    onnx.save(tiny_model(), path)
    return str(path)


def test_help_explains_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for command in COMMANDS:
        assert command in text
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        assert f"usage: tvm-bnfold {command}" in text
        assert "MODEL" in text or command == "report"


def _env() -> dict:
    """The package importable by a child process, whether or not it is pip-installed."""
    package_root = str(Path(tvm_bnfold.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}


def _user_error_cases(tiny: str, tmp_path: Path) -> dict[tuple, str]:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07this is not protobuf\xff\xff")
    return {
        ("fold", str(tmp_path / "missing.onnx")): "unknown model",
        ("fold", "resnet51"): "not a built-in model",
        ("fold", str(bad)): "is not an ONNX model",
        ("bench", tiny, "--chip", "z80"): "unknown chip 'z80'",
        ("bench", tiny, "--chip", "aarch64"): "cannot run on this machine",
        ("report", "--chips", "avx2,z80", "--models", tiny, "--out", str(tmp_path)):
            "unknown chip 'z80'",
        ("compile", tiny): "the following arguments are required: -o/--output",
        ("compile", tiny, "--chip", "avx2", "-o", str(tmp_path / "no/dir/m.so")):
            "output directory does not exist",
        ("tune", tiny, "--chip", "avx2", "--trials", "0"): "--trials must be > 0",
        ("tune", tiny, "--chip", "avx2", "--trials", "8", "--rpc-tracker", "localhost"):
            "--rpc-tracker and --rpc-key go together",
    }


def _check_one_line(args, code, out: str, err: str, expected: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (args, err)
    assert len(lines) == 1 and lines[0].startswith("tvm-bnfold"), (args, err)
    assert expected in lines[0], (args, err)
    assert "Traceback" not in err and out == ""


def test_user_errors_are_one_line(tiny, tmp_path, capsys):
    for args, expected in _user_error_cases(tiny, tmp_path).items():
        try:
            code = cli.main(list(args))
        except SystemExit as exit_:  # argparse
            code = exit_.code
        _check_one_line(args, code, *capsys.readouterr(), expected)


def test_user_errors_exit_the_process_without_traceback(tiny, tmp_path):
    """As a real process (a few cases: each child imports TVM)."""
    cases = dict(list(_user_error_cases(tiny, tmp_path).items())[2:5])
    procs = {
        args: subprocess.Popen([sys.executable, "-m", "tvm_bnfold.cli", *args], env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in cases
    }
    for args, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        _check_one_line(args, proc.returncode, out, err, cases[args])


def test_fold_prints_each_batchnorm_and_a_summary(tiny, capsys):
    assert cli.main(["fold", tiny]) == 0
    out = capsys.readouterr().out
    assert out.count("folded into") == 2
    assert "2 BatchNorms: 2 folded" in out


def test_compile_writes_a_library_that_loads_and_runs(tiny, tmp_path, capsys):
    so = tmp_path / "model.so"
    assert cli.main(["compile", tiny, "--chip", "avx2", "-o", str(so)]) == 0
    assert "4 kernels" in capsys.readouterr().out  # 2 convs blocked by 8, GAP, Gemm
    mod = load_onnx(tiny)
    inputs = list(random_inputs(mod).values())
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(so)), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()
    assert_close(out, bench.run_once(mod, inputs))


def _conv_sigmoid(path: Path) -> str:
    """data (1, 3, 8, 8) -> Conv (8 filters) -> Sigmoid, saved to ``path``."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(
        np.random.default_rng(0).normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["data", "w"], ["c"], pads=[1] * 4),
         helper.make_node("Sigmoid", ["c"], ["out"])], "conv_sigmoid",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8, 8, 8])], initializer=[w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return str(path)


def test_compile_with_fast_math_stays_within_the_tolerance(tmp_path, capsys):
    model, so = _conv_sigmoid(tmp_path / "cs.onnx"), tmp_path / "cs.so"
    chip = next(n for n in ("avx512", "avx2") if tvm_bnfold.chips.PRESETS[n].runs_here)
    assert cli.main(["compile", model, "--chip", chip, "-o", str(so), "--fast-math"]) == 0
    assert "fast math" in capsys.readouterr().out
    mod = load_onnx(model)
    inputs = list(random_inputs(mod).values())
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(so)), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()
    assert_close(out, bench.run_once(mod, inputs))


def test_compile_defaults_to_this_machine_and_loads_on_every_core(tiny, tmp_path, capsys):
    so = tmp_path / "host.so"
    assert cli.main(["compile", tiny, "-o", str(so)]) == 0
    host = tvm_bnfold.chips.host_chip()
    assert f"wrote {so} ({host.name}, " in capsys.readouterr().out
    model = tvm_bnfold.load(so)
    assert model.threads == tvm_bnfold.chips.usable_cores()
    mod = load_onnx(tiny)
    inputs = list(random_inputs(mod).values())
    assert_close(model(*inputs), bench.run_once(mod, inputs))


def test_compile_for_aarch64_cross_compiles_or_names_the_missing_compiler(tiny, tmp_path, capsys):
    so = tmp_path / "arm.so"
    code = cli.main(["compile", tiny, "--chip", "aarch64", "-o", str(so)])
    out, err = capsys.readouterr()
    if shutil.which("aarch64-linux-gnu-g++"):
        assert code == 0, err
        header = so.read_bytes()[:20]
        assert header[:4] == b"\x7fELF"
        assert int.from_bytes(header[18:20], "little") == 183  # e_machine: AArch64
        assert "does not run on this machine" in out
    else:
        assert code == 2 and "aarch64-linux-gnu-g++" in err and not so.exists()


def test_demo_prints_the_summary_and_writes_a_report(tiny, tmp_path, capsys):
    out_dir = tmp_path / "demo"
    assert cli.main(["demo", "--model", tiny, "--chip", "avx2", "--out", str(out_dir),
                     "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "tiny: 2 BatchNorms: 2 folded" in out
    assert "BatchNorms: 2 -> 0" in out
    assert "kernels: 10 -> 4" in out
    error = float(out.split("max abs error vs unfused: ")[1].split()[0])
    assert error < 1e-4
    for name in ("report.md", "report.html", "kernels.png", "latency_tiny.png"):
        assert (out_dir / name).is_file()


def test_bench_times_every_variant_and_the_peak(tiny, capsys):
    assert cli.main(["bench", tiny, "--chip", "avx2", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    for variant in ("unfused", "stock", "foldbn", "ours", "onnxruntime"):
        assert f" {variant} " in out
    if tvm_bnfold.chips.usable_cores() > 1:  # ours and ONNX Runtime beside a busy core too
        assert any("contended ms" in ln for ln in out.splitlines())
        column = 3 + [key for key, _, _ in bench.COLUMNS].index("contended_ms")
        for variant in ("ours", "onnxruntime"):
            (row,) = [ln.split() for ln in out.splitlines() if f" {variant} " in ln]
            assert float(row[column]) > 0, row  # model, chip, variant, then one cell a column
    peak = float(out.split(f"{bench.PEAK_LABEL}): ")[1].split()[0])
    assert peak > 0
    assert "of the sgemm peak" in out
    fma = float(out.split(f"FMA peak of avx2 ({bench.FMA_LABEL}): ")[1].split()[0])
    assert fma > 0
    assert "of the FMA peak" in out


def test_tune_then_compile_uses_the_database(tiny, tmp_path, monkeypatch, capsys):
    from tvm_bnfold import tuning as tune
    monkeypatch.setattr(tune, "TUNING_LOGS", tmp_path / "logs")
    # A small real search (the defaults search 512 candidates x 4 generations per batch).
    monkeypatch.setattr(tune, "tune", functools.partial(
        tune.tune, population_size=16, genetic_num_iters=1, num_trials_per_iter=2))
    assert cli.main(["tune", tiny, "--chip", "avx2", "--trials", "2", "--quiet"]) == 0
    work_dir = tmp_path / "logs" / "avx2" / "tiny"
    assert (work_dir / "database_tuning_record.json").is_file()
    capsys.readouterr()
    so = tmp_path / "tuned.so"
    assert cli.main(["compile", tiny, "--chip", "avx2", "-o", str(so)]) == 0
    assert f"tuned schedules from {work_dir}" in capsys.readouterr().out
    mod = load_onnx(tiny)
    inputs = list(random_inputs(mod).values())
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(so)), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()
    np.testing.assert_allclose(out, bench.run_once(mod, inputs), rtol=1e-5, atol=1e-5)


def test_tune_stock_tunes_the_stock_graph_beside_ours(tiny, tmp_path, monkeypatch):
    """--stock: the stock-TVM-fused kernels (the BatchNorm decomposed in their epilogues) go
    to <model>-stock, the baseline make bench compares the tuned build against."""
    from tvm_bnfold import tuning as tune
    monkeypatch.setattr(tune, "TUNING_LOGS", tmp_path / "logs")
    monkeypatch.setattr(tune, "tune", functools.partial(
        tune.tune, population_size=16, genetic_num_iters=1, num_trials_per_iter=2))
    assert cli.main(["tune", tiny, "--chip", "avx2", "--trials", "6", "--quiet", "--stock"]) == 0
    lines = (tmp_path / "logs" / "avx2" / "tiny-stock" / tune.WORKLOAD_FILE).read_text()
    scripts = [ms.database.Workload.from_json(json.loads(line)).mod.script()
               for line in lines.splitlines()]
    convs = [t for t in scripts if "conv2d_nchw" in t]
    assert len(convs) == 2 and not any("NCHWc" in t for t in scripts)
    assert all("T_subtract" in t for t in convs)  # the BatchNorm, decomposed in the epilogue
