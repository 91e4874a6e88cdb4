"""`normfold verify ORIGINAL CONVERTED`."""

from __future__ import annotations

import argparse
import json

from .ui import Steps, sci, table

DESCRIPTION = """\
Run ORIGINAL and CONVERTED side by side and report the errors of CONVERTED.

CONVERTED is a directory written by `normfold convert` (loaded with normfold's fast norms) or any
model directory. Both run on the same inputs (random tokens or --text): in float64 (the stored
weights' rounding included, so the tolerance is 1024 ulp of their dtype) and in their own dtype,
next to ORIGINAL's own error against its float64 version. Residual-stream hidden states are
compared after removing their per-token mean (the converted model carries the recentred stream).
"""


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="compare a converted model with its original", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="exit codes: 0 pass, 1 errors beyond tolerance, 2 bad input")
    p.add_argument("original", metavar="ORIGINAL", help="the original model directory or hub id")
    p.add_argument("converted", metavar="CONVERTED", help="the converted model directory")
    p.add_argument("--text", help="verify on this text (ORIGINAL's tokenizer) instead of random tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    import torch

    from .. import io
    from ..adapters import find_adapter
    from ..errors import NormfoldError, UnsupportedModelError
    from ..verify import CENTERED_OUTPUTS, compare_models
    from .convert_cmd import _text_inputs

    steps = Steps(total=3, quiet=args.quiet)
    steps.start("load", f"loading {args.original} and {args.converted}")
    original, _ = io.load_source(args.original)
    conv_path = Path(args.converted)
    if (conv_path / io.REPORT_FILE).is_file():
        converted = io.load(conv_path)
        centered = tuple(converted.normfold_report.centered_outputs) or CENTERED_OUTPUTS
    else:
        converted, _ = io.load_source(args.converted)
        centered = CENTERED_OUTPUTS
    if type(original).__name__ != type(converted).__name__:
        raise NormfoldError(f"ORIGINAL is a {type(original).__name__} but CONVERTED is a {type(converted).__name__}")
    steps.start("inputs", "preparing inputs")
    if args.text:
        inputs = _text_inputs(args.original, args.text)
    else:
        gen = torch.Generator().manual_seed(args.seed)
        try:
            inputs = find_adapter(original).example_inputs(original, gen)
        except UnsupportedModelError:
            from ..adapters.base import _default_inputs

            inputs = _default_inputs(original, gen)
    steps.start("verify", "running both models")
    result = compare_models(original, converted, inputs, centered=centered).to_dict()
    steps.end()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        f = result["fp64"]
        rows = [["float64 (stored weights)", sci(f["max_abs_error"]), sci(f["max_rel_error"]),
                 f"{'pass' if f['passed'] else 'FAIL'} (tolerance {f['tolerance']:.1e})"],
                [f"{result['dtype']}: converted vs original", sci(result["max_abs_error"]), sci(result["max_rel_error"]),
                 "" if result["top1_agreement"] is None else f"top-1 agreement {100 * result['top1_agreement']:.2f}%"],
                [f"{result['dtype']}: original vs float64 self", sci(result["baseline"]["max_abs_error"]),
                 sci(result["baseline"]["max_rel_error"]), "floating-point baseline"],
                [f"{result['dtype']}: converted within 4x baseline", "", "",
                 "pass" if result["working"]["passed"] else "FAIL"]]
        print(table(rows, header=["verification", "max abs", "max rel", ""]))
        print(f"\n  {'PASS' if result['passed'] else 'FAIL'}: {args.converted} vs {args.original}")
    return 0 if result["passed"] else 1
