"""Shared test helpers: build small Relax modules, compile and run them with TVM."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvm_bnfold.bench import run_once


def run(mod: tvm.IRModule, *inputs: np.ndarray) -> np.ndarray:
    """Compile ``mod`` for the host CPU with TVM and run ``main`` on ``inputs``."""
    return run_once(mod, list(inputs))


def constants(mod: tvm.IRModule) -> list[np.ndarray]:
    """Copies of every constant array in the module, in visit order."""
    out = []

    def visit(expr):
        if isinstance(expr, tvm.ir.expr.GenericConst):
            out.append(expr.value.numpy().copy())

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return out


def bn_params(rng: np.random.Generator, c: int, dtype: str = "float32") -> list[np.ndarray]:
    """Realistic inference BN parameters: gamma, beta, running mean, running var."""
    return [
        rng.uniform(0.5, 1.5, c).astype(dtype),
        rng.normal(0, 0.5, c).astype(dtype),
        rng.normal(0, 0.5, c).astype(dtype),
        rng.uniform(0.5, 2.0, c).astype(dtype),
    ]


def batch_norm(data, params, axis: int, **kwargs) -> relax.Expr:
    """An inference BatchNorm call (relax defaults to training=True, we don't)."""
    kwargs.setdefault("training", False)
    consts = [p if isinstance(p, relax.Expr) else relax.const(p, str(p.dtype)) for p in params]
    return relax.op.nn.batch_norm(data, *consts, axis=axis, **kwargs)


def function(params: list[relax.Var], body) -> tvm.IRModule:
    """Module whose main takes ``params``; ``body(bb, *params)`` emits bindings, returns output."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def tensor_var(name: str, shape, dtype: str = "float32") -> relax.Var:
    return relax.Var(name, relax.TensorType(tuple(shape), dtype))


def layout_shape(layout: str, sizes: dict[str, int]) -> tuple[int, ...]:
    """Shape of a tensor in ``layout`` given sizes per axis letter (spatial letters default 6)."""
    return tuple(sizes.get(ch, 6) for ch in layout)


def assert_close(actual: np.ndarray, expected: np.ndarray, tol: float = 1e-5) -> None:
    """The fp32 rewrite tolerance of the project: rtol = atol = 1e-5."""
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


def max_rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| relative to max |expected| (whole-model comparisons)."""
    return float(np.abs(actual - expected).max() / np.abs(expected).max())
