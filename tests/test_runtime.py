"""tvm_bnfold.load / set_threads: a compiled model runs on every core this process may use, with
no environment variable; bad input is a typed error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_bnfold
from _util import function, tensor_var
from tvm_bnfold import BNFoldError, chips

R = relax.op


def tiny_module():
    w = relax.const(np.linspace(-1, 1, 8 * 4 * 9, dtype="float32").reshape(8, 4, 3, 3))

    def body(bb, x):
        return R.nn.relu(bb.emit(R.nn.conv2d(x, w, padding=1)))

    return function([tensor_var("x", (1, 4, 6, 6))], body)


def test_load_runs_on_every_core_in_a_fresh_process():
    """TVM alone starts half the hardware threads on x86; load() uses every usable core."""
    script = textwrap.dedent("""
        import tvm, tvm_bnfold
        from test_runtime import tiny_module
        model = tvm_bnfold.load(tvm.compile(tiny_module(), "llvm"))
        print(model.threads, tvm.get_global_func("runtime.NumThreads")())
        one = tvm_bnfold.set_threads(1)
        print(one, tvm.get_global_func("runtime.NumThreads")())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    cores = chips.usable_cores()
    assert out == [str(cores), str(cores), "1", "1"]


def test_a_loaded_library_matches_the_virtual_machine(tmp_path):
    mod = tiny_module()
    ex = tvm.compile(mod, "llvm")
    ex.export_library(str(tmp_path / "m.so"))
    x = np.random.default_rng(0).normal(size=(1, 4, 6, 6)).astype("float32")
    expected = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    model = tvm_bnfold.load(tmp_path / "m.so", threads=2)
    got = model(x)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(x, np.random.default_rng(0).normal(size=x.shape)
                                  .astype("float32"))  # the caller's array is untouched


def test_bad_input_is_a_typed_error(tmp_path):
    with pytest.raises(BNFoldError, match="no compiled model at"):
        tvm_bnfold.load(tmp_path / "missing.so")
    (tmp_path / "notes.so").write_text("not a library")
    with pytest.raises(BNFoldError, match=r"notes\.so is not a TVM library"):
        tvm_bnfold.load(tmp_path / "notes.so")
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(BNFoldError, match=r"threads must be a positive integer"):
            tvm_bnfold.set_threads(bad)
