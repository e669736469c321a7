"""The pure folding math: formulas, grouped transposed weights, precision, bad values."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tvm_bnfold import BNFoldError
from tvm_bnfold.fold_math import cast_checked, fold, fold_bias, scale_shift, weight_factor


def _bn(rng, c):
    return (rng.uniform(0.5, 1.5, c), rng.normal(0, 1, c), rng.normal(0, 1, c),
            rng.uniform(0.1, 3, c))


def test_scale_shift_formula_and_flags():
    rng = np.random.default_rng(0)
    gamma, beta, mean, var = _bn(rng, 5)
    s, t = scale_shift(gamma, beta, mean, var, 1e-3)
    np.testing.assert_allclose(s, gamma / np.sqrt(var + 1e-3), rtol=1e-15)
    np.testing.assert_allclose(t, beta - mean * s, rtol=1e-15)
    s1, t1 = scale_shift(None, None, mean, var, 1e-3)  # scale=False, center=False
    np.testing.assert_allclose(s1, 1 / np.sqrt(var + 1e-3), rtol=1e-15)
    np.testing.assert_allclose(t1, -mean * s1, rtol=1e-15)


def test_dense_fold_equals_bn_of_dense():
    rng = np.random.default_rng(1)
    w, b, x = rng.normal(size=(6, 4)), rng.normal(size=6), rng.normal(size=(3, 4))
    gamma, beta, mean, var = _bn(rng, 6)
    w2, b2 = fold(w, b, gamma, beta, mean, var, 1e-5, axis=0)
    expected = gamma * (x @ w.T + b - mean) / np.sqrt(var + 1e-5) + beta
    np.testing.assert_allclose(x @ w2.T + b2, expected, rtol=1e-12)


def test_fold_without_bias_and_inputs_untouched():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(3, 2, 3, 3)).astype("float32")
    params = _bn(rng, 3)
    copies = [w.copy()] + [p.copy() for p in params]
    w2, b2 = fold(w, None, *params, 1e-5, axis=0)
    s, t = scale_shift(*params, 1e-5)
    assert w2.dtype == np.float32 and b2.dtype == np.float32
    np.testing.assert_allclose(b2, t, rtol=1e-6)
    np.testing.assert_allclose(w2, w * s[:, None, None, None], rtol=1e-6)
    for before, after in zip(copies, [w, *params], strict=True):
        assert np.array_equal(before, after)


@pytest.mark.parametrize(
    ("index", "what"),
    [(("var", 2, np.nan), "var is not finite at channel 2"),
     (("gamma", 1, np.inf), "gamma is not finite at channel 1"),
     (("var", 0, -1.0), "var \\+ eps <= 0 at channel 0")],
)
def test_bad_statistics_are_named(index, what):
    rng = np.random.default_rng(3)
    params = dict(zip(("gamma", "beta", "mean", "var"), _bn(rng, 3), strict=True))
    name, channel, value = index
    params[name][channel] = value
    with pytest.raises(BNFoldError, match=what):
        scale_shift(params["gamma"], params["beta"], params["mean"], params["var"], 1e-5)


def test_zero_variance_with_zero_eps_is_refused():
    with pytest.raises(BNFoldError, match="var \\+ eps <= 0"):
        scale_shift(np.ones(2), np.zeros(2), np.zeros(2), np.zeros(2), 0.0)


@given(
    groups=st.integers(1, 4),
    cin_per_group=st.integers(1, 3),
    cout_per_group=st.integers(1, 3),
    in_first=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_transposed_weight_factor_follows_groups(groups, cin_per_group, cout_per_group, in_first):
    """Transposed weight (Cin, Cout/g, k): output channel g*Cout/g + o is slice [i in g, o]."""
    cin, cout = groups * cin_per_group, groups * cout_per_group
    s = np.arange(1, cout + 1, dtype=np.float64)
    shape = (cin, cout_per_group, 3) if in_first else (cout_per_group, cin, 3)
    in_axis, out_axis = (0, 1) if in_first else (1, 0)
    factor = np.broadcast_to(weight_factor(shape, s, out_axis, in_axis, groups), shape)
    for i in range(cin):
        for o in range(cout_per_group):
            expected = s[(i // cin_per_group) * cout_per_group + o]
            got = factor[i, o, 0] if in_first else factor[o, i, 0]
            assert got == expected


def test_channel_count_mismatch_is_an_error():
    with pytest.raises(BNFoldError, match="4 output channels, BatchNorm has 3"):
        weight_factor((4, 2, 3, 3), np.ones(3), 0)


def test_fold_bias_broadcasts_any_bias_shape():
    s, t = np.array([2.0, 3.0]), np.array([1.0, -1.0])
    b = np.array([[[10.0, 20.0]]])  # broadcasts along the last axis, not the channels
    got = fold_bias(b, s, t, axis=1, ndim=4)
    assert got.shape == (1, 2, 1, 2)
    np.testing.assert_allclose(got[0, :, 0, :], [[21.0, 41.0], [29.0, 59.0]])
    assert fold_bias(None, s, None, 1, 4) is None


def test_fp16_fold_extreme_statistics():
    """var from 1e-8 to 1e5 and gamma ~1e-4 (fp32 statistics, as mixed-precision exports keep
    them) folded into fp16 weights: finite, and equal to the fp32 fold within fp16 precision."""
    rng = np.random.default_rng(4)
    c = 8
    stats = [rng.uniform(0.5e-4, 2e-4, c), rng.normal(0, 1, c), rng.normal(0, 1, c),
             np.logspace(-8, 5, c)]
    stats = [p.astype("float32") for p in stats]
    w = rng.normal(0, 0.1, (c, 4, 3, 3))
    w16, b16 = fold(w.astype("float16"), np.zeros(c, "float16"), *stats, 1e-5, axis=0)
    w32, b32 = fold(w.astype("float32"), np.zeros(c, "float32"), *stats, 1e-5, axis=0)
    assert w16.dtype == np.float16 and np.isfinite(w16).all() and np.isfinite(b16).all()
    np.testing.assert_allclose(w16.astype("float32"), w32, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(b16.astype("float32"), b32, rtol=1e-3, atol=1e-3)
    # The same formula evaluated in fp16 itself is badly off (var=1e5 overflows, 1e-8
    # underflows): the reason the math runs in float64.
    with np.errstate(all="ignore"):
        g16, v16 = stats[0].astype("float16"), stats[3].astype("float16")
        naive = (g16 / np.sqrt(v16 + np.float16(1e-5))).astype(np.float64)
    exact = stats[0].astype(np.float64) / np.sqrt(stats[3].astype(np.float64) + 1e-5)
    assert np.abs(naive / exact - 1).max() > 0.5


def test_overflow_in_target_dtype_is_refused():
    with np.errstate(over="ignore"), pytest.raises(BNFoldError, match="does not fit in float16"):
        cast_checked(np.array([1e6]), "float16", "weight of conv2d lv")
