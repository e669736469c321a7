"""Chip presets: names -> targets and register files; raw targets; errors."""

import pytest
import tvm

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
    with pytest.raises(BNFoldError, match=r"unknown chip 'tpu'.*avx512, avx2, aarch64"):
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
        assert chips.host_chip().name == ("avx512" if "avx512f" in flags else "avx2")
