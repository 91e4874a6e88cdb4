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
  e2e     paper 001 Table 3: ViT (Table 2 sizes) and GPT-3 Small/Medium with random weights, as
          Pre-LN, Pre-RMSNorm and Pre-CRMSNorm (converted by normfold, same function) and without
          norms (the floor); time normalized to Pre-LN and the share of the LN-to-no-norm gap
          captured. CPU: float32 and bfloat16; --device cuda: autocast (amp-bf16)
  convert conversion time and peak memory of `normfold convert` on the bundled model and a
          GPT-2-medium-sized random checkpoint
  un      inference of models with fused Unified Normalization vs their LayerNorm originals and
          the no-norm floor (ViT-Ti/16 and a small GPT-2; --batches, default 1,8)

on a GPU (one command each):
  normfold bench ops --device cuda     Triton kernels vs F.layer_norm / F.rms_norm /
                                       aten._fused_rms_norm / x.clone(), forward and backward
  normfold bench e2e --device cuda     adds ViT-L/16 and ViT-H/14
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run benchmark suites (CSV + markdown + PNG)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=list(SUITES), help="which suite")
    p.add_argument("model", nargs="?", metavar="MODEL", help="model for the 'model' suite (default: bundled)")
    p.add_argument("--out", default="benchmarks", metavar="DIR", help="output directory (default: ./benchmarks)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and rounds (a smoke run)")
    p.add_argument("--rounds", type=int, help="timed rounds per candidate (default: 30 ops, 40 model)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device", default="cpu", help="ops/e2e: cpu or cuda (default: cpu)")
    p.add_argument("--compile", action="store_true", help="e2e: also time every variant under torch.compile")
    p.add_argument("--models", type=_csv, metavar="M,..", help="e2e: subset of vit-tiny, vit-small, vit-base, "
                   "vit-large, vit-huge, gpt3-small, gpt3-medium")
    p.add_argument("--batches", type=_csv_int, metavar="B,..", help="e2e: ViT batch sizes (default 1,16,64); "
                   "un: batch sizes (default 1,8)")
    p.add_argument("--dtypes", type=_csv, metavar="D,..", help="e2e: float32, bfloat16, float16 (CPU or GPU), "
                   "amp-bf16, amp-fp16 (GPU autocast)")
    p.add_argument("--eager", action="store_true", help="ops --device cuda: time eager launches (with Python "
                   "overhead) instead of CUDA-graph replays")
    p.set_defaults(run=run)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _csv_int(text: str) -> list[int]:
    try:
        return [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _ops(args):
    progress = not args.quiet
    if args.device != "cpu":
        from ..bench import ops_gpu

        return ops_gpu.run(args.out, quick=args.quick, rounds=args.rounds, progress=progress, device=args.device,
                           graphs=not args.eager)
    from ..bench import ops

    return ops.run(args.out, quick=args.quick, rounds=args.rounds or (10 if args.quick else 30), progress=progress)


def _model(args):
    from ..bench import model

    kwargs = {"shapes": ((1, 64),), "dtypes": ("float32",)} if args.quick else {}
    return model.run(args.model, args.out, rounds=args.rounds or (5 if args.quick else 40),
                     progress=not args.quiet, **kwargs)


def _e2e(args):
    from ..bench import e2e

    return e2e.run(args.out, device=args.device, quick=args.quick, rounds=args.rounds, compile=args.compile,
                   progress=not args.quiet, models=args.models, batches=args.batches, dtypes=args.dtypes)


def _convert(args):
    from ..bench import convert

    return convert.run(args.out, quick=args.quick, rounds=args.rounds, progress=not args.quiet)


def _un(args):
    from ..bench import un

    batches = (1,) if args.quick else tuple(args.batches or (1, 8))
    return un.run(args.out, batches=batches, rounds=args.rounds or (5 if args.quick else 10), progress=not args.quiet)


# suite name -> runner(args) -> (rows, written paths)
SUITES = {"ops": _ops, "model": _model, "e2e": _e2e, "convert": _convert, "un": _un}


def run(args) -> int:
    from pathlib import Path

    rows, paths = SUITES[args.suite](args)
    print(Path(paths["md"]).read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0
