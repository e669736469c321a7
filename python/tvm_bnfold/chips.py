"""Chips: a TVM target plus the register-file facts the fusion decisions need.

    chips.host_chip()        # this machine: LLVM's name for its CPU, its ISA, the usable cores
    chips.target("avx512")   # a preset, for cross-compiling and the reports: llvm znver4, 2 cores
    chips.get("avx2").vector_regs   # 16
"""

from __future__ import annotations

import functools
import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path

import tvm

from .errors import BNFoldError


@dataclass(frozen=True)
class Chip:
    """A chip preset. ``vector_bits`` / ``vector_regs`` describe the register file the register
    tile lives in (per thread on CUDA: ``vector_regs`` is the per-thread register cap)."""

    name: str
    kind: str  # "cpu" or "cuda"
    target_config: dict
    vector_bits: int
    vector_regs: int
    needs: str | None  # host CPU flag the code needs to run here (None: cross-compile only)
    host: dict | None = None

    @property
    def runs_here(self) -> bool:
        """Can this machine execute code built for the chip (else it is cross-compile only)."""
        return self.needs is not None and self.needs in _host_cpu_flags()

    @property
    def target(self) -> tvm.target.Target:
        if self.host is not None:
            return tvm.target.Target(self.target_config, host=self.host)
        return tvm.target.Target(self.target_config)

    @property
    def cpu(self) -> str:
        """LLVM's name of the CPU the code is made for (``generic`` when the target names none)."""
        return str(self.target_config.get("mcpu") or self.target_config.get("arch") or "generic")

    @property
    def cores(self) -> int:
        """The cores the code is parallelized for (the target's ``num-cores``; 1 on CUDA)."""
        return int(self.target_config.get("num-cores", 1))

    @property
    def isa(self) -> str:
        """The vector ISA: ``avx512``, ``avx2``, ``sse2``, ``neon``, or the CUDA arch."""
        if self.kind == "cuda":
            return self.cpu
        if str(self.target_config.get("mtriple", "")).startswith("aarch64"):
            return "neon"
        return {512: "avx512", 256: "avx2"}.get(self.vector_bits, "sse2")

    def describe(self) -> str:
        """One line for reports and warnings: ``avx2 (haswell, AVX2, 2 cores)``."""
        return f"{self.name} ({self.cpu}, {self.isa.upper()}, {self.cores} cores)"

    def lanes(self, dtype: str = "float32") -> int:
        """Elements of ``dtype`` per vector register (1 on CUDA: registers are scalar)."""
        if self.kind == "cuda":
            return 1
        return self.vector_bits // tvm.DataType(dtype).bits


_HOST = {"kind": "llvm"}
PRESETS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("avx512", "cpu", {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}, 512, 32,
             "avx512f"),
        Chip("avx2", "cpu", {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}, 256, 16, "avx2"),
        Chip(
            "aarch64", "cpu",
            {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1",
             "num-cores": 4},
            128, 32, None,
        ),
        Chip("cuda-sm80", "cuda", {"kind": "cuda", "arch": "sm_80"}, 32, 255, None, _HOST),
        Chip("cuda-sm90", "cuda", {"kind": "cuda", "arch": "sm_90"}, 32, 255, None, _HOST),
    )
}


def get(chip: str | Chip | tvm.target.Target | None = None) -> Chip:
    """The preset for a name, a Chip, or a Target (from the context when None)."""
    if isinstance(chip, Chip):
        return chip
    if isinstance(chip, str):
        if chip in PRESETS:
            return PRESETS[chip]
        if chip in ("host", host_chip().name):
            return host_chip()
        raise BNFoldError(f"unknown chip {chip!r}; known chips: host, {', '.join(PRESETS)}")
    target = chip if chip is not None else tvm.target.Target.current(allow_none=True)
    if target is None:
        raise BNFoldError(
            "no target: pass one (a chip name or tvm.target.Target) or use `with target:`"
        )
    return _from_target(target)


#: The register file of each CPU ISA: (vector bits, vector registers).
_REGISTER_FILES = {"avx512": (512, 32), "avx2": (256, 16), "neon": (128, 32), "sse2": (128, 16)}


@functools.cache
def host_chip() -> Chip:
    """This machine: LLVM's name for its CPU, the vector ISA its flags show, and the cores this
    process may use. A preset with the same CPU and cores is returned as itself (its tuning
    databases were measured on such a machine); else a chip named ``<isa>-<cpu>-<cores>c``.
    A CPU without AVX2 (x86) or NEON (aarch64) gets a generic target and a warning."""
    cpu, cores, flags = tvm.target.codegen.llvm_get_system_cpu(), usable_cores(), _host_cpu_flags()
    config = {"kind": "llvm", "mcpu": cpu, "num-cores": cores}
    if platform.machine() in ("aarch64", "arm64"):
        config = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", **config}
        isa, needs = "neon", "asimd"
    elif "avx512f" in flags:
        isa, needs = "avx512", "avx512f"
    elif {"avx2", "fma"} <= flags:
        isa, needs = "avx2", "avx2"
    else:
        warnings.warn(f"this CPU ({cpu!r}, {platform.machine()}) has neither AVX2 nor NEON: "
                      "compiling for a generic target with the default schedules' 128-bit "
                      "vectors", stacklevel=2)
        config, isa, needs = {"kind": "llvm", "num-cores": cores}, "sse2", None
    for preset in PRESETS.values():
        if preset.kind == "cpu" and preset.target_config == config:
            return preset
    bits, regs = _REGISTER_FILES[isa]
    return Chip(f"{isa}-{cpu if needs else 'generic'}-{cores}c", "cpu", config, bits, regs, needs)


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many CPUs this process may run on (:func:`usable_cpus`)."""
    return len(usable_cpus())


@functools.cache
def _host_cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    # x86 lists "flags", aarch64 "Features"
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def target(chip: str | Chip | tvm.target.Target) -> tvm.target.Target:
    """The tvm Target of a chip preset (a raw Target is returned as is)."""
    if isinstance(chip, tvm.target.Target):
        return chip
    return get(chip).target


def _same_target(config: dict, attrs: dict[str, str]) -> bool:
    """The target's attributes name this config (a target without num-cores takes the config's)."""
    return all(str(v) == attrs.get(k, str(v) if k == "num-cores" else None)
               for k, v in config.items() if k != "kind")


_AVX512_CPUS = {"znver4", "znver5", "skylake-avx512", "icelake-server", "sapphirerapids"}


def _from_target(target: tvm.target.Target) -> Chip:
    """A Chip for a raw Target: the matching preset or this machine's chip, else register facts
    read off the target."""
    kind = target.kind.name
    attrs = {k: str(v) for k, v in target.attrs.items()}
    for chip in (*PRESETS.values(), host_chip()):
        if chip.target_config["kind"] == kind and _same_target(chip.target_config, attrs):
            return chip
    config = dict(target.export())
    host = config.pop("host", None)
    name = f"{kind}-{attrs.get('arch') or attrs.get('mcpu') or 'generic'}"
    if kind == "cuda":
        return Chip(name, "cuda", config, 32, 255, None, host or _HOST)
    if kind != "llvm":
        raise BNFoldError(f"unsupported target kind {kind!r} (llvm and cuda are)")
    if attrs.get("mtriple", "").startswith("aarch64"):
        return Chip(name, "cpu", config, 128, 32, None)
    if "avx512" in attrs.get("mattr", "") or attrs.get("mcpu") in _AVX512_CPUS:
        return Chip(name, "cpu", config, 512, 32, "avx512f")
    # A named x86 CPU: assume AVX2; no mcpu at all: LLVM's generic x86-64 has only SSE2.
    if "mcpu" in attrs:
        return Chip(name, "cpu", config, 256, 16, "avx2")
    return Chip(name, "cpu", config, 128, 16, "sse2")
