"""`normfold export ... --int-weights gptq | gptq-reduced`: the option checks and the GPTQ step shared by the
CTranslate2 and ONNX halves of `normfold export`."""

from __future__ import annotations

from ..errors import NormfoldError

GPTQ = ("gptq", "gptq-reduced")


class IntWeightsOptionError(NormfoldError):
    """An --int-weights combination that cannot be exported."""


def check_int_weights_onnx(args) -> None:
    """The ONNX half: int4 takes normfold (round to nearest, default) or gptq; int8 is quantize_dynamic's."""
    iw = args.int_weights
    if iw is None:
        args.int_weights = "normfold" if args.quantize == "int4" else None
        iw = args.int_weights
    if iw in ("normfold", "gptq") and args.quantize != "int4":
        raise IntWeightsOptionError(f"--int-weights {iw} with --onnx writes MatMulNBits 4-bit weights: add "
                                    "--quantize int4 (--quantize int8 is onnxruntime's quantize_dynamic)")
    if iw in ("engine", "normfold-reduced", "gptq-reduced"):
        raise IntWeightsOptionError(f"--int-weights {iw} is a CTranslate2 int8 option; with --onnx --quantize int4 "
                                    "use normfold or gptq")
    if args.asymmetric and iw != "gptq":
        raise IntWeightsOptionError("--asymmetric is for --quantize int4 --int-weights gptq")
    if args.block_size != 32 and args.quantize != "int4":
        raise IntWeightsOptionError("--block-size is for --quantize int4")
    if iw == "gptq" and args.original is not None:
        raise IntWeightsOptionError("--original with --int-weights gptq: the float file would hold the dequantized "
                                    "GPTQ weights; compare the original in a float export without --int-weights")
    check_gptq_options(args)


def check_int_weights_ct2(args) -> None:
    """The CTranslate2 half: every choice but engine needs an int8 type; int4 options are ONNX's."""
    if args.int_weights is None:
        args.int_weights = "engine"
    if args.int_weights != "engine" and not args.quantization.startswith("int8"):
        raise IntWeightsOptionError(f"--int-weights {args.int_weights} writes int8 weights: use --quantization int8 "
                                    f"or int8_float32, not {args.quantization}")
    if args.asymmetric or args.block_size != 32:
        raise IntWeightsOptionError("--asymmetric and --block-size are for ONNX --quantize int4: CTranslate2 int8 "
                                    "stores one symmetric scale per output row")
    check_gptq_options(args)


def check_gptq_options(args) -> None:
    if args.int_weights in GPTQ:
        if args.calibration is None:
            raise IntWeightsOptionError(f"--int-weights {args.int_weights} needs --calibration FILE (a text file, "
                                        "tokenized with DIR's tokenizer) or --calibration bundled (the bundled "
                                        "model's KJV training text; its tokenizer only)")
        if args.calibration_windows < 1:
            raise IntWeightsOptionError("--calibration-windows must be at least 1")
    elif args.calibration is not None or args.weight_clip or args.calibration_windows != 16:
        raise IntWeightsOptionError("--calibration, --calibration-windows and --weight-clip are for "
                                    "--int-weights gptq / gptq-reduced")


def calibration_batches(args):
    """Token-id batches for GPTQ (256-token windows, 8 a batch): checked before any model work."""
    from ..bench.quant_gptq import CalibrationError, calibration_batches as batches

    try:
        return batches(args.calibration, None if args.calibration == "bundled" else args.model,
                       windows=args.calibration_windows)
    except CalibrationError:
        raise
    except Exception as exc:  # the KJV text for 'bundled' comes from Debian's packages
        raise IntWeightsOptionError(f"--calibration {args.calibration}: no calibration text ({type(exc).__name__}: "
                                    f"{str(exc)[:200]}); give --calibration FILE") from None


def gptq(args, model, steps, *, bits: int, group_size: int | None, symmetric: bool, skip=()):
    """GPTQ of a copy of `model` on the calibration text: a `normfold.engines.intweights.GptqResult`."""
    from ..engines.intweights import gptq_model
    from ..quant.gptq import DEFAULT_CLIP_GRID

    batches = calibration_batches(args)
    tokens = sum(int(b.numel()) for b in batches)
    steps.start("gptq", f"GPTQ {bits}-bit weights on {tokens} calibration tokens ({args.calibration})")
    return gptq_model(model, batches, bits=bits, group_size=group_size, symmetric=symmetric,
                      clip=DEFAULT_CLIP_GRID if args.weight_clip else None, skip=skip, say=None)


def gptq_summary(res, args, bits: int, group_size: int | None, symmetric: bool) -> dict:
    from ..engines.intweights import objective_summary

    return {"method": args.int_weights, "bits": bits, "group_size": group_size, "symmetric": symmetric,
            "weight_clip": bool(args.weight_clip), "act_order": True, "calibration": args.calibration,
            "calibration_windows": args.calibration_windows,
            "float_layers": list(getattr(res, "skipped", [])),
            "per_row_layers": sorted(n for n, q in res.weights.items() if group_size and q.group_size is None),
            "objective_vs_rtn": objective_summary(res.objectives)}


def print_gptq(g: dict) -> None:
    o = g["objective_vs_rtn"]
    grid = (f"blocks of {g['group_size']}" if g["group_size"] else "one scale per output row") + \
        (", symmetric" if g["symmetric"] else ", asymmetric")
    print(f"  {g['method']}: {g['bits']}-bit, {grid}, act-order{', weight clip' if g['weight_clip'] else ''}, "
          f"calibration {g['calibration']} ({g['calibration_windows']} × 256 tokens)")
    if o.get("layers"):
        print(f"  GPTQ layer error ‖XWᵀ − XŴᵀ‖² / round-to-nearest's: median {o['ratio_median']:.3f}, "
              f"max {o['ratio_max']:.3f} ({o['below_rtn']} of {o['layers']} layers at or below)")
    if g["float_layers"]:
        print(f"  left float: {', '.join(g['float_layers'])} (a head tied to the embedding, as in the "
              "round-to-nearest int4 export)")
    if g["per_row_layers"]:
        print(f"  one scale per output row (input width not a multiple of {g['group_size']}): "
              f"{len(g['per_row_layers'])} linears")
