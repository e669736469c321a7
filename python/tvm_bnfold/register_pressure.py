"""Register pressure of a kernel on a chip: the register budget, a static estimate of the live
vector registers of a register tile, and the measured spill count of the built kernel.

The fusion check commits a conv epilogue fusion only if the fused kernel does not spill:

    report = register_pressure.measure(sch.mod["main"], "avx512")
    if report.spills:
        ...  # keep the epilogue unfused

Measured on CPU from LLVM's assembly (vector register <-> stack moves, since LLVM prints no
"Spill" comments here), on CUDA from ``ptxas -v`` (spill store/load bytes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tvm
import tvm_ffi

from . import chips
from .errors import BNFoldError

logger = logging.getLogger(__name__)

#: Vector registers a CPU register tile leaves free: the broadcast input and the weight load.
CPU_RESERVE = 2
#: Registers a CUDA thread keeps for addresses, indices and loop counters besides its tile.
CUDA_RESERVE = 32
#: Architectural per-thread register cap of every CUDA arch we target.
CUDA_MAX_REGISTERS = 255
_CUDA_DEFAULT_ROOT = "/usr/local/cuda"

PrimFuncLike = tvm.tirx.PrimFunc | tvm.IRModule


class ToolMissing(BNFoldError):
    """A tool the measurement needs (nvcc/ptxas) is not installed."""


@dataclass(frozen=True)
class SpillReport:
    """What the register allocator did with one kernel on one chip.

    ``registers``: CUDA: registers per thread from ptxas; CPU: distinct vector registers the
    kernel references (None when unknown). ``spill_moves``: CPU vector register <-> stack moves
    (0 on CUDA). ``spill_bytes``: CUDA spill store + load bytes (0 on CPU).
    """

    chip: str
    registers: int | None
    spill_moves: int
    spill_bytes: int

    @property
    def spills(self) -> bool:
        """Whether the kernel spills registers to the stack / local memory."""
        return self.spill_moves > 0 or self.spill_bytes > 0


# Static side ------------------------------------------------------------------------------


def static_budget(chip: chips.Chip, dtype: str = "float32") -> int:
    """Registers a register tile of ``dtype`` may use on ``chip``.

    CPU: vector registers minus :data:`CPU_RESERVE` (each holds ``chip.lanes(dtype)`` elements).
    CUDA: the per-thread cap minus :data:`CUDA_RESERVE`, counted in ``dtype`` values (a 64-bit
    value takes two 32-bit registers; narrower values are counted one per register).
    """
    if chip.kind == "cuda":
        regs = min(chip.vector_regs, CUDA_MAX_REGISTERS) - CUDA_RESERVE
        return regs // max(1, tvm.DataType(dtype).bits // 32)
    return chip.vector_regs - CPU_RESERVE


def estimate_live_vregs(accumulators: int, epilogue_operands: int, temporaries: int = 2) -> int:
    """Peak live vector registers of a register tile with its epilogue applied in place.

    The model: every accumulator of the tile is live across the whole reduction; the epilogue
    runs on the tile before it is written back, so its operands (a bias / scale vector, a
    residual vector) are live together with all accumulators; ``temporaries`` are the operand
    registers of the inner product live at once. Peak = the sum; it fits when it is at most
    ``chip.vector_regs`` (equivalently: accumulators + operands <= :func:`static_budget` with
    the default ``temporaries`` = :data:`CPU_RESERVE`).

    Measured with LLVM (avx512, avx2, aarch64): a GEMM tile of ``rows x vecs`` vectors that
    loads its ``vecs`` weight vectors once per reduction step and broadcasts one input keeps
    ``temporaries = vecs + 1`` live, and spills exactly when the sum exceeds the register file.
    """
    for name, value in (
        ("accumulators", accumulators),
        ("epilogue_operands", epilogue_operands),
        ("temporaries", temporaries),
    ):
        if value < 0:
            raise BNFoldError(f"estimate_live_vregs: {name} must be >= 0, got {value}")
    return accumulators + epilogue_operands + temporaries


# Assembly analysis --------------------------------------------------------------------------

_FUNC_DECL = re.compile(r"^\s*\.type\s+([\w.$]+)\s*,\s*[@%]function")
_LABEL = re.compile(r"^([\w.$]+):")
_X86_HINT = re.compile(r"%(?:[xyz]mm\d|r[sb]p\b|[re]ax\b)")
_BRANCH = re.compile(r"^\s*\S+\s+(?:.*,\s*)?(\.L[\w.$]+)\s*$")  # jne .LBB3_2, cbnz w8, .LBB3_2

# x86 AT&T: a (v)mov* with a vector register operand and a %rsp/%rbp-based memory operand.
_X86_MOVE = re.compile(r"^\s*v?mov\w*\s")
_X86_VREG = re.compile(r"%([xyz])mm(\d+)")
_X86_STACK = re.compile(r"[-+\w]*\(%rsp\b[^)]*\)")
_X86_FRAME = re.compile(r"[-+\w]*\(%rbp\b[^)]*\)")  # a slot only where rbp is the frame pointer
_X86_SETS_FRAME = re.compile(r"^\s*movq?\s+%rsp,\s*%rbp\b")
_FMA = re.compile(r"^\s*(?:vf(?:n)?m(?:add|sub)\w*|fml[as])\s")  # x86 FMA3, AArch64 fmla/fmls
# A call of a named routine other than mem*: libm's (expf@PLT). TVM's runtime calls (workspace
# allocation, through function pointers) and the memset of a zeroed buffer run per row or tile.
_MATH_CALL = re.compile(r"^\s*(?:call\w*|bl)\s+(?!mem)[A-Za-z_]")

# AArch64: str/ldr/stp/ldp (+ unscaled and pre/post-indexed forms) of q/d/s/h/b registers,
# st1/ld1 of v registers, addressed from sp or the frame pointer.
_A64_MOVE = re.compile(r"^\s*(?:st|ld)(?:r|ur|p|1)\b")
_A64_VREG = re.compile(r"(?<![\w.#:])([vqdshb])(\d+)\b")
_A64_STACK = re.compile(r"\[\s*(?:sp|x29|fp)\b")
_A64_CALLEE_SAVED_D = range(8, 16)  # AAPCS64: the low halves of v8-v15 are callee-saved


def _kernel_lines(asm: str, labels: bool = False) -> Iterator[tuple[str | None, str]]:
    """Instruction lines of the kernels in ``asm``, each with its function (None in a snippet);
    with ``labels``, their local labels (``.LBB3_2:``) too.

    TVM's own helpers are skipped: the FFI wrappers (``__tvm_ffi_*``), their error paths
    (``__tvm_set_raised_*``), which marshal arguments on the stack, and compiler-rt routines
    (``__truncsfhf2``); all are named with a leading ``__``. The parallel bodies
    (``.L__tvm_parallel_lambda*``) and ``*_compute_`` functions are kept. Text without function
    declarations (a snippet) is taken whole.
    """
    functions = {m.group(1) for line in asm.splitlines() if (m := _FUNC_DECL.match(line))}
    skipping, function = False, None
    for line in asm.splitlines():
        label = _LABEL.match(line)
        if label and label.group(1) in functions:
            function = label.group(1)
            skipping = function.startswith("__")
            continue
        if skipping:
            continue
        stripped = line.strip()
        if labels and _LABEL.match(stripped):
            yield function, stripped
            continue
        if not stripped or stripped.startswith((".", "#", "//", ";")) or _LABEL.match(stripped):
            continue
        yield function, line


def _loop_depths(lines: list[tuple[str | None, str]]) -> list[int]:
    """The loop depth of each line of :func:`_kernel_lines` (with labels): the number of loops
    around it, a loop being the lines from a label to the last branch back to it."""
    depth = [0] * len(lines)
    seen: dict[tuple[str | None, str], int] = {}
    last_back: dict[int, int] = {}
    for i, (function, line) in enumerate(lines):
        if label := _LABEL.match(line):
            seen[(function, label.group(1))] = i
        elif target := _BRANCH.search(line.split("#", 1)[0].split("//", 1)[0]):
            start = seen.get((function, target.group(1)))
            if start is not None:
                last_back[start] = i
    for start, end in last_back.items():
        for i in range(start, end + 1):
            depth[i] += 1
    return depth


def _is_x86(asm: str) -> bool:
    return _X86_HINT.search(asm) is not None


def _operands(line: str, x86: bool) -> str:
    """The operand part of an instruction line, without a trailing comment (``#`` in AT&T
    syntax, ``//`` in AArch64, where ``#`` marks an immediate)."""
    line = line.split("#" if x86 else "//", 1)[0]
    parts = line.strip().split(None, 1)
    return parts[1] if len(parts) > 1 else ""


def count_vector_spills(asm: str) -> int:
    """Vector register <-> stack moves in ``asm`` (x86 AT&T or AArch64), in either direction.

    x86: ``(v)mov*`` between an ``%xmm/%ymm/%zmm`` register and an ``(%rsp)``-based slot, or an
    ``(%rbp)``-based one in a function that sets rbp up as its frame pointer (elsewhere LLVM uses
    rbp as an ordinary pointer register); x86-64 SysV has no callee-saved vector registers, so
    every such move is a spill or a reload. In a snippet without functions rbp is the frame.
    AArch64: ``str/ldr/stp/ldp/stur/ldur`` of ``q/d/s/h/b`` registers and ``st1/ld1`` of ``v``
    registers at ``[sp...]`` / ``[x29...]``, except the prologue/epilogue save of the
    callee-saved ``d8``-``d15``. Register-register moves and loads from other addresses do not
    count. Reloads that LLVM folds into an arithmetic instruction are not counted (a spill
    always has at least one store, so ``> 0`` is unaffected). TVM's FFI wrappers are skipped.

    A slot stored only outside the loops that reload it holds a loop invariant LLVM hoisted
    (the bias vectors of a tile loop): each use reloads it, as the unhoisted code would load
    it from its buffer, so its moves do not count.

    In a function whose loops make no libm calls, a slot counts only when one of its moves
    lies as deep as the loop holding most of the function's FMAs (the reduction steps): per
    tile or per row, a few moves cost nothing beside the reduction. ResNet-50's 3x3 convs on
    an AVX-512 Xeon, tiles 7x2 and 8x2 with 2-11 such moves at tile depth, ran 1.11-1.20x
    faster than the spill-free 7x1 / 14x1 tiles the strict count fell back to; a 2x4 tile's
    240 moves lie in its reduction loop.
    Around a libm call in a loop (an exact sigmoid on the tile) every live vector is spilled:
    there, and in a function without FMAs, every move counts.
    """
    x86 = _is_x86(asm)
    lines = list(_kernel_lines(asm, labels=True))
    depths = _loop_depths(lines)
    framed = {None} | {f for f, line in lines if _X86_SETS_FRAME.match(line)}
    slots: dict[tuple, list[tuple[bool, int]]] = {}  # (function, slot) -> (is_store, depth)
    fmas: dict[str | None, Counter] = {}  # function -> FMAs per loop depth
    math_calls: set[str | None] = set()  # functions calling a math routine in their loops
    for (function, line), depth in zip(lines, depths, strict=True):
        if _FMA.match(line):
            fmas.setdefault(function, Counter())[depth] += 1
        elif depth and _MATH_CALL.match(line):
            math_calls.add(function)
        if x86:
            if not _X86_MOVE.match(line):
                continue
            operands = _operands(line, x86)
            slot = _X86_STACK.search(operands) or (
                function in framed and _X86_FRAME.search(operands))
            if slot and _X86_VREG.search(operands):
                store = operands.rstrip().endswith(slot.group(0))
                slots.setdefault((function, slot.group(0)), []).append((store, depth))
            continue
        if not _A64_MOVE.match(line):
            continue
        operands = _operands(line, x86)
        if not _A64_STACK.search(operands):
            continue
        regs = _A64_VREG.findall(operands)
        if not regs:
            continue
        if all(kind == "d" and int(n) in _A64_CALLEE_SAVED_D for kind, n in regs):
            continue  # frame setup: saving / restoring callee-saved d8-d15
        store = line.strip().startswith("st")
        slot = operands[operands.index("["):]
        slots.setdefault((function, slot), []).append((store, depth))
    count = 0
    for (function, _), moves in slots.items():
        stores = [depth for store, depth in moves if store]
        loads = [depth for store, depth in moves if not store]
        if stores and loads and max(stores) < min(loads):
            continue  # a hoisted loop invariant
        hot = _hot_depth(fmas.get(function))
        if function in math_calls or hot is None or max(d for _, d in moves) >= hot:
            count += len(moves)
    return count


def _hot_depth(fmas: Counter | None) -> int | None:
    """The loop depth that holds most of a function's FMAs (the reduction; an epilogue's
    multiply-add contracted to an FMA sits shallower), the shallower of a tie."""
    if not fmas:
        return None
    return min(fmas, key=lambda depth: (-fmas[depth], depth))


def vector_registers_used(asm: str) -> int:
    """Distinct vector registers the kernels in ``asm`` reference (``xmm3``/``ymm3``/``zmm3``
    are one register, as are AArch64 ``v3``/``q3``/``d3``/``s3``)."""
    x86 = _is_x86(asm)
    used: set[int] = set()
    for _, line in _kernel_lines(asm):
        operands = _operands(line, x86)
        pattern = _X86_VREG if x86 else _A64_VREG
        used.update(int(n) for _, n in pattern.findall(operands))
    return len(used)


# Built modules ------------------------------------------------------------------------------


def _module_tree(built) -> Iterator[tvm.runtime.Module]:
    """The runtime modules of a build result: a runtime Module, a ``tvm.compile`` Executable or
    a Relax VMExecutable (both hold their module in ``.mod``), with all their imports."""
    root = built if isinstance(built, tvm.runtime.Module) else getattr(built, "mod", None)
    if not isinstance(root, tvm.runtime.Module):
        raise BNFoldError(f"not a built TVM module: {type(built).__name__}")
    stack = [root]
    while stack:
        mod = stack.pop()
        yield mod
        stack.extend(mod.imports)


def llvm_asm(built) -> str:
    """The assembly of every LLVM module in a build result (``inspect_source("asm")``)."""
    sources = [m.inspect_source("asm") for m in _module_tree(built) if m.kind == "llvm"]
    if not sources:
        raise BNFoldError("the built module has no LLVM (CPU) code")
    return "\n".join(sources)


def cuda_source(built) -> str:
    """The CUDA C source of every CUDA module in a build result."""
    sources = [
        m.inspect_source("cuda") or m.inspect_source("")
        for m in _module_tree(built)
        if m.kind == "cuda"
    ]
    if not any(sources):
        raise BNFoldError(
            "the built module has no CUDA kernel (are its loops bound to blockIdx/threadIdx?)"
        )
    return "\n".join(sources)


def _func_name(func: PrimFuncLike) -> str:
    if isinstance(func, tvm.tirx.PrimFunc):
        return str(func.attrs.get("global_symbol", "main")) if func.attrs else "main"
    return ", ".join(gv.name_hint for gv in func.functions)


def _build(func: PrimFuncLike, chip: chips.Chip):
    if isinstance(func, tvm.tirx.PrimFunc) and not (func.attrs and "global_symbol" in func.attrs):
        func = func.with_attr("global_symbol", "main")  # a kernel taken out of a Relax module
    try:
        return tvm.tirx.build(func, chip.target)
    except Exception as err:  # TVM raises many error types; name the kernel and the chip
        raise BNFoldError(f"cannot build {_func_name(func)} for chip {chip.name}: {err}") from err


# Measurement --------------------------------------------------------------------------------


def measure_cpu(func: PrimFuncLike, chip: chips.Chip) -> SpillReport:
    """Build a scheduled PrimFunc for a CPU chip (cross targets too: no execution) and count
    vector spills and registers in its assembly."""
    if chip.kind != "cpu":
        raise BNFoldError(f"measure_cpu: chip {chip.name} is a {chip.kind} chip")
    asm = llvm_asm(_build(func, chip))
    report = SpillReport(
        chip=chip.name,
        registers=vector_registers_used(asm),
        spill_moves=count_vector_spills(asm),
        spill_bytes=0,
    )
    logger.debug("%s on %s: %s", _func_name(func), chip.name, report)
    return report


def find_nvcc() -> Path:
    """The nvcc executable: ``$PATH``, then ``$CUDA_HOME``/``$CUDA_PATH``, then
    /usr/local/cuda; :class:`ToolMissing` when there is none."""
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), _CUDA_DEFAULT_ROOT):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return Path(root) / "bin" / "nvcc"
    raise ToolMissing(
        "nvcc not found (looked in PATH, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda/bin): "
        "install the CUDA toolkit to measure CUDA register use"
    )


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> tuple[int | None, int]:
    """``(registers, spill_bytes)`` from ``ptxas -v`` output: the most registers any kernel
    uses, and spill store + load bytes summed over all kernels."""
    regs = [int(n) for n in _PTXAS_REGS.findall(log)]
    spill = sum(int(st) + int(ld) for st, ld in _PTXAS_SPILLS.findall(log))
    return (max(regs) if regs else None), spill


def ptxas_log(source: str, arch: str, timeout: float = 300.0) -> str:
    """Compile CUDA C ``source`` to a cubin for ``arch`` (``sm_80``) with nvcc and return the
    ``ptxas -v`` report. Flags follow TVM's nvcc path (``-O3 --use_fast_math``)."""
    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory(prefix="tvm_bnfold_ptxas_") as tmp:
        src = Path(tmp) / "kernels.cu"
        src.write_text(source)
        cmd = [
            str(nvcc),
            "-cubin",
            "-O3",
            "--use_fast_math",
            f"-arch={arch}",
            "-Xptxas",
            "-v",
            "-o",
            str(Path(tmp) / "kernels.cubin"),
            str(src),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError as err:
            raise ToolMissing(f"cannot run {nvcc}: {err}") from err
        except subprocess.TimeoutExpired as err:
            raise BNFoldError(f"nvcc for {arch} took longer than {timeout:.0f} s") from err
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise BNFoldError(f"nvcc failed for {arch} (exit {proc.returncode}):\n{log[-4000:]}")
    return log


def measure_cuda(func: PrimFuncLike, chip: chips.Chip) -> SpillReport:
    """Generate CUDA C for a GPU-scheduled (thread-bound) PrimFunc, compile it with nvcc for the
    chip's arch and read registers and spill bytes from ``ptxas -v``. No GPU is needed;
    :class:`ToolMissing` when nvcc is absent."""
    if chip.kind != "cuda":
        raise BNFoldError(f"measure_cuda: chip {chip.name} is a {chip.kind} chip")
    find_nvcc()  # fail fast, before code generation
    arch = str(chip.target.attrs.get("arch", ""))
    if not arch.startswith("sm_"):
        raise BNFoldError(f"chip {chip.name} has no CUDA arch (sm_XX): {arch!r}")
    built = _build(func, chip)
    try:
        source = cuda_source(built)
    except BNFoldError as err:
        raise BNFoldError(f"{_func_name(func)} on chip {chip.name}: {err}") from err
    registers, spill_bytes = parse_ptxas_log(ptxas_log(source, arch))
    report = SpillReport(chip.name, registers, spill_moves=0, spill_bytes=spill_bytes)
    logger.debug("%s on %s: %s", _func_name(func), chip.name, report)
    return report


def measure(func: PrimFuncLike, chip: chips.Chip) -> SpillReport:
    """Register use and spills of a scheduled PrimFunc on ``chip`` (CPU or CUDA): the verdict
    cached for this kernel and target (:class:`SpillCache`), else measured and cached."""
    key = SpillCache.key(func, chip)
    report = SPILLS.get(key)
    if report is None:
        report = measure_cuda(func, chip) if chip.kind == "cuda" else measure_cpu(func, chip)
        SPILLS.put(key, report)
    return report


class SpillCache:
    """Spill verdicts by kernel (structural hash of the scheduled PrimFunc), target, TVM
    version and counting rule: in memory, and on disk in ``spill_verdicts.json`` of ``directory``
    (``$TVM_BNFOLD_CACHE``, else ``~/.cache/tvm_bnfold``), beside the user's own tuning work.
    Written whole to a temporary file and renamed: a crash never truncates it. A file that is
    not a verdict cache is left alone (and not used)."""

    FILE = "spill_verdicts.json"
    #: The counting rule of :func:`count_vector_spills`: verdicts of an older rule are not used.
    RULE = 2

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self._directory = directory
        self._memory: dict[str, SpillReport] = {}
        self._loaded: Path | None = None
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        root = self._directory or os.environ.get("TVM_BNFOLD_CACHE") or "~/.cache/tvm_bnfold"
        return Path(root).expanduser() / self.FILE

    @staticmethod
    def key(func: PrimFuncLike, chip: chips.Chip) -> str:
        if isinstance(func, tvm.IRModule):
            (func,) = func.functions.values()
        digest = tvm_ffi.structural_hash(func.without_attr("global_symbol"))
        return f"rule{SpillCache.RULE}|{tvm.__version__}|{chip.target}|{digest}"

    def get(self, key: str) -> SpillReport | None:
        with self._lock:
            self._load()
            return self._memory.get(key)

    def put(self, key: str, report: SpillReport) -> None:
        with self._lock:  # FuseEpilogue measures on several threads
            self._load()
            self._memory[key] = report
            self._write()

    def _write(self) -> None:
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            on_disk = self._read(path)
            if on_disk is None and path.exists():
                return  # not ours: never overwrite it
            on_disk.update({k: dataclasses.asdict(r) for k, r in self._memory.items()})
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                             suffix=".tmp") as tmp:
                json.dump(on_disk, tmp)
            os.replace(tmp.name, path)
        except OSError as err:  # a read-only home: the memory cache still works
            logger.debug("spill cache %s not written: %s", path, err)

    def _load(self) -> None:
        path = self.path
        if self._loaded == path:
            return
        self._loaded = path
        for key, fields in (self._read(path) or {}).items():
            self._memory.setdefault(key, SpillReport(**fields))

    @staticmethod
    def _read(path: Path) -> dict | None:
        """The verdicts in ``path`` ({} when there is no file), None when it is not a cache."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            logger.warning("spill cache %s is not a verdict cache: not used", path)
            return None
        names = {f.name for f in dataclasses.fields(SpillReport)}
        if not (isinstance(data, dict)
                and all(isinstance(v, dict) and set(v) == names for v in data.values())):
            logger.warning("spill cache %s is not a verdict cache: not used", path)
            return None
        return data


#: The process-wide spill cache :func:`measure` uses.
SPILLS = SpillCache()
