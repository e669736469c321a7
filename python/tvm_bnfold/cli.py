"""The ``tvm-bnfold`` command."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter

import tvm

from . import chips
from .bench import compare, conv_count, op_counts, print_rows, use_all_cores
from .errors import BNFoldError
from .fold_bn import FoldBN
from .models import BUILTIN, get_model, load_onnx

logger = logging.getLogger("tvm_bnfold")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tvm-bnfold",
        description="Fold inference BatchNorm into conv/dense weights for Apache TVM (Relax).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every decision")
    sub = parser.add_subparsers(dest="command", required=True)
    model_help = f"an ONNX file or a built-in model ({', '.join(BUILTIN)})"

    p = sub.add_parser("fold", help="run FoldBN and print what folded into what, or why not")
    p.add_argument("model", help=model_help)

    p = sub.add_parser(
        "demo", help="fold a model, compile it with TVM before/after and compare the outputs"
    )
    p.add_argument("--model", default="resnet50", help=model_help)
    p.add_argument("--chip", default=None,
                   help="a chip that runs here (avx512, avx2); default: the widest one")

    args = parser.parse_args(argv)
    use_all_cores()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(message)s"
    )
    try:
        {"fold": _fold, "demo": _demo}[args.command](args)
    except (BNFoldError, OSError) as err:
        print(f"tvm-bnfold: error: {err}", file=sys.stderr)
        return 2
    return 0


def _fold(args) -> tuple[tvm.IRModule, tvm.IRModule, FoldBN]:
    mod = load_onnx(get_model(args.model))
    fold = FoldBN()
    start = time.perf_counter()
    folded = fold(mod)
    seconds = time.perf_counter() - start
    for record in fold.report:
        print(f"  {record}")
    actions = Counter(r.action for r in fold.report)
    print(f"{args.model}: {len(fold.report)} BatchNorms: " +
          ", ".join(f"{n} {a}" for a, n in sorted(actions.items())) + f" ({seconds:.2f} s)")
    return mod, folded, fold


def _demo(args) -> None:
    mod, folded, _ = _fold(args)
    before, after = op_counts(mod), op_counts(folded)
    print(f"BatchNorms: {before['nn.batch_norm']} -> {after['nn.batch_norm']}; "
          f"convs: {conv_count(before)} -> {conv_count(after)}")
    chip = chips.get(args.chip) if args.chip else chips.host_chip()
    print(f"\nCompiling and timing three variants for {chip.name} (default schedules):")
    print_rows(compare(mod, args.model, chip, repeat=10))


if __name__ == "__main__":
    sys.exit(main())
