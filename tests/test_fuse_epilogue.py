"""FuseEpilogue: one kernel per conv with its epilogue, numerics vs the unfused module compiled by
TVM, the register-pressure check, and the cases that must stay correct."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from _util import assert_close, function, run, tensor_var
from tvm_bnfold import BNFoldError, FoldBN, FuseEpilogue, chips, schedules
from tvm_bnfold.bench import kernel_count, layout_kernel_count
from tvm_bnfold.fuse_epilogue import FAST_MATH, choose_schedule, fuse_graph

R = relax.op


def _s(v: float) -> relax.Expr:
    return relax.const(np.float32(v))


# Activations as Relax ops and as the ONNX importer writes them out.
ACTIVATIONS = {
    "relu": lambda bb, y: R.nn.relu(y),
    "relu6": lambda bb, y: R.clip(y, 0, 6),
    "clip_max_min": lambda bb, y: R.minimum(bb.emit(R.maximum(y, _s(0))), _s(6)),
    "leaky_relu": lambda bb, y: R.nn.leakyrelu(y, 0.1),
    "hardsigmoid": lambda bb, y: R.clip(
        bb.emit(R.add(bb.emit(R.multiply(y, _s(1 / 6))), _s(0.5))), 0, 1),
    "hardswish_div": lambda bb, y: R.divide(
        bb.emit(R.multiply(y, bb.emit(R.clip(bb.emit(R.add(y, _s(3))), 0, 6)))), _s(6)),
    "hardswish_mul": lambda bb, y: R.multiply(
        bb.emit(R.multiply(y, bb.emit(R.clip(bb.emit(R.add(y, _s(3))), 0, 6)))), _s(1 / 6)),
    "sigmoid": lambda bb, y: R.sigmoid(y),
    "silu": lambda bb, y: R.multiply(y, bb.emit(R.sigmoid(y))),
    "gelu": lambda bb, y: R.nn.gelu(y),
    "tanh": lambda bb, y: R.tanh(y),
}


def conv_act_module(act, residual=False, shape=(1, 8, 10, 10), cout=16, stride=1, seed=0):
    """x -> conv3x3 -> + bias [-> + relu(x-sized residual)] -> act."""
    rng = np.random.default_rng(seed)
    w = relax.const(rng.normal(0, 0.3, (cout, shape[1], 3, 3)).astype("float32"))
    b = relax.const(rng.normal(0, 0.5, (1, cout, 1, 1)).astype("float32"))
    out_hw = (shape[2] - 1) // stride + 1
    params = [tensor_var("x", shape)]
    if residual:
        params.append(tensor_var("r", (1, cout, out_hw, out_hw)))

    def body(bb, x, *res):
        y = bb.emit(R.add(bb.emit(R.nn.conv2d(x, w, strides=stride, padding=1)), b))
        if residual:
            y = bb.emit(R.add(y, res[0]))
        return act(bb, y)

    inputs = [rng.normal(size=[int(d) for d in p.ty.shape.values]).astype("float32")
              for p in params]
    return function(params, body), inputs


def _fuse(mod, chip="avx512"):
    fuse = FuseEpilogue()
    with chips.target(chip):
        out = fuse(mod)
    return out, fuse.report


# LLVM has no vector exp here: exp/tanh become scalar libm calls, and every call spills the
# vector registers (measured). The check must see that and keep those epilogues off the tile.
LIBM_ACTIVATIONS = {"sigmoid", "silu", "tanh"}


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_every_activation_becomes_one_kernel(act):
    mod, inputs = conv_act_module(ACTIVATIONS[act])
    out, report = _fuse(mod)
    assert kernel_count(out) == 1
    (record,) = report
    if act in LIBM_ACTIVATIONS:
        assert record.decision == "separate"
        assert any("spill moves" in r for r in record.rejected)
    else:
        assert record.decision in ("register", "cache") and record.spill_moves == 0
    assert_close(run(out, *inputs), run(mod, *inputs))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("act", sorted(LIBM_ACTIVATIONS))
def test_fast_math_puts_exp_and_tanh_epilogues_on_the_register_tile(act, residual):
    """With 32 vector registers the polynomial exp / tanh fit beside the tile: no spills."""
    mod, inputs = conv_act_module(ACTIVATIONS[act], residual=residual)
    fuse = FuseEpilogue(fast_math=True)
    with chips.target("avx512"):
        out = fuse(mod)
    (record,) = fuse.report
    assert kernel_count(out) == 1
    assert record.decision == "register" and record.spill_moves == 0, record
    assert_close(run(out, *inputs), run(mod, *inputs))


@pytest.mark.parametrize("act", sorted(LIBM_ACTIVATIONS))
def test_fast_math_on_avx2_is_still_checked_and_correct(act):
    """avx2's 16 registers do not hold the polynomial's constants beside a tile: the check
    keeps the epilogue off the register tile (on the stored tile or in its own loop), and does
    not shrink the tile to a few accumulators to fit it there."""
    mod, inputs = conv_act_module(ACTIVATIONS[act])
    fuse = FuseEpilogue(fast_math=True)
    with chips.target("avx2"):
        out = fuse(mod)
    (record,) = fuse.report
    assert record.decision in ("cache", "separate") and record.rejected, record
    assert "rows=1, hrows=1," not in record.tile
    assert_close(run(out, *inputs), run(mod, *inputs))


def test_fast_math_sigmoid_and_tanh_match_float64_from_minus_to_plus_100():
    x = np.linspace(-100, 100, 20001).astype("float32")
    exact = {"relax.sigmoid": lambda v: 1 / (1 + np.exp(-v)), "relax.tanh": np.tanh}
    assert set(FAST_MATH) == set(exact)
    for name, ref in exact.items():
        bb = relax.BlockBuilder()
        xv = tensor_var("x", x.shape)
        with bb.function("main", [xv]):
            bb.emit_func_output(FAST_MATH[name](bb, relax.Call(tvm.ir.Op.get(name), [xv])))
        got = run(bb.get(), x).astype("float64")
        np.testing.assert_allclose(got, ref(x.astype("float64")), rtol=2e-6, atol=1e-7,
                                   err_msg=name)


@pytest.mark.parametrize("chip", ["avx512", "avx2"])
@pytest.mark.parametrize("stride", [1, 2])
def test_residual_add_then_relu_is_one_kernel(chip, stride):
    mod, inputs = conv_act_module(ACTIVATIONS["relu"], residual=True, stride=stride)
    out, report = _fuse(mod, chip)
    # On avx2 the 8-channel conv runs in the blocked layout, between layout transforms.
    assert kernel_count(out) - layout_kernel_count(out) == 1 and report[0].chip == chip
    assert_close(run(out, *inputs), run(mod, *inputs))


def test_intermediate_needed_elsewhere_stays_correct():
    """The conv+bias result feeds relu and is also returned: never dropped by the fusion."""
    rng = np.random.default_rng(1)
    w = relax.const(rng.normal(0, 0.3, (16, 8, 3, 3)).astype("float32"))

    def body(bb, x):
        y = bb.emit(R.nn.conv2d(x, w, padding=1))
        z = bb.emit(R.nn.relu(y))
        return relax.Tuple([bb.emit(R.nn.max_pool2d(z, 2, 2)), y])

    mod = function([tensor_var("x", (1, 8, 8, 8))], body)
    x = rng.normal(size=(1, 8, 8, 8)).astype("float32")
    out, _ = _fuse(mod)
    vm_out = _run_tuple(out, x)
    ref = _run_tuple(mod, x)
    for a, b in zip(vm_out, ref, strict=True):
        assert_close(a, b)


def _run_tuple(mod, x):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return [t.numpy() for t in vm["main"](tvm.runtime.tensor(x))]


def stem_pool_module(seed=0):
    """RGB x -> conv3x3 (3 -> 16) -> relu -> conv1x1 (16 -> 32) -> relu -> global mean ->
    flatten -> dense: a network's shape, whose blocked layout needs no layout transform."""
    rng = np.random.default_rng(seed)
    w1 = relax.const(rng.normal(0, 0.3, (16, 3, 3, 3)).astype("float32"))
    w2 = relax.const(rng.normal(0, 0.3, (32, 16, 1, 1)).astype("float32"))
    w3 = relax.const(rng.normal(0, 0.3, (32, 10)).astype("float32"))

    def body(bb, x):
        y = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(x, w1, padding=1))))
        y = bb.emit(R.nn.relu(bb.emit(R.nn.conv2d(y, w2))))
        y = bb.emit(R.reshape(bb.emit(R.mean(y, axis=[2, 3], keepdims=True)), (1, 32)))
        return R.matmul(y, w3)

    return function([tensor_var("x", (1, 3, 8, 8))], body), [
        rng.normal(size=(1, 3, 8, 8)).astype("float32")]


def _names(mod) -> list[str]:
    return [g.name_hint for g, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]


@pytest.mark.parametrize(("chip", "blocked"), [("avx512", True), ("avx2", True),
                                               ("aarch64", True), ("cuda-sm80", False)])
def test_the_blocked_layout_is_the_default_on_cpu_chips(chip, blocked):
    mod, _ = stem_pool_module()
    out, _ = _fuse(mod, chip)
    assert any("NCHWc" in n for n in _names(out)) == blocked
    assert layout_kernel_count(out) == 0  # the 1x1 map back to NCHW is a reshape


def test_the_default_keeps_nchw_where_blocking_adds_kernels():
    """A lone conv between NCHW input and output: blocked, it would need a layout transform
    at each end (3 kernels instead of 1). blocked=True still blocks it."""
    mod, inputs = conv_act_module(ACTIVATIONS["relu"], shape=(1, 16, 8, 8), cout=32)
    fuse = FuseEpilogue()
    with chips.target("avx2"):
        out = fuse(mod)
        forced = FuseEpilogue(blocked=True)(mod)
    assert not any("NCHWc" in n for n in _names(out)) and kernel_count(out) == 1
    assert "blocked layout not kept: 3 kernels, 1 in NCHW" in [str(r) for r in fuse.layout_report]
    assert any("NCHWc" in n for n in _names(forced)) and kernel_count(forced) == 3
    assert_close(run(out, *inputs), run(mod, *inputs))


def test_without_a_target_is_a_clear_error():
    mod, _ = conv_act_module(ACTIVATIONS["relu"])
    with pytest.raises(BNFoldError, match="no target"):
        FuseEpilogue()(mod)


def test_oversized_register_tile_is_rejected_on_avx2_with_the_counts():
    mod, _ = conv_act_module(ACTIVATIONS["relu"], shape=(1, 16, 16, 16), cout=64)
    chip = chips.get("avx2")
    fused = fuse_graph(mod)
    (gvar,) = [g for g, f in fused.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    func = fused[gvar]
    anchor = schedules.analyze(func)
    tiles = schedules.candidate_tiles(anchor, chip)
    huge = max((t for t in schedules.candidate_tiles(anchor, chips.get("avx512"))),
               key=lambda t: t.accumulators)
    _, record = choose_schedule(func, anchor, chip, tiles=[huge, *tiles])
    need = schedules.live_vector_registers(anchor, huge, chip)
    assert need > record.budget
    assert f"{need} live vector registers > {record.budget} on avx2" in record.rejected[0]
    assert record.decision in ("register", "cache") and record.spill_moves == 0


@pytest.mark.parametrize("fast_math", [False, True])
def test_a_separate_epilogue_leaves_the_conv_a_full_tile(fast_math):
    """When the epilogue cannot share the register tile (libm calls, or the polynomial's
    constants on avx2's 16 registers), the conv still gets a multi-accumulator tile, not the
    smallest one: the epilogue's registers are not live in the conv's loop. libm's calls spill
    the stored tile too (separate); the polynomial spills it per tile at most, outside the
    reduction, which the check does not count (cache), or separate."""
    mod, inputs = conv_act_module(ACTIVATIONS["silu"], shape=(1, 16, 16, 16), cout=32)
    fuse = FuseEpilogue(fast_math=fast_math, blocked=True)
    with chips.target("avx2"):
        out = fuse(mod)
    (record,) = fuse.report
    smallest = str(schedules.Tile(vec=8, rows=1, hrows=1, lanes=8))
    levels = ("cache", "separate") if fast_math else ("separate",)
    assert record.decision in levels and record.tile.split(", block_rows")[0] != \
        smallest.split(", block_rows")[0], record
    assert record.registers <= record.budget
    assert_close(run(out, *inputs), run(mod, *inputs))


def test_folded_small_model_commits_only_spill_free_kernels():
    from tvm_bnfold import load_onnx
    from tvm_bnfold.models import mobilenetv2, random_inputs

    mod = FoldBN()(load_onnx(mobilenetv2(), shapes={"data": (1, 3, 32, 32)}))
    out, report = _fuse(mod, "avx2")
    committed = [r for r in report if r.decision in ("register", "cache")]
    assert committed and all(r.spill_moves == 0 for r in committed)
    assert kernel_count(out) - layout_kernel_count(out) == 54  # 52 convs, mean, fc (+ a view)
    inputs = list(random_inputs(mod).values())
    assert_close(run(out, *inputs), run(mod, *inputs))


@pytest.mark.parametrize("chip", ["cuda-sm80", "cuda-sm90"])
def test_cuda_kernels_report_ptxas_registers(chip):
    from tvm_bnfold.register_pressure import ToolMissing, find_nvcc

    try:
        find_nvcc()
    except ToolMissing as err:
        pytest.skip(f"CUDA toolkit absent: {err}")
    mod, _ = conv_act_module(ACTIVATIONS["silu"], residual=True)
    out, report = _fuse(mod, chip)
    (record,) = report
    assert kernel_count(out) == 1
    assert 0 < record.registers <= 255 and record.spill_bytes == 0
    tvm.compile(out, target=chips.target(chip))  # CUDA code generation needs no GPU


def test_spill_verdicts_measured_on_several_threads_are_the_ones_measured_in_turn(
        monkeypatch, tmp_path):
    """FuseEpilogue measures its kernels on a thread per usable core: the same verdicts, records
    and kernels as one thread, each kernel measured in the caller's PassContext."""
    import threading

    from tvm_bnfold import load_onnx, register_pressure
    from tvm_bnfold.models import mobilenetv2

    mod = FoldBN()(load_onnx(mobilenetv2(), shapes={"data": (1, 3, 32, 32)}))
    measure_cpu, seen = register_pressure.measure_cpu, []

    def recording(func, chip):
        ctx = tvm.transform.PassContext.current()
        seen.append((threading.current_thread().name,
                     ctx.config.get("relax.backend.use_cuda_graph")))
        return measure_cpu(func, chip)

    monkeypatch.setattr(register_pressure, "measure_cpu", recording)
    results = {}
    for cores in (1, 2):
        monkeypatch.setattr(chips, "usable_cores", lambda cores=cores: cores)
        monkeypatch.setattr(register_pressure, "SPILLS",
                            register_pressure.SpillCache(tmp_path / str(cores)))
        seen.clear()
        with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": False}):
            results[cores] = _fuse(mod, "avx2")
        threads = {name for name, _ in seen}
        assert len(seen) >= 2, seen
        assert all(name.startswith("bnfold-spills") for name in threads) == (cores == 2), threads
        assert all(mark is not None for _, mark in seen)  # the caller's context, in every thread
    (one, one_report), (two, two_report) = results[1], results[2]
    assert [str(r) for r in one_report] == [str(r) for r in two_report]
    tvm.ir.assert_structural_equal(one, two)


def test_a_libm_epilogue_whose_smallest_tile_spills_tries_no_larger_tile(monkeypatch, tmp_path):
    """An exact sigmoid calls libm, which keeps no vector register: when the smallest tile
    spills on both levels, the walk skips the larger tiles and decides what the whole walk
    decides, in fewer builds."""
    from tvm_bnfold import fuse_epilogue, register_pressure

    mod, _ = conv_act_module(ACTIVATIONS["silu"], shape=(1, 16, 14, 14), cout=32)
    measure_cpu, builds = register_pressure.measure_cpu, []
    monkeypatch.setattr(register_pressure, "measure_cpu",
                        lambda func, chip: builds.append(1) or measure_cpu(func, chip))
    found = {}
    for shortcut in (True, False):
        if not shortcut:
            monkeypatch.setattr(fuse_epilogue, "_calls_math", lambda func: False)
        monkeypatch.setattr(register_pressure, "SPILLS",
                            register_pressure.SpillCache(tmp_path / str(shortcut)))
        builds.clear()
        _, (record,) = _fuse(FoldBN()(mod), "avx2")
        found[shortcut] = (record.decision, record.tile, record.spill_moves, len(builds))
    assert found[True][0] == "separate"
    assert found[True][:3] == found[False][:3]
    assert found[True][3] < found[False][3], found
