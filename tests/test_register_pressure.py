"""Tests of register_pressure: asm spill counting, static budget/estimate, measured spills of
scheduled GEMM register tiles on CPU presets (native and cross) and, with nvcc, on CUDA."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tvm
from tvm import relax, s_tir, te

from tvm_bnfold import chips
from tvm_bnfold import register_pressure as rp
from tvm_bnfold.errors import BNFoldError


def _gemm(m: int, n: int, k: int) -> tvm.tirx.PrimFunc:
    a = te.placeholder((m, k), name="A")
    b = te.placeholder((k, n), name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    return te.create_prim_func([a, b, c])


def _cpu_tile(chip: str, rows: int, vecs: int) -> tvm.tirx.PrimFunc:
    """GEMM with a ``rows x vecs`` register tile of vector accumulators (``rows * vecs`` of them):
    cache_write to "local", the tile loops unrolled, the innermost axis vectorized."""
    lanes = chips.get(chip).lanes("float32")
    sch = s_tir.Schedule(_gemm(64, 2 * vecs * lanes, 64))
    block = sch.get_sblock("C")
    write_back = sch.cache_write(block, 0, "local")
    i, j, k = sch.get_loops(block)
    io, ii = sch.split(i, [None, rows])
    jo, jn, jv = sch.split(j, [None, vecs, lanes])
    sch.reorder(io, jo, k, ii, jn, jv)
    sch.reverse_compute_at(write_back, jo)
    sch.unroll(ii)
    sch.unroll(jn)
    sch.vectorize(jv)
    sch.vectorize(sch.get_loops(write_back)[-1])
    sch.parallel(io)
    sch.decompose_reduction(block, k)
    return sch.mod["main"]


def _gpu_tile(rows: int, cols: int, threads: int = 32) -> tvm.tirx.PrimFunc:
    """GEMM where each CUDA thread keeps a ``rows x cols`` tile of scalar accumulators."""
    sch = s_tir.Schedule(_gemm(rows * threads, cols * 4, 64))
    block = sch.get_sblock("C")
    write_back = sch.cache_write(block, 0, "local")
    i, j, k = sch.get_loops(block)
    bi, ti, ii = sch.split(i, [None, threads, rows])
    bj, jj = sch.split(j, [None, cols])
    sch.reorder(bi, bj, ti, k, ii, jj)
    sch.bind(bi, "blockIdx.x")
    sch.bind(bj, "blockIdx.y")
    sch.bind(ti, "threadIdx.x")
    sch.reverse_compute_at(write_back, ti)
    sch.unroll(ii)
    sch.unroll(jj)
    sch.decompose_reduction(block, k)
    return sch.mod["main"]


# count_vector_spills / vector_registers_used on hand-written asm --------------------------

X86_SPILLS = """\
\tvmovaps\t%zmm3, -64(%rsp)
\tvmovups\t128(%rsp), %ymm2
\tvmovss\t%xmm0, -12(%rbp)
\tvmovups\t%zmm1, (%rsp)
\tvmovdqu64\t%zmm7, 256(%rsp,%rax)
\tmovaps\t%xmm5, 16(%rsp)
"""

X86_NOT_SPILLS = """\
# vmovaps %zmm0, (%rsp)   a comment line
\tvmovaps\t%zmm1, %zmm2
\tvmovups\t(%rax), %zmm0
\tvmovups\t%zmm0, 64(%rdi,%rcx,4)
\tmovq\t%rdx, 8(%rsp)
\tvfmadd231ps\t(%rsp), %zmm12, %zmm0
\tvbroadcastss\t4(%rsi), %zmm3
\tleaq\t8(%rsp), %rsi
\tsubq\t$16, %rsp
"""

A64_SPILLS = """\
\tstr\tq1, [sp, #16]
\tldr\tq0, [sp]
\tstp\tq1, q0, [sp, #368]
\tldur\tq4, [x29, #-32]
\tstr\ts3, [sp, #12]
\tst1\t{ v0.4s, v1.4s }, [sp]
"""

A64_NOT_SPILLS = """\
\tstp\td15, d14, [sp, #-112]!
\tstp\td9, d8, [sp, #48]
\tldp\td15, d14, [sp], #112
\tstp\tx29, x30, [sp, #64]
\tstr\tx30, [sp, #-48]!
\tldr\tq4, [x12], #64
\tldr\ts5, [x13, #256]
\tmov\tv27.16b, v26.16b
\tfmla\tv0.4s, v4.4s, v5.s[0]
\tmovi\tv2.2d, #0000000000000000
\tsub\tsp, sp, #848
"""


@pytest.mark.parametrize(
    ("spills", "others"), [(X86_SPILLS, X86_NOT_SPILLS), (A64_SPILLS, A64_NOT_SPILLS)]
)
def test_count_vector_spills_snippets(spills: str, others: str):
    n = len(spills.splitlines())
    assert rp.count_vector_spills(spills) == n
    assert rp.count_vector_spills(others) == 0
    assert rp.count_vector_spills(others + spills) == n


def test_count_skips_tvm_wrappers():
    """Stack stores in TVM's FFI wrappers / error helpers are argument marshalling, not spills;
    the kernel (``*_compute_``, parallel lambdas) is counted."""
    asm = """\
\t.type\t__tvm_ffi_main,@function
__tvm_ffi_main:
\tvmovdqu\t%xmm0, (%rsp)
\t.type\t__tvm_set_raised_12,@function
__tvm_set_raised_12:
\tvmovups\t%ymm0, 72(%rsp)
\t.type\tmain_compute_,@function
main_compute_:
\tvmovaps\t%zmm5, 64(%rsp)
.LBB3_2:
\tvmovaps\t64(%rsp), %zmm5
\t.type\t.L__tvm_parallel_lambda,@function
.L__tvm_parallel_lambda:
\tvmovups\t%zmm9, -128(%rsp)
"""
    assert rp.count_vector_spills(asm) == 3
    assert rp.vector_registers_used(asm) == 2  # zmm5, zmm9 (xmm0/ymm0 only in wrappers)


def _loop_nest(before: str, tile_loop: str, fma_loop: str) -> str:
    return (f"\t.type\tk_compute_,@function\nk_compute_:\n{before}.LBB4_5:\n{tile_loop}"
            f".LBB4_6:\n{fma_loop}\tvfmadd231ps\t%ymm1, %ymm0, %ymm4\n\tjne\t.LBB4_6\n"
            f"\tvmovaps\t%ymm4, (%r8)\n\tjne\t.LBB4_5\n")


def test_a_hoisted_loop_invariant_on_the_stack_is_not_a_spill():
    """A slot stored before a loop and only reloaded inside it (LLVM hoisted the tile loop's
    bias vectors) costs a load per use, as the unhoisted code would: not counted. A slot
    stored and reloaded in the loop of the FMAs is (under register pressure)."""
    store, load = "\tvmovups\t%ymm0, 144(%rsp)\n", "\tvmovups\t144(%rsp), %ymm2\n"
    assert rp.count_vector_spills(_loop_nest(store, load, "")) == 0
    assert rp.count_vector_spills(_loop_nest(store, "", load)) == 0
    assert rp.count_vector_spills(_loop_nest("", store, load)) == 0  # per tile, read per step
    assert rp.count_vector_spills(_loop_nest("", "", store + load)) == 2
    assert rp.count_vector_spills(_loop_nest(store, "", store + load)) == 3


def test_a_spill_outside_the_loop_of_the_fmas_counts_only_around_a_call():
    """Stored and reloaded once per tile, outside the reduction loop that holds the FMAs: a
    few moves beside the whole reduction, not counted. Around a libm call (an activation on
    the tile) every live vector spills on each call: counted, as in a kernel without FMAs."""
    store, load = "\tvmovups\t%ymm0, 144(%rsp)\n", "\tvmovups\t144(%rsp), %ymm2\n"
    assert rp.count_vector_spills(_loop_nest("", store + load, "")) == 0
    call = "\tcallq\texpf@PLT\n"
    assert rp.count_vector_spills(_loop_nest("", store + call + load, "")) == 2
    runtime = "\tcallq\t*(%rax)\n\tcallq\tmemset@PLT\n"  # workspace, a zeroed buffer
    assert rp.count_vector_spills(_loop_nest("", store + runtime + load, "")) == 0
    no_fma = _loop_nest("", store + load, "").replace("vfmadd231ps", "vaddps")
    assert rp.count_vector_spills(no_fma) == 2
    # An epilogue's multiply-add contracted to an FMA on the tile: the reduction loop, with
    # more FMAs, is still the hot one.
    fma = "\tvfmadd213ps\t%ymm5, %ymm6, %ymm4\n"
    assert rp.count_vector_spills(_loop_nest("", store + fma + load, fma + fma)) == 0
    assert rp.count_vector_spills(_loop_nest("", store + fma * 3 + load, "")) == 2
    # AArch64 likewise (a store st*, a load ld*, the slot its [sp...] operand).
    a64 = "\tstr\tq1, [sp, #16]\n", "\tldr\tq2, [sp, #16]\n"
    nest = _loop_nest(a64[0], "", a64[1]).replace("jne\t", "b.ne\t").replace(
        "vfmadd231ps\t%ymm1, %ymm0, %ymm4", "fmla\tv4.4s, v1.4s, v0.s[0]").replace(
        "vmovaps\t%ymm4, (%r8)", "str\tq4, [x8]")
    assert rp.count_vector_spills(nest) == 0
    # Another slot: the reload in the loop of the FMAs counts, the lone store before it not.
    assert rp.count_vector_spills(nest.replace("[sp, #16]\n.LBB4_5", "[sp, #32]\n.LBB4_5")) == 1


def test_rbp_is_a_stack_slot_only_in_functions_with_a_frame_pointer():
    """Without ``movq %rsp, %rbp`` LLVM uses rbp as an ordinary pointer register."""
    body = "\tvmovups\t%ymm1, (%rbp,%rbx,4)\n\tvmovups\t-32(%rbp), %ymm2\n"
    no_frame = "\t.type\tk_compute_,@function\nk_compute_:\n" + body
    frame = "\t.type\tk_compute_,@function\nk_compute_:\n\tmovq\t%rsp, %rbp\n" + body
    assert rp.count_vector_spills(no_frame) == 0
    assert rp.count_vector_spills(frame) == 2


def test_vector_registers_used():
    assert rp.vector_registers_used("\tvaddps\t%zmm17, %zmm3, %zmm3\n\tvmovss\t%xmm3, (%rdi)") == 2
    assert rp.vector_registers_used("\tfmla\tv3.4s, v4.4s, v5.s[0]\n\tldr\tq3, [x1]\n") == 3
    assert rp.vector_registers_used("\tmovq\t%rdx, 8(%rsp)\n") == 0


# static side ------------------------------------------------------------------------------


def test_static_budget():
    assert rp.static_budget(chips.get("avx512")) == 30
    assert rp.static_budget(chips.get("avx2")) == 14
    assert rp.static_budget(chips.get("aarch64")) == 30
    assert rp.static_budget(chips.get("cuda-sm80")) == 255 - rp.CUDA_RESERVE
    assert rp.static_budget(chips.get("cuda-sm80"), "float64") == (255 - rp.CUDA_RESERVE) // 2
    assert rp.static_budget(chips.get("avx2"), "float16") == 14


def test_estimate_live_vregs():
    assert rp.estimate_live_vregs(16, 1) == 19
    assert rp.estimate_live_vregs(16, 2, temporaries=5) == 23
    # Default temporaries = the CPU reserve: a tile filling static_budget fills the file.
    assert rp.estimate_live_vregs(rp.static_budget(chips.get("avx512")), 0) == 32
    with pytest.raises(BNFoldError, match="accumulators"):
        rp.estimate_live_vregs(-1, 0)


def test_spill_report_and_ptxas_parse():
    log = """\
ptxas info    : Compiling entry function 'main_kernel' for 'sm_80'
ptxas info    : Function properties for main_kernel
    5040 bytes stack frame, 5212 bytes spill stores, 5192 bytes spill loads
ptxas info    : Used 64 registers, used 0 barriers, 376 bytes cmem[0]
ptxas info    : Function properties for other_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 0 barriers, 376 bytes cmem[0]
"""
    assert rp.parse_ptxas_log(log) == (96, 5212 + 5192)
    assert rp.parse_ptxas_log("") == (None, 0)
    assert not rp.SpillReport("avx2", 10, 0, 0).spills
    assert rp.SpillReport("avx2", 16, 3, 0).spills
    assert rp.SpillReport("cuda-sm80", 255, 0, 8).spills


# measured on CPU presets ------------------------------------------------------------------
# Measured (LLVM of apache-tvm 0.27): this tile keeps ``rows*vecs`` accumulators plus ``vecs``
# weight vectors and one broadcast live, i.e. estimate_live_vregs(rows*vecs, 0, vecs + 1);
# it spills exactly when that exceeds the register file. Cases sit well clear of the boundary.


@pytest.mark.parametrize(
    ("chip", "rows", "vecs"),
    [
        ("avx512", 4, 1),
        ("avx512", 4, 4),
        ("avx512", 6, 4),
        ("avx2", 2, 2),
        ("avx2", 4, 2),
        ("aarch64", 4, 4),
    ],
)
def test_small_tile_does_not_spill(chip: str, rows: int, vecs: int):
    report = rp.measure(_cpu_tile(chip, rows, vecs), chips.get(chip))
    assert rp.estimate_live_vregs(rows * vecs, 0, vecs + 1) <= chips.get(chip).vector_regs - 2
    assert report.chip == chip
    assert report.spill_moves == 0 and report.spill_bytes == 0
    assert not report.spills
    assert rows * vecs < report.registers <= chips.get(chip).vector_regs


@pytest.mark.parametrize(
    ("chip", "rows", "vecs"),
    [("avx512", 8, 4), ("avx512", 8, 8), ("avx2", 4, 4), ("avx2", 8, 8), ("aarch64", 8, 8)],
)
def test_oversized_tile_spills(chip: str, rows: int, vecs: int):
    regs = chips.get(chip).vector_regs
    assert rp.estimate_live_vregs(rows * vecs, 0, vecs + 1) > regs + 2
    report = rp.measure(_cpu_tile(chip, rows, vecs), chips.get(chip))
    assert report.spills and report.spill_moves > 0
    assert regs - 2 <= report.registers <= regs


def test_aarch64_is_cross_compiled():
    """The aarch64 preset does not run here; measuring only generates its code."""
    chip = chips.get("aarch64")
    assert not chip.runs_here
    built = tvm.tirx.build(_cpu_tile("aarch64", 2, 2), chip.target)
    asm = rp.llvm_asm(built)
    assert "fmla" in asm and "%zmm" not in asm
    assert rp.count_vector_spills(asm) == 0
    assert rp.vector_registers_used(asm) > 4


def test_llvm_asm_of_compile_results():
    """``tvm.compile`` results (runtime Executable, Relax VMExecutable) hold their module in
    ``.mod``; the LLVM code is that module or one of its imports."""
    target = chips.get("avx2").target
    asm = rp.llvm_asm(tvm.compile(_cpu_tile("avx2", 2, 2), target))
    assert "%ymm" in asm and "main_compute_" in asm

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(relax.op.nn.relu(x)))
    asm = rp.llvm_asm(tvm.compile(bb.get(), target))
    assert "relu_compute_" in asm and rp.count_vector_spills(asm) == 0
    with pytest.raises(BNFoldError, match="not a built TVM module"):
        rp.llvm_asm(object())


def test_measure_rejects_wrong_kind():
    with pytest.raises(BNFoldError, match="cuda chip"):
        rp.measure_cpu(_cpu_tile("avx2", 2, 2), chips.get("cuda-sm80"))
    with pytest.raises(BNFoldError, match="cpu chip"):
        rp.measure_cuda(_cpu_tile("avx2", 2, 2), chips.get("avx2"))


# measured on CUDA (needs nvcc, not a GPU) -------------------------------------------------


def _have_nvcc() -> bool:
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").is_file()


needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc (CUDA toolkit) not installed")


@needs_nvcc
def test_cuda_small_tile_registers():
    report = rp.measure(_gpu_tile(2, 2), chips.get("cuda-sm80"))
    assert report.chip == "cuda-sm80"
    assert report.registers is not None and 0 < report.registers <= 255
    assert report.spill_bytes == 0 and not report.spills


@needs_nvcc
def test_cuda_oversized_tile_spills():
    """256 live accumulators per thread cannot fit in 255 registers."""
    report = rp.measure(_gpu_tile(16, 16), chips.get("cuda-sm90"))
    assert report.registers == 255
    assert report.spill_bytes > 0 and report.spills


@needs_nvcc
def test_cuda_unbound_kernel_is_a_clear_error():
    with pytest.raises(BNFoldError, match=r"main on chip cuda-sm80: .* no CUDA kernel"):
        rp.measure_cuda(_gemm(8, 8, 8), chips.get("cuda-sm80"))


def test_missing_nvcc_raises_tool_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(rp, "_CUDA_DEFAULT_ROOT", str(tmp_path))
    # a verdict cached by an earlier test on a machine with nvcc must not answer for it
    monkeypatch.setenv("TVM_BNFOLD_CACHE", str(tmp_path))
    monkeypatch.setattr(rp, "SPILLS", rp.SpillCache())
    with pytest.raises(rp.ToolMissing, match="nvcc not found"):
        rp.measure(_gpu_tile(2, 2), chips.get("cuda-sm80"))


# spill-verdict cache ------------------------------------------------------------------------


def test_spill_verdicts_are_cached_in_memory_and_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("TVM_BNFOLD_CACHE", str(tmp_path))
    monkeypatch.setattr(rp, "SPILLS", rp.SpillCache())
    builds = []
    real = rp.measure_cpu
    monkeypatch.setattr(rp, "measure_cpu", lambda f, c: builds.append(1) or real(f, c))
    func = _cpu_tile("avx2", 4, 4)
    first = rp.measure(func, chips.get("avx2"))
    assert rp.measure(func.with_attr("global_symbol", "other_name"), chips.get("avx2")) == first
    assert len(builds) == 1 and first.spill_moves > 0
    assert rp.measure(_cpu_tile("avx2", 2, 2), chips.get("avx2")).spill_moves == 0
    assert len(builds) == 2
    assert list(tmp_path.iterdir()) == [tmp_path / rp.SpillCache.FILE]  # no temporary left
    fresh = rp.SpillCache()  # another process: reads the file
    assert fresh.get(rp.SpillCache.key(func, chips.get("avx2"))) == first
    assert fresh.get(rp.SpillCache.key(func, chips.get("avx512"))) is None  # keyed by target


def test_a_file_that_is_not_a_spill_cache_is_never_overwritten(tmp_path, caplog):
    path = tmp_path / rp.SpillCache.FILE
    path.write_text('{"not": "a verdict"}')
    cache = rp.SpillCache(tmp_path)
    report = rp.SpillReport("avx2", 16, 0, 0)
    cache.put("k", report)
    assert cache.get("k") == report  # the memory cache still works
    assert path.read_text() == '{"not": "a verdict"}'
    assert "not a verdict cache" in caplog.text
