"""Run what the project compiles on every core this process may use, without an environment
variable.

    model = tvm_bnfold.load("resnet50.so")            # or an executable from build()/tvm.compile
    logits = model(image)                              # numpy in, numpy out

TVM's runtime starts its thread pool with half the hardware threads on x86 (it assumes
hyper-threading: 1 thread on a 2-core VM, where MobileNetV2 ran 12.3 ms instead of 5.55 ms) unless
``TVM_NUM_THREADS`` is set before the pool starts. :func:`set_threads` configures the pool of the
calling thread through ``runtime.config_threadpool`` with the CPUs of this process's affinity
mask; :func:`load` does it before the first run. The pool is per calling thread and its size is
fixed when it starts: configure it before the first inference of that thread.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from . import chips
from .errors import BNFoldError

#: TVM's AffinityMode: every worker may run on every given CPU (the OS moves a worker off a
#: core a neighbour holds), or each worker is pinned to one CPU.
SHARE_ALL_CORES, ONE_CORE_PER_THREAD = -3, -2
_CONFIGURED: set[int] = set()  # threads whose pool set_threads() configured


def default_threads() -> int:
    """``$TVM_NUM_THREADS`` where the user set it, else every core this process may use."""
    value = os.environ.get("TVM_NUM_THREADS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else chips.usable_cores()


def set_threads(threads: int | None = None, pin: bool = False) -> int:
    """Size the TVM thread pool of the calling thread: ``threads`` (default
    :func:`default_threads`) workers over the CPUs this process may use, each free to run on any
    of them (``pin``: one CPU each). Returns the number of threads the pool uses."""
    if threads is None:
        threads = default_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise BNFoldError(f"threads must be a positive integer, got {threads!r}")
    cpus = chips.usable_cpus()
    if threads > len(cpus):
        cpus = [cpus[i % len(cpus)] for i in range(threads)]  # more threads than cores
    mode = ONE_CORE_PER_THREAD if pin else SHARE_ALL_CORES
    tvm.get_global_func("runtime.config_threadpool")(mode, threads, [str(c) for c in cpus])
    used = int(tvm.get_global_func("runtime.NumThreads")())
    _CONFIGURED.add(threading.get_ident())
    if used < threads:
        warnings.warn(f"TVM's thread pool of this thread started with {used} thread(s) before it "
                      f"was configured and cannot grow to {threads}: configure it before the "
                      "first inference", stacklevel=2)
    return used


def current_threads() -> int:
    """The threads TVM's pool of the calling thread runs on; a pool that has not started yet
    starts on every usable core (:func:`set_threads`), never on TVM's default of half."""
    if threading.get_ident() not in _CONFIGURED:
        return set_threads()
    return int(tvm.get_global_func("runtime.NumThreads")())


class Model:
    """A compiled model ready to run: ``model(*arrays)`` runs ``main`` and returns numpy
    (a tuple where ``main`` returns several tensors)."""

    def __init__(self, executable, threads: int | None = None, device=None) -> None:
        self.threads = set_threads(threads)
        self.device = device or tvm.cpu()
        self.vm = relax.VirtualMachine(executable, self.device)

    def __call__(self, *inputs: np.ndarray):
        args = [tvm.runtime.tensor(np.ascontiguousarray(x), self.device) for x in inputs]
        return _numpy(self.vm["main"](*args))


def load(path_or_executable, threads: int | None = None) -> Model:
    """A :class:`Model` of a library written by ``tvm-bnfold compile`` / ``export_library``
    (a path) or of an executable from :func:`tvm_bnfold.build` / ``tvm.compile``, running on
    ``threads`` threads (default: every core this process may use)."""
    executable = path_or_executable
    if isinstance(path_or_executable, (str, os.PathLike)):
        path = Path(path_or_executable)
        if not path.is_file():
            raise BNFoldError(f"no compiled model at {path}")
        try:
            executable = tvm.runtime.load_module(str(path))
        except RuntimeError as err:  # what TVM raises for a file it cannot load
            raise BNFoldError(f"{path} is not a TVM library: {str(err).splitlines()[0]}") from err
    return Model(executable, threads)


def _numpy(value):
    if isinstance(value, tvm.runtime.Tensor):
        return value.numpy()
    return tuple(_numpy(v) for v in value)
