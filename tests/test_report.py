"""Comparison reports: files, embedded plots, static-only chips, and a real browser render."""

import base64
import re
import shutil
import subprocess
from io import BytesIO
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from tvm_bnfold import bench, report
from tvm_bnfold.errors import BNFoldError

CHROMIUM = Path("/usr/bin/chromium")


def tiny_model(seed: int = 0) -> onnx.ModelProto:
    """data (1, 3, 8, 8) -> Conv+BN+Relu -> Conv+BN -> Add(residual) -> Relu -> GAP -> Flatten ->
    Gemm: 2 BatchNorms, 10 kernels unfused (the Flatten is a view), 4 after FoldBN +
    FuseEpilogue, in the blocked layout too (the pooled 1x1 map goes back to NCHW as a view)."""
    rng = np.random.default_rng(seed)
    c = 8
    params = {"w1": rng.normal(0, 0.3, (c, 3, 3, 3)), "w2": rng.normal(0, 0.2, (c, c, 3, 3)),
              "fc_w": rng.normal(0, 0.1, (4, c)), "fc_b": rng.normal(0, 0.1, 4)}
    for i in (1, 2):
        params[f"s{i}"], params[f"b{i}"] = rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c)
        params[f"m{i}"], params[f"v{i}"] = rng.normal(0, 0.1, c), rng.uniform(0.5, 2, c)
    node = helper.make_node
    nodes = [
        node("Conv", ["data", "w1"], ["c1"], pads=[1] * 4),
        node("BatchNormalization", ["c1", "s1", "b1", "m1", "v1"], ["n1"]),
        node("Relu", ["n1"], ["r1"]),
        node("Conv", ["r1", "w2"], ["c2"], pads=[1] * 4),
        node("BatchNormalization", ["c2", "s2", "b2", "m2", "v2"], ["n2"]),
        node("Add", ["n2", "r1"], ["a"]),
        node("Relu", ["a"], ["r2"]),
        node("GlobalAveragePool", ["r2"], ["g"]),
        node("Flatten", ["g"], ["f"]),
        node("Gemm", ["f", "fc_w", "fc_b"], ["out"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(a.astype(np.float32), k) for k, a in params.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """One report of the tiny model: avx2 (runs here), aarch64 and cuda-sm80 (static only)."""
    tmp = tmp_path_factory.mktemp("report")
    onnx.save(tiny_model(), tmp / "tiny.onnx")
    messages = []
    paths = report.run(["avx2", "aarch64", "cuda-sm80"], [str(tmp / "tiny.onnx")], tmp / "out",
                       repeat=2, say=messages.append)
    return paths, messages


def _rows(md: str, chip: str) -> dict[str, list[str]]:
    """Table rows of report.md for ``chip``: variant label -> cells."""
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 2 and cells[0] == chip:
            rows[cells[1]] = cells
    return rows


def test_report_files_and_every_image_embedded(tiny_report):
    paths, _ = tiny_report
    out = paths["md"].parent
    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} == {"kernels.png", "latency_tiny.png", "registers_tiny.png"}
    for png in pngs:
        Image.open(png).load()  # decodes
    md = paths["md"].read_text()
    for png in pngs:
        assert f"]({png.name})" in md
    page = paths["html"].read_text()
    sources = re.findall(r'<img[^>]*\bsrc="([^"]*)"', page)
    assert len(sources) == len(pngs) == page.count("<img")
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        image = Image.open(BytesIO(base64.b64decode(src.partition(",")[2])))
        image.load()
        assert image.size[0] > 100 and image.size[1] > 100
    # Self-contained: nothing else is fetched.
    assert not re.search(r'(?:href|src)="(?!data:)', page)


def test_report_latency_only_where_the_chip_runs(tiny_report):
    paths, _ = tiny_report
    md = paths["md"].read_text()
    header = next(line for line in md.splitlines() if line.startswith("| chip"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    median, kernels, bns, layout = (columns.index(c) for c in (
        "median ms", "kernels", "BNs left", "of which layout"))
    err, regs = columns.index("max abs err"), columns.index("max regs")
    here = _rows(md, "avx2")
    assert set(here) == {"unfused (each op its own kernel)", "stock TVM fusion", "FoldBN only",
                         "FoldBN+FuseEpilogue, NCHW (no blocked layout)",
                         "FoldBN+FuseEpilogue (default schedule)", "ONNX Runtime"}
    ours = here["FoldBN+FuseEpilogue (default schedule)"]
    float(ours[median])
    assert float(ours[err]) < 1e-4
    assert (ours[kernels], ours[layout], ours[bns]) == ("4", "0", "0")  # blocked by 8
    assert here["unfused (each op its own kernel)"][kernels] == "10"
    for chip in ("aarch64", "cuda-sm80"):
        rows = _rows(md, chip)
        assert "ONNX Runtime" not in rows
        assert len(rows) == (5 if chip == "aarch64" else 4)  # the NCHW row where ours blocks
        for cells in rows.values():
            assert cells[median] == "not run: no device"
            assert cells[err] == "-"
            assert cells[kernels] in ("10", "4")
        # aarch64 blocks channels by 4 (its 128-bit vectors), CUDA keeps NCHW: 4 kernels both.
        assert rows["FoldBN+FuseEpilogue (default schedule)"][kernels] == "4"
        # Static columns: registers from the asm (aarch64) or ptxas (or why not).
        ours = rows["FoldBN+FuseEpilogue (default schedule)"]
        assert ours[regs].isdigit() or "nvcc" in ours[regs] or "ptxas" in ours[regs]
    assert "practical peak" in md
    fma = float(md.split(f"FMA peak ({bench.FMA_LABEL}): avx2 ")[1].split()[0])
    assert fma > 0
    assert "% of the avx2 FMA peak" in md


def test_report_shows_progress_per_chip_model_variant(tiny_report):
    _, messages = tiny_report
    for variant in ("unfused", "stock", "foldbn", "nchw", "ours"):
        assert f"avx2/tiny/{variant}: compiling" in messages
    assert any(m.startswith("avx2/tiny: timing unfused, stock, foldbn, nchw, ours")
               for m in messages)
    assert any(m.startswith("aarch64/tiny:") for m in messages)
    assert any(m.startswith("cuda-sm80/tiny:") for m in messages)


def test_report_errors(tmp_path):
    with pytest.raises(BNFoldError, match="unknown chip 'z80'"):
        report.collect(["z80"], ["x.onnx"])
    with pytest.raises(BNFoldError, match="nothing to report"):
        report.write([], tmp_path)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium)")
def test_report_renders_in_headless_chromium(tiny_report, tmp_path):
    """Every plot decodes in a real browser: the page counts images with a natural width."""
    page = tiny_report[0]["html"].read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", (
        '<script>addEventListener("load", () => { document.body.dataset.rendered = '
        "[...document.images].filter(i => i.complete && i.naturalWidth > 0).length })"
        "</script></body>")))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([str(CHROMIUM), *flags, "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert 'data-rendered="3"' in dom
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)


def test_registers_plot_draws_the_budget_each_kernel_was_checked_against(monkeypatch, tmp_path):
    """The budget drawn over each bar is the one the register check used for that kernel: on
    avx2 the blocked convs against the whole register file (16), the NCHW mean and fc against
    14 (the register file less the reserve): not one line for the chip."""
    import tvm

    from tvm_bnfold import FoldBN, chips, fuse_epilogue, load_onnx, schedules
    from tvm_bnfold.register_pressure import CPU_RESERVE

    chip = chips.get("avx2")
    with chip.target:
        mod = FoldBN()(load_onnx(tiny_model()))
        fused = fuse_epilogue.fuse_graph(mod, block=chip.lanes("float32"))
        _, records = fuse_epilogue.schedule_kernels(fused, chip, measure=False)
    # The decision, independently of the records: each kernel's anchor and its budget.
    expected = {}
    for gvar, func in fused.functions.items():
        anchor = isinstance(func, tvm.tirx.PrimFunc) and schedules.analyze(func)
        if anchor:
            expected[gvar.name_hint] = schedules.register_budget(anchor, chip)
    blocked = {name for name in expected if "NCHWc" in name}
    assert len(blocked) == 2 and len(expected) == 4  # two blocked convs, the mean and the fc
    assert expected == {name: chip.vector_regs if name in blocked else
                        chip.vector_regs - CPU_RESERVE for name in expected}
    assert len(set(expected.values())) == 2  # one line for the chip would be wrong for some
    assert {rec.kernel: rec.budget for rec in records} == expected

    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig))
    result = report.Result(chip, "tiny", [], records, 0.0)
    drawn = report.plot_registers([result], "tiny", tmp_path / "registers.png")
    bars = drawn["avx2"]
    assert [b.kernel for b in bars] == [rec.kernel for rec in records]
    assert {b.kernel: b.budget for b in bars} == expected
    # What the figure shows: one budget segment centred on each bar, at that kernel's budget.
    (ax,) = figures[0].axes
    segments = [seg for coll in ax.collections for seg in coll.get_segments()]
    assert len(segments) == len(bars)
    at = {round(float(seg[:, 0].mean())): float(seg[0, 1]) for seg in segments}
    assert all(seg[0, 1] == seg[1, 1] for seg in segments)  # horizontal
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert {labels[x]: budget for x, budget in at.items()} == expected
    heights = {labels[i]: p.get_height() for i, p in enumerate(ax.patches)}
    assert heights == {rec.kernel: rec.registers for rec in records}
