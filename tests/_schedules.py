"""Fingerprints of every default schedule the project writes, to prove a refactor changes none.

For the two built-in models and the real-model corpus (the test sizes), on every CPU chip preset:
FuseEpilogue's scheduled kernels (``measure=False``: deterministic, no spill measurement), the
blocked and the NCHW graph; and for each distinct unscheduled kernel, its candidate tiles, its
schedule at each epilogue mode, its injective schedule and its MetaSchedule design spaces. Each
is a structural hash under a key that names the model, chip, kernel and variant.

    python tests/_schedules.py           # check every model against tests/data/schedules.json
    python tests/_schedules.py --write   # record the current code's digests there
    python tests/_schedules.py --models ocr_det,ocr_rec --write   # those models only

The file holds one digest per (model, chip) of its sorted fingerprints. Regenerate it only in a
commit that means to change a schedule, and say which. ``make test`` checks the models of
``tests/test_schedules_unchanged.py``; the command above checks them all (8 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

import tvm
import tvm_ffi

from _corpus import MODELS as CORPUS_MODELS
from _corpus import load
from tvm_bnfold import FoldBN, FuseEpilogue, chips, schedules
from tvm_bnfold.errors import BNFoldError
from tvm_bnfold.fuse_epilogue import WORKLOAD_ATTR
from tvm_bnfold.models import BUILTIN, _with_input_shapes, load_onnx
from tvm_bnfold.tuning import unpack_workload

FILE = pathlib.Path(__file__).parent / "data" / "schedules.json"
CHIPS = [c for c in chips.PRESETS.values() if c.kind == "cpu"]
#: Built-in models at a small input, the corpus at its test sizes.
SHAPES = {"resnet50": (1, 3, 64, 64), "mobilenetv2": (1, 3, 64, 64)}
MODELS = [*SHAPES, *CORPUS_MODELS]


def _module(name: str) -> tvm.IRModule:
    if name in SHAPES:
        proto = BUILTIN[name]()
        mod = load_onnx(_with_input_shapes(proto, {proto.graph.input[0].name: SHAPES[name]}))
    else:
        mod = load(name)[1]
    return FoldBN()(mod)


def _hash(obj) -> str:
    return f"{tvm_ffi.structural_hash(obj):016x}"


def _workload(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc | None:
    if func.attrs is None or WORKLOAD_ATTR not in func.attrs:
        return None
    return unpack_workload(func.attrs[WORKLOAD_ATTR])


def _kernel(func: tvm.tirx.PrimFunc, chip: chips.Chip) -> dict[str, str]:
    """Fingerprints of everything schedules does with one unscheduled kernel."""
    out = {}
    anchor = schedules.analyze(func)
    if anchor is None:
        injective = schedules.schedule_injective(func, chip)
        out["injective"] = "none" if injective is None else _hash(injective)
        return out
    tiles = schedules.candidate_tiles(anchor, chip)
    out["anchor"] = repr(anchor)
    out["tiles"] = repr(tiles)
    out["live"] = repr([schedules.live_vector_registers(anchor, t, chip) for t in tiles])
    for level in schedules.EPILOGUE_MODES:
        for i, tile in enumerate(tiles[:2]):
            try:
                out[f"{level}/{i}"] = _hash(schedules.schedule(func, chip, tile, level))
            except BNFoldError as err:
                out[f"{level}/{i}"] = f"error: {err}"
    spaces = schedules.design_spaces(tvm.s_tir.Schedule(func, seed=1), chip)  # sampled: seeded
    if spaces is not None:
        out["spaces"] = ",".join(_hash(s.mod) for s in spaces)
    return out


def fingerprints(models: list[str] | None = None) -> dict[str, str]:
    """Key -> fingerprint over ``models`` (default all of :data:`MODELS`) and :data:`CHIPS`."""
    out: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    for name in models or MODELS:
        mod = _module(name)
        for chip in CHIPS:
            for blocked in (None, False):
                with chip.target:
                    fused = FuseEpilogue(chip, measure=False, blocked=blocked)(mod)
                for gvar, func in sorted(fused.functions.items(), key=lambda kv: kv[0].name_hint):
                    if not isinstance(func, tvm.tirx.PrimFunc):
                        continue
                    key = f"{name}/{chip.name}/{'nchw' if blocked is False else 'default'}"
                    workload = _workload(func) or func
                    # The workload by its structure: its packed JSON also records how the
                    # importer's nodes were shared, which no schedule depends on.
                    unique = (chip.name, _hash(workload))
                    out[f"{key}/{gvar.name_hint}"] = (
                        f"{_hash(func.without_attr(WORKLOAD_ATTR))} {unique[1]}")
                    if unique in seen:
                        continue
                    seen.add(unique)
                    for part, value in _kernel(workload, chip).items():
                        out[f"{key}/{gvar.name_hint}/{part}"] = value
    return out


def digests(model: str) -> dict[str, str]:
    """``model/chip`` -> sha256 of that model's fingerprints on that chip (and their count)."""
    found = fingerprints([model])
    out = {}
    for chip in CHIPS:
        lines = sorted(f"{k} {v}" for k, v in found.items() if k.split("/")[1] == chip.name)
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        out[f"{model}/{chip.name}"] = f"{digest} {len(lines)}"
    return out


def recorded() -> dict[str, str]:
    return json.loads(FILE.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {FILE}")
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated models to check (default: all)")
    args = parser.parse_args()
    models = args.models.split(",")
    found = {k: v for model in models for k, v in digests(model).items()}
    before = recorded() if FILE.exists() else {}
    mine = {k for k in before if k.split("/")[0] in models}
    changed = sorted(k for k in found.keys() | mine if found.get(k) != before.get(k))
    print(f"{len(found)} digests, changed: {', '.join(changed) or 'none'}")
    if args.write:
        FILE.parent.mkdir(exist_ok=True)
        merged = {**{k: v for k, v in before.items() if k not in mine}, **found}
        FILE.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        print(f"wrote them to {FILE}")
    elif changed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
