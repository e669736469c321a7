"""profile: our kernels and ONNX Runtime's nodes, matched layer by layer."""

import onnx
import pytest

from test_report import tiny_model
from tvm_bnfold import chips, profile

CHIP = next(n for n in ("avx512", "avx2") if chips.PRESETS[n].runs_here)


def test_conv_keys_meet_across_layouts():
    nchw = profile.conv_key([1, 64, 56, 56], [256, 64, 1, 1])
    blocked = profile.conv_key([1, 4, 56, 56, 16], [16, 4, 1, 1, 16, 16])
    assert nchw == blocked == (64, 56, 256, 1)


@pytest.fixture(scope="module")
def rows():
    return profile.compare(tiny_model(), CHIP, threads=1, runs=2)


def test_both_sides_time_both_convs_and_the_classifier(rows):
    """(Both pad the 8 channels to their block, each its own way: conv keys need not meet.)"""
    for side in (1, 2):
        convs = [r[0] for r in rows if isinstance(r[0], tuple) and r[side] > 0]
        assert len(convs) == 2 and {k[0] for k in convs} >= {3}, (side, rows)
    layers = {key: (ours, theirs) for key, ours, theirs in rows}
    for key in ("Gemm", "GlobalAveragePool"):
        assert min(layers[key]) > 0, (key, layers[key])


def test_rows_are_sorted_by_our_deficit(rows):
    deficits = [ours - theirs for _, ours, theirs in rows]
    assert deficits == sorted(deficits, reverse=True)


def test_main_prints_a_total(tmp_path, capsys):
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_model(), path)
    profile.main([str(path), "--chip", CHIP, "--threads", "1", "--runs", "1"])
    out = capsys.readouterr().out
    assert "Gemm" in out and out.strip().splitlines()[-1].startswith("total")
