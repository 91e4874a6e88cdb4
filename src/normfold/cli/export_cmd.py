"""`normfold export DIR --onnx OUT.onnx` and `normfold export DIR --ctranslate2 OUT`."""

from __future__ import annotations

import argparse
import json

from .export_int import check_int_weights_onnx
from .ui import Steps, sci, table

DESCRIPTION = """\
Export a converted checkpoint (a directory written by `normfold convert`, or any Hugging Face model
directory) to ONNX with torch's dynamo exporter, run the result once in onnxruntime on the same
inputs as the PyTorch model, and report the error like `normfold verify` does.

The norms are written as the standard RMSNormalization op at opset 23 and newer, and as their
decomposition (ReduceMean / Sqrt / Reciprocal / Mul) at opsets 18 to 22; the compressed CRMSNorm
has no standard op and is always decomposed. Opsets below 18 are refused: torch's exporter writes
opset 18 or newer. Batch and sequence axes are dynamic where the exporter can make them so.

--original exports the source model too (OUT with `-original` before the suffix) and compares both
ONNX models with the original PyTorch model: the deployed conversion against what it replaces.
--optimize applies onnxruntime's transformer optimizer (attention and norm fusions) to the file.

--ctranslate2 OUT writes a CTranslate2 model directory instead (GPT-2, OPT, GPT-NeoX/Pythia, GPT-J,
BLOOM, Falcon, GPT-BigCode, Whisper, mBART): RMSNorm wherever the stream is zero-mean inside the
engine, LayerNorm (unit γ, zero β) where the engine cannot express normfold's Recenter step (the
Whisper encoder after its conv stem, BLOOM and mBART after their embedding LayerNorm); the export
prints which. --quantization picks the engine's weight type; the model is run once in CTranslate2
against the PyTorch model (float32: within 1e-4 and the same greedy tokens, else exit 1; integer
and half types: the error and top-1 agreement are printed).
"""

EPILOG = """\
examples:
  normfold convert ./my-gpt2 --out ./gpt2-rms
  normfold export ./gpt2-rms --onnx gpt2-rms.onnx                  opset 23: RMSNormalization
  normfold export ./gpt2-rms --onnx gpt2-rms.onnx --opset 18       decomposed norms (older runtimes)
  normfold export ./gpt2-rms --onnx gpt2-rms.onnx --original ./my-gpt2 --optimize
  normfold export ./gpt2-rms --ctranslate2 ./gpt2-rms-ct2 --quantization int8
  normfold export ./gpt2-rms --ctranslate2 ./ct2-gptq --quantization int8 --int-weights gptq-reduced \\
      --calibration calib.txt                                    GPTQ int8 rows within ±63
  normfold export ./gpt2-rms --onnx m-int4.onnx --quantize int4 --int-weights gptq --calibration calib.txt \\
      --block-size 64 --asymmetric                               GPTQ 4-bit weights in MatMulNBits

integer weights (--int-weights WHO):
  engine            CTranslate2 int8 (default there): the engine rounds each output row (absmax, ±127)
  normfold          normfold rounds to nearest in the model's own (e.g. rotated) basis: CTranslate2 int8
                    rows (±127), or ONNX int4 blocks (the default of --quantize int4)
  normfold-reduced  CTranslate2: the same within ±63; AVX2 int8 GEMMs without VNNI add pairs of u8 x s8
                    products in int16 with saturation, and 2 x 255 x 63 fits where 2 x 255 x 127 does not
  gptq              GPTQ (Frantar et al., arXiv:2210.17323): each column's rounding error is compensated
                    on the columns not yet rounded, using the inverse Hessian X^T X of the layer's inputs
                    on --calibration text; layer by layer (each block calibrated on the blocks before it
                    already quantized), act-order, every linear (ONNX: a tied head stays float).
                    CTranslate2 int8: one scale per output row, ±127; ONNX int4 (--quantize int4):
                    MatMulNBits blocks of --block-size columns, symmetric or --asymmetric. The integers in the file are GPTQ's
                    own levels; the export prints GPTQ's layer error against round-to-nearest's and the
                    engine's output against the model with the dequantized weights
  gptq-reduced      CTranslate2 int8: GPTQ on the ±63 grid (no int16 saturation, as normfold-reduced)

exit codes: 0 ok, 1 the ONNX model's outputs differ from PyTorch's beyond tolerance,
            2 bad input (missing onnx packages, an opset that cannot express the model; nothing written)
"""

# ONNX against the PyTorch model it was exported from, relative to the largest output value
# (measured: ~1e-6 in float32, onnxruntime's kernels round differently from torch's).
INT_WEIGHTS = ("engine", "normfold", "normfold-reduced", "gptq", "gptq-reduced")

TOLERANCE = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 3e-2, "float16": 1e-2}


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a converted model to ONNX and check it in onnxruntime",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="DIR", help="converted checkpoint (normfold convert --out) or model directory")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--onnx", metavar="OUT", help="the ONNX file to write")
    target.add_argument("--ctranslate2", metavar="OUT", help="the CTranslate2 model directory to write")
    p.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="ONNX: integer weights after the float check: int8 = onnxruntime's quantize_dynamic "
                        "(per-channel int8 weights, per-tensor uint8 activations); int4 = MatMulNBits with "
                        "normfold's 4-bit weights (blocks of 32 input columns); the error is reported")
    p.add_argument("--quantization", default="float32", metavar="TYPE",
                   help="CTranslate2 weight type: float32 (default), int8, int8_float32, int16, float16, bfloat16")
    p.add_argument("--int-weights", choices=INT_WEIGHTS, default=None, metavar="WHO",
                   help="who computes the integer weights (see 'integer weights' below): engine, normfold, "
                        "normfold-reduced, gptq, gptq-reduced")
    p.add_argument("--calibration", metavar="FILE|bundled", default=None,
                   help="--int-weights gptq*: calibration text, a UTF-8 file tokenized with DIR's tokenizer.json, "
                        "or 'bundled' (KJV chapters of the bundled model's training split; its tokenizer only)")
    p.add_argument("--calibration-windows", type=int, default=16, metavar="N",
                   help="--int-weights gptq*: windows of 256 calibration tokens (default 16)")
    p.add_argument("--block-size", type=int, choices=(32, 64, 128), default=32,
                   help="--quantize int4: input columns per 4-bit scale (default 32); with gptq, a linear whose "
                        "input width it does not divide gets one scale per output row")
    p.add_argument("--asymmetric", action="store_true",
                   help="--quantize int4 --int-weights gptq: levels 0..15 with a zero point per block "
                        "(default symmetric, -7..7)")
    p.add_argument("--weight-clip", action="store_true",
                   help="--int-weights gptq*: search each row's range ratio (1.0 .. 0.5) on the calibration "
                        "Hessian before GPTQ")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 23: the first with RMSNormalization)")
    p.add_argument("--original", nargs="?", const="", default=None, metavar="MODEL",
                   help="also export the source model (default: the `source` in DIR's normfold.json) and "
                        "compare both ONNX models with it")
    p.add_argument("--optimize", action="store_true", help="apply onnxruntime's transformer optimizer to the file(s)")
    p.add_argument("--static", action="store_true", help="fixed input shapes (default: dynamic batch and sequence)")
    p.add_argument("--text", help="check on this text (the model's tokenizer) instead of random inputs")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(run=run)


def _inputs(model, args, model_dir):
    import torch

    from ..unified.fuse import example_inputs
    from .convert_cmd import text_inputs

    if args.text:
        return text_inputs(model_dir, args.text)
    return example_inputs(model, torch.Generator().manual_seed(args.seed))


def _export_checked(model, inputs, out, args, steps, label):
    """Export `model` to `out` (atomically), optionally optimize, run in onnxruntime; returns
    (export info, ONNX outputs, PyTorch outputs)."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from .. import deploy
    from ..verify import flatten_outputs

    out = Path(out)
    steps.start(f"export-{label}", f"exporting {label} to {out} (opset {args.opset})")
    tmp = Path(tempfile.mkdtemp(prefix=".normfold-export-", dir=out.parent))
    try:
        info = deploy.export_onnx(model, inputs, tmp / out.name, opset=args.opset, dynamic=not args.static)
        if info.note:
            steps.note(info.note)
        if args.optimize:
            kind = deploy.optimize(tmp / out.name, tmp / ("opt-" + out.name), getattr(model, "config", None))
            os.replace(tmp / ("opt-" + out.name), tmp / out.name)
            info.op_counts = deploy.op_counts(tmp / out.name)
            steps.note(f"onnxruntime transformer optimizer applied (model type {kind})")
        steps.start(f"run-{label}", f"running {label} in onnxruntime and in PyTorch")
        got = deploy.run_onnx(tmp / out.name, info, inputs)
        with torch.no_grad():
            want = flatten_outputs(model(**inputs, **deploy.call_kwargs(model)))
        if getattr(args, "quantize", None):
            from ..engines import ort_quant

            steps.note(f"quantizing to {args.quantize} after the float check")
            kw = {}
            if args.quantize == "int4":
                kw = {"block_size": args.block_size}
                if getattr(args, "gptq_table", None) is not None:
                    kw["weights"] = args.gptq_table.lookup
            ort_quant.quantize_file(tmp / out.name, args.quantize, **kw)
            info.op_counts = deploy.op_counts(tmp / out.name)
            info.quantized = deploy.run_onnx(tmp / out.name, info, inputs)
        for f in tmp.iterdir():  # the model and its external data file, if any
            os.replace(f, out.parent / f.name)
        info.path = out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info, got, want


def _diff(got, want, centered):
    from ..verify import diff_outputs, top1_agreement

    diffs = diff_outputs(got, want, centered=centered)
    return {"max_abs_error": max((d.max_abs for d in diffs), default=0.0),
            "max_rel_error": max((d.max_rel for d in diffs), default=0.0),
            "top1_agreement": top1_agreement(got, want),
            "outputs": [{"name": d.name, "max_abs": d.max_abs, "max_rel": d.max_rel} for d in diffs]}


def run(args) -> int:
    if args.ctranslate2 is not None:
        from .export_ct2 import run_ct2

        return run_ct2(args)
    from pathlib import Path

    from .. import deploy
    from ..errors import NormfoldError, OutputExistsError
    from ..modelinfo import working_dtype
    from ..verify import CENTERED_OUTPUTS

    deploy.require_onnx()
    if args.quantization != "float32":
        raise NormfoldError("--quantization is a CTranslate2 option; with --onnx use --quantize")
    check_int_weights_onnx(args)
    args.opset = deploy.DEFAULT_OPSET if args.opset is None else args.opset
    deploy.check_opset(args.opset)  # before any model is loaded: a refusal costs nothing
    out = Path(args.onnx)
    orig_out = out.with_name(out.stem + "-original" + (out.suffix or ".onnx"))
    targets = [out] + ([orig_out] if args.original is not None else [])
    for t in targets:
        if t.exists() and not args.force:
            raise OutputExistsError(f"{t} exists (use --force to overwrite)")
        if not t.parent.is_dir():
            raise NormfoldError(f"{t.parent}: no such directory for the ONNX file")
    steps = Steps(total=2 + 2 * (args.original is not None) + 1 + (args.int_weights == "gptq"), quiet=args.quiet)
    steps.start("load", f"loading {args.model}")
    from .model_input import load_model

    model, report = load_model(args.model)
    original = None
    if args.original is not None:
        src = getattr(report, "source", None) or {}
        source = args.original or src.get("path") or src.get("model")
        if not source:
            raise NormfoldError(f"{args.model} names no source model: pass --original MODEL")
        from .. import io

        original, _ = io.load_source(source)
        original.eval()
    inputs = _inputs(model, args, args.model)
    float_model, gptq_res = model, None
    if args.int_weights == "gptq":
        from .export_int import gptq

        from ..engines.intweights import tied_head

        head = tied_head(model)  # stays float, as in the RTN int4 file (its weight is the embedding's transpose)
        gptq_res = gptq(args, model, steps, bits=4, group_size=args.block_size, symmetric=not args.asymmetric,
                        skip=[head] if head else [])
        model, args.gptq_table = gptq_res.model, gptq_res.table  # exported: the dequantized GPTQ weights
    centered = tuple(getattr(report, "centered_outputs", None) or ()) or CENTERED_OUTPUTS
    info, got, want = _export_checked(model, inputs, out, args, steps, "model")
    dtype = str(working_dtype(model)).replace("torch.", "")
    tol = TOLERANCE.get(dtype, 1e-4)
    result = {"onnx": str(out), "opset": args.opset, "quantize": args.quantize, "dtype": dtype, "tolerance": tol, "dynamic": info.dynamic,
              "optimized": args.optimize, "ops": info.op_counts,
              "onnx_vs_pytorch": _diff(got, want, ())}
    if args.quantize:
        result["int_weights"] = args.int_weights
        if gptq_res is None:
            result["quantized_vs_pytorch"] = _diff(info.quantized, want, ())
        else:
            import torch

            from ..verify import flatten_outputs
            from .export_int import gptq_summary

            with torch.no_grad():
                want_float = flatten_outputs(float_model(**inputs, **deploy.call_kwargs(float_model)))
            result["quantized_vs_pytorch"] = _diff(info.quantized, want_float, ())
            result["quantized_vs_dequantized"] = _diff(info.quantized, want, ())
            result["gptq"] = gptq_summary(gptq_res, args, 4, args.block_size, not args.asymmetric)
    if original is not None:
        oinfo, ogot, owant = _export_checked(original, inputs, orig_out, args, steps, "original")
        result["original"] = {"onnx": str(orig_out), "ops": oinfo.op_counts,
                              "onnx_vs_pytorch": _diff(ogot, owant, ())}
        result["onnx_vs_original_pytorch"] = _diff(got, owant, centered)
    steps.end()
    passed = result["onnx_vs_pytorch"]["max_rel_error"] <= tol and (
        original is None or result["original"]["onnx_vs_pytorch"]["max_rel_error"] <= tol)
    result["passed"] = passed
    _print(args, result)
    return 0 if passed else 1


def _row(label, d):
    top1 = d.get("top1_agreement")
    return [label, sci(d["max_abs_error"]), sci(d["max_rel_error"]),
            "" if top1 is None else f"top-1 agreement {100 * top1:.2f}%"]


def _print(args, result: dict) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
        return
    rows = [_row("ONNX (onnxruntime) vs PyTorch, converted", result["onnx_vs_pytorch"])]
    if "quantized_vs_pytorch" in result:
        rows.append(_row(f"ONNX {result['quantize']} vs PyTorch, converted (not checked)",
                         result["quantized_vs_pytorch"]))
    if "quantized_vs_dequantized" in result:
        rows.append(_row(f"ONNX {result['quantize']} vs PyTorch, GPTQ weights dequantized",
                         result["quantized_vs_dequantized"]))
    if "original" in result:
        rows.append(_row("ONNX converted vs PyTorch original", result["onnx_vs_original_pytorch"]))
        rows.append(_row("ONNX original vs PyTorch original", result["original"]["onnx_vs_pytorch"]))
    print(table(rows, header=["check", "max abs", "max rel", ""]))
    ops = result["ops"]
    norms = {k: v for k, v in ops.items() if "Normalization" in k}
    print(f"\n  {result['onnx']}: opset {result['opset']}, {sum(ops.values())} nodes"
          f"{', ' + ', '.join(f'{v} {k}' for k, v in sorted(norms.items())) if norms else ''}"
          f"{', dynamic batch/sequence' if result['dynamic'] else ', static shapes'}"
          f"{', optimized' if result['optimized'] else ''}")
    if "gptq" in result:
        from .export_int import print_gptq

        print_gptq(result["gptq"])
    print(f"  {'PASS' if result['passed'] else 'FAIL'}: ONNX within {result['tolerance']:.0e} of PyTorch "
          f"({result['dtype']})")
