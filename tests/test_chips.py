"""Chips: this machine's, presets (names -> targets and register files), raw targets, errors."""

import os
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_bnfold import BNFoldError, chips


@pytest.mark.parametrize(
    ("name", "kind", "lanes", "regs"),
    [("avx512", "llvm", 16, 32), ("avx2", "llvm", 8, 16), ("aarch64", "llvm", 4, 32),
     ("cuda-sm80", "cuda", 1, 255), ("cuda-sm90", "cuda", 1, 255)],
)
def test_presets(name, kind, lanes, regs):
    chip = chips.get(name)
    assert chip.target.kind.name == kind
    assert chip.lanes("float32") == lanes and chip.vector_regs == regs
    assert chips.target(name).kind.name == kind


def test_cuda_presets_have_a_host_and_an_arch():
    target = chips.target("cuda-sm80")
    assert target.host is not None and str(target.attrs["arch"]) == "sm_80"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(BNFoldError, match=r"unknown chip 'tpu'.*host, avx512, avx2, aarch64"):
        chips.get("tpu")


def test_raw_targets_and_context():
    znver4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    assert chips.get(znver4).name == "avx512"
    assert chips.target(znver4) is znver4
    other = chips.get(tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"}))
    assert (other.vector_bits, other.vector_regs) == (512, 32)
    assert chips.get(tvm.target.Target({"kind": "llvm"})).vector_bits == 128  # generic x86-64
    with chips.target("avx2"):
        assert chips.get().name == "avx2"


def test_no_target_at_all_is_a_clear_error():
    with pytest.raises(BNFoldError, match="no target"):
        chips.get()


def test_runs_here_follows_the_host_cpu_flags():
    flags = chips._host_cpu_flags()
    assert chips.get("avx512").runs_here == ("avx512f" in flags)
    assert chips.get("avx2").runs_here == ("avx2" in flags)
    assert not chips.get("aarch64").runs_here and not chips.get("cuda-sm80").runs_here
    if "avx2" in flags:
        assert chips.host_chip().isa == ("avx512" if "avx512f" in flags else "avx2")
        assert chips.host_chip().runs_here


def test_host_chip_is_this_machine():
    host = chips.host_chip()
    assert host.cpu == tvm.target.codegen.llvm_get_system_cpu()
    assert host.cores == len(os.sched_getaffinity(0)) == chips.usable_cores()
    assert chips.get("host") is host and chips.get(host.name) is host
    assert host.name in host.describe() and f"{host.cores} cores" in host.describe()


@pytest.fixture
def fake_host(monkeypatch):
    """Set what host_chip() reads: LLVM's CPU name, the cpuinfo flags, the usable cores."""
    def fake(cpu: str, flags: set[str], cores: int) -> chips.Chip:
        monkeypatch.setattr(tvm.target.codegen, "llvm_get_system_cpu", lambda: cpu)
        monkeypatch.setattr(chips, "_host_cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(chips, "usable_cores", lambda: cores)
        chips.host_chip.cache_clear()
        return chips.host_chip()

    yield fake
    chips.host_chip.cache_clear()


def test_a_host_like_a_preset_is_the_preset(fake_host):
    """The committed avx512 databases were measured on a 2-core Zen 4: such a host is avx512."""
    assert fake_host("znver4", {"avx2", "fma", "avx512f"}, 2) is chips.get("avx512")


@pytest.mark.parametrize(("cpu", "flags", "cores", "name", "bits", "regs"), [
    ("znver3", {"avx2", "fma"}, 2, "avx2-znver3-2c", 256, 16),
    ("znver4", {"avx2", "fma", "avx512f"}, 32, "avx512-znver4-32c", 512, 32),
    ("sapphirerapids", {"avx2", "fma", "avx512f"}, 4, "avx512-sapphirerapids-4c", 512, 32),
])
def test_other_hosts_get_their_own_chip(fake_host, cpu, flags, cores, name, bits, regs):
    chip = fake_host(cpu, flags, cores)
    assert (chip.name, chip.vector_bits, chip.vector_regs) == (name, bits, regs)
    assert chip.target_config == {"kind": "llvm", "mcpu": cpu, "num-cores": cores}
    assert chip.cpu == cpu and chip.cores == cores and chip.runs_here
    assert chips.get("host") is chip and chips.get(name) is chip
    assert chips.get(chip.target) == chip  # a raw Target of it reads the same register file


def test_an_unknown_cpu_compiles_generically_with_a_warning(fake_host):
    with pytest.warns(UserWarning, match="neither AVX2 nor NEON"):
        chip = fake_host("pentium4", {"sse2"}, 2)
    assert chip.name == "sse2-generic-2c" and "mcpu" not in chip.target_config
    assert (chip.vector_bits, chip.vector_regs, chip.isa) == (128, 16, "sse2")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(relax.op.nn.relu(x)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex = tvm.compile(bb.get(), target=chip.target)  # compiles and runs here: x86-64 baseline
    data = np.linspace(-1, 1, 32, dtype="float32").reshape(4, 8)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(data)).numpy()
    np.testing.assert_array_equal(out, np.maximum(data, 0))
