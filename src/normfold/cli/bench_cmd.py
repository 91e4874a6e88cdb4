"""`normfold bench SUITE`."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Benchmark suites. Each writes CSV + markdown (+ PNG with matplotlib) to --out, with the machine it
ran on, and prints the markdown table. Runs are interleaved (every round times each candidate once,
in rotating order) after a warm-up; medians and quartiles are reported.

suites:
  ops     norm forward, backward and fused residual add: normfold RMSNorm / CRMSNorm vs
          F.layer_norm (with weight and bias), F.rms_norm and x.clone() (the memory-bandwidth
          floor), float32 / bfloat16 / float16 (--quick: float32 and bfloat16, 3 shapes)
  model   end-to-end forward of a model (default: the bundled one) before and after conversion,
          and with a naive F.rms_norm swap for comparison
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run benchmark suites (CSV + markdown + PNG)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=["ops", "model"], help="which suite")
    p.add_argument("model", nargs="?", metavar="MODEL", help="model for the 'model' suite (default: bundled)")
    p.add_argument("--out", default="benchmarks", metavar="DIR", help="output directory (default: ./benchmarks)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and rounds (a smoke run)")
    p.add_argument("--rounds", type=int, help="timed rounds per candidate (default: 30 ops, 15 model)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    if args.suite == "ops":
        from ..bench import ops

        rounds = args.rounds or (10 if args.quick else 30)
        rows, paths = ops.run(args.out, quick=args.quick, rounds=rounds, progress=not args.quiet)
    else:
        from ..bench import model

        rounds = args.rounds or (5 if args.quick else 15)
        kwargs = {"shapes": ((1, 64),), "dtypes": ("float32",)} if args.quick else {}
        rows, paths = model.run(args.model, args.out, rounds=rounds, progress=not args.quiet, **kwargs)
    print(Path(paths["md"]).read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0
