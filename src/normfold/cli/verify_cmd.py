"""`normfold verify ORIGINAL CONVERTED`."""

from __future__ import annotations

import argparse
import json

from .ui import Steps, sci, skipped_lines, table

DESCRIPTION = """\
Run ORIGINAL and CONVERTED side by side and report the errors of CONVERTED.

With one argument (`normfold verify CONVERTED`), check a normfold checkpoint without its original:
every file through the path policy, normfold.json against its schema and against config.json and the
weights, and each weight file against the SHA-256 recorded when it was written (the changed file is
named; exit code 1). The digests live in normfold.json itself: this catches a corrupted or edited weight
file, not someone who rewrites the report too.

CONVERTED is a directory written by `normfold convert` (loaded with normfold's fast norms) or any
model directory. Both run on the same inputs (random tokens or --text): in float64 (the stored
weights' rounding included, so the tolerance is 1024 ulp of float32, 8 ulp of bfloat16/float16) and
in their own dtype, next to ORIGINAL's own error against its float64 version. Residual-stream hidden states are
compared after removing their per-token mean (the converted model carries the recentred stream).

Checkpoints above 1 GiB of weights (both together) are verified block by block in bounded memory
(--blockwise forces it, --no-blockwise forbids it): the models are built without weights, each
block's weights are read from the safetensors files just before it runs and dropped after it, and
every converted block also runs on the original's hidden states, so a wrong block is named.
"""

# Above this many bytes of weights (ORIGINAL + CONVERTED on disk), verify block by block: the
# in-memory check holds both models plus float64 copies (about 6x the float32 weights).
BLOCKWISE_THRESHOLD = 1 << 30


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="compare a converted model with its original", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="exit codes: 0 pass, 1 errors beyond tolerance, 2 bad input")
    p.add_argument("original", metavar="ORIGINAL", help="the original model directory or hub id (alone: the "
                   "converted directory, checked against the digests its normfold.json recorded)")
    p.add_argument("converted", metavar="CONVERTED", nargs="?", help="the converted model directory")
    p.add_argument("--text", help="verify on this text (ORIGINAL's tokenizer) instead of random tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--blockwise", action=argparse.BooleanOptionalAction, default=None,
                   help="verify block by block in bounded memory (default: when the weights exceed 1 GiB; "
                        "needs local safetensors checkpoints)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers import Python code shipped with ORIGINAL (configs with an auto_map); "
                        "without it such models are refused and nothing from them runs")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    import torch

    from .. import io
    from ..adapters import example_inputs
    from ..errors import NormfoldError
    from ..verify import CENTERED_OUTPUTS, FinalNorms, compare_models
    from .convert_cmd import text_inputs

    if args.converted is None:
        return _run_integrity(args)
    if _use_blockwise(args):
        return _run_blockwise(args)
    steps = Steps(total=3, quiet=args.quiet)
    output_map, skip, final_norms = None, (), None
    steps.start("load", f"loading {args.original} and {args.converted}")
    original, _ = io.load_source(args.original, trust_remote_code=args.trust_remote_code)
    conv_path = Path(args.converted)
    if (conv_path / io.REPORT_FILE).is_file():
        converted = io.load(conv_path)
        centered = tuple(converted.normfold_report.centered_outputs) or CENTERED_OUTPUTS
        rotation = converted.normfold_report.structure.rotation
        if rotation:  # a rotated stream: compare in the original basis; the final norms' γ/β are in the heads
            from ..rotate import unrotate_outputs

            output_map = unrotate_outputs(rotation, centered)
            # a final norm's output lacking γ/β (in the heads, an encoder's in the cross-attention) is skipped, a
            # head-less final norm's (γ/β kept, un-rotated) compared, as normfold.convert does (verify.FinalNorms)
            final_norms = FinalNorms.of(converted.normfold_report.structure)
    else:
        converted, _ = io.load_source(args.converted, trust_remote_code=args.trust_remote_code)
        centered = CENTERED_OUTPUTS
    if type(original).__name__ != type(converted).__name__:
        raise NormfoldError(f"ORIGINAL is a {type(original).__name__} but CONVERTED is a {type(converted).__name__}")
    steps.start("inputs", "preparing inputs")
    if args.text:
        inputs = text_inputs(args.original, args.text)
    else:
        gen = torch.Generator().manual_seed(args.seed)
        inputs = example_inputs(original, gen, seq=16)
    steps.start("verify", "running both models")
    result = compare_models(original, converted, inputs, centered=centered, output_map=output_map,
                            skip=skip, final_norms=final_norms).to_dict()
    steps.end()
    return _print_result(args, result)


def _run_integrity(args) -> int:
    """`normfold verify CONVERTED`: schema, structure and the recorded SHA-256 of every weight file."""
    from pathlib import Path

    from .. import io
    from ..checkpoint import ModelDir, check_digests, weight_files
    from ..errors import CheckpointError, NormfoldError

    path = Path(args.original)
    steps = Steps(total=1, quiet=args.quiet)
    steps.start("check", f"checking {path} against its normfold.json")
    if not path.is_dir():
        raise NormfoldError(f"{path}: no such directory (with one argument, verify checks a normfold checkpoint)")
    directory = ModelDir(path)
    if not directory.exists(io.REPORT_FILE):
        raise CheckpointError(f"{path} has no {io.REPORT_FILE}: with one argument, verify checks a normfold "
                              "checkpoint against the digests it recorded; to compare any model with its original "
                              "run `normfold verify ORIGINAL CONVERTED`")
    report, _, _, stock = io.inspect_converted(path)
    if not report.weight_files:
        raise CheckpointError(f"{path / io.REPORT_FILE} records no weight-file digests (report written by an older "
                              "normfold, before format 2); verify it against its original with `normfold verify "
                              "ORIGINAL CONVERTED`, or reconvert it")
    found = weight_files(directory, io.STOCK_INDEX, io.STOCK_WEIGHTS) if stock else None
    files = found[0] if found else io.normfold_weight_files(directory)
    rows = check_digests({f.name: f for f in files}, report.weight_files)
    steps.end()
    bad = [r for r in rows if r["status"] != "ok"]
    if args.json:
        print(json.dumps({"passed": not bad, "files": rows}, indent=2))
    else:
        print(table([[r["file"], r["status"], (r["sha256"] or "")[:16]] for r in rows],
                    header=["weight file", "status", "sha256"]))
        if bad:
            what = "; ".join(f"{r['file']} {r['status']}" for r in bad[:5])
            print(f"\n  FAIL: {what}: the weights differ from those normfold wrote (recorded in {io.REPORT_FILE}); "
                  "re-download the checkpoint or reconvert the model")
        else:
            print(f"\n  PASS: {len(rows)} weight file(s) match the SHA-256 recorded in {io.REPORT_FILE}")
    return 1 if bad else 0


def _weights_bytes(path) -> int | None:
    """Bytes of safetensors weights in a local directory (None: not a local directory)."""
    from pathlib import Path

    path = Path(path)
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _use_blockwise(args) -> bool:
    if args.blockwise is not None:
        return args.blockwise
    sizes = [_weights_bytes(args.original), _weights_bytes(args.converted)]
    return None not in sizes and sum(sizes) > BLOCKWISE_THRESHOLD


def _run_blockwise(args) -> int:
    import sys

    from ..stream.blockverify import verify_blockwise
    from ..stream.progress import VERIFY_PASS_WEIGHTS, Reporter, Work

    inputs = None
    if args.text:
        from .convert_cmd import text_inputs

        inputs = text_inputs(args.original, args.text)
    steps = Steps(total=1, quiet=args.quiet)
    steps.start("verify", f"verifying {args.converted} against {args.original} block by block")

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"      {msg}", file=sys.stderr, flush=True)

    # one time-left estimate over the five passes, weighted as in `normfold convert`'s lines
    progress = Reporter(say, Work({"verify": sum(VERIFY_PASS_WEIGHTS)}))
    result = verify_blockwise(args.original, args.converted, inputs=inputs, seed=args.seed, progress=progress)
    steps.end()
    return _print_result(args, result)


def _print_result(args, result: dict) -> int:
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
        blocks = f.get("blocks")
        if blocks:
            worst = max(blocks, key=lambda b: b["max_rel"])
            n_bad = sum(not b["passed"] for b in blocks)
            rows.insert(1, [f"float64 per block ({len(blocks)}, on the original's input)", sci(worst["max_abs"]),
                            sci(worst["max_rel"]), "pass" if not n_bad else f"FAIL ({n_bad} blocks)"])
        print(table(rows, header=["verification", "max abs", "max rel", ""]))
        failed = (result.get("blockwise") or {}).get("failed_blocks")
        if failed:
            print(f"\n  blocks beyond tolerance: {', '.join(failed)}")
        heads = [h["name"] for h in (f.get("heads") or []) + (f.get("embeddings") or []) if not h["passed"]]
        if heads:
            print(f"  outside the blocks, beyond tolerance: {', '.join(heads)}")
        for line in skipped_lines(result):
            print(line)
        print(f"\n  {'PASS' if result['passed'] else 'FAIL'}: {args.converted} vs {args.original}")
    return 0 if result["passed"] else 1
