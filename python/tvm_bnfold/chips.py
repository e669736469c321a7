"""Named chip presets: a TVM target plus the register-file facts the fusion decisions need.

    chips.target("avx512")   # tvm.target.Target for llvm znver4
    chips.get("avx2").vector_regs   # 16
"""

from __future__ import annotations

import functools
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
        if chip not in PRESETS:
            raise BNFoldError(f"unknown chip {chip!r}; known chips: {', '.join(PRESETS)}")
        return PRESETS[chip]
    target = chip if chip is not None else tvm.target.Target.current(allow_none=True)
    if target is None:
        raise BNFoldError(
            "no target: pass one (a chip name or tvm.target.Target) or use `with target:`"
        )
    return _from_target(target)


def host_chip() -> Chip:
    """The widest preset this machine runs (avx512 where the CPU has it, else avx2)."""
    for name in ("avx512", "avx2"):
        if PRESETS[name].runs_here:
            return PRESETS[name]
    raise BNFoldError("this CPU runs none of the presets (avx512, avx2)")


@functools.cache
def _host_cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def target(chip: str | Chip | tvm.target.Target) -> tvm.target.Target:
    """The tvm Target of a chip preset (a raw Target is returned as is)."""
    if isinstance(chip, tvm.target.Target):
        return chip
    return get(chip).target


_AVX512_CPUS = {"znver4", "znver5", "skylake-avx512", "icelake-server", "sapphirerapids"}


def _from_target(target: tvm.target.Target) -> Chip:
    """A Chip for a raw Target: the matching preset, else register facts read off the target."""
    kind = target.kind.name
    attrs = {k: str(v) for k, v in target.attrs.items()}
    for preset in PRESETS.values():
        cfg = preset.target_config
        if cfg["kind"] == kind and all(
            str(cfg[k]) == attrs.get(k) for k in ("mcpu", "arch", "mtriple") if k in cfg
        ):
            return preset
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
