"""`normfold export DIR --ctranslate2 OUT [--quantization TYPE]`: the CTranslate2 half of `normfold export`."""

from __future__ import annotations

import json

from .export_int import GPTQ, check_int_weights_ct2
from .ui import Steps, sci, table

# CTranslate2 against the PyTorch model, relative to the largest logit (measured ~1e-7 in float32).
TOLERANCE = 1e-4


def _tokenizer(model_dir):
    """The directory's tokenizer, or None (the export then writes placeholder tokens "<i>")."""
    from pathlib import Path

    from ..checkpoint import ModelDir

    d = Path(model_dir)
    names = {f.name for f in ModelDir(d).auxiliary_files()} if d.is_dir() else set()
    if not names & {"tokenizer.json", "vocab.json", "tokenizer_config.json", "sentencepiece.bpe.model"}:
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d))
    except Exception:
        return None
    return tok if len(tok.get_vocab()) > 1 else None


def run_ct2(args) -> int:
    from pathlib import Path

    import torch

    from ..checkpoint import ModelDir
    from ..engines import ct2
    from ..io.atomic import check_output_dir
    from .model_input import load_model

    ct2.require_ctranslate2()
    ct2.check_quantization(args.quantization)
    check_int_weights_ct2(args)
    if args.original is not None or args.optimize or args.opset is not None or args.static or args.quantize:
        raise ct2.CTranslate2Error("--original, --optimize, --opset, --static and --quantize are ONNX options; "
                                   "not used with --ctranslate2")
    out = check_output_dir(args.ctranslate2, args.force)
    steps = Steps(total=4 + (args.int_weights in GPTQ), quiet=args.quiet)
    steps.start("load", f"loading {args.model}")
    model, report = load_model(args.model)
    model.eval()
    if model.dtype != torch.float32:
        model = model.float()
    float_model, gptq_res = model, None
    own = {"normfold": "rtn", "normfold-reduced": "rtn-reduced"}.get(args.int_weights)
    if args.int_weights in GPTQ:
        from ..engines.intweights import calibration_forward
        from ..quant import from_quantized
        from .export_int import gptq

        ct2.check_family(model)  # refuse before calibrating
        calibration_forward(model)
        bits = 8 if args.int_weights == "gptq" else 7  # 7: the ±63 grid, stored as int8
        gptq_res = gptq(args, model, steps, bits=bits, group_size=None, symmetric=True)
        model = gptq_res.model

        def own(w, _t=gptq_res.table):
            return from_quantized(_t.lookup(w))
    steps.start("layout", "laying the model out as a CTranslate2 spec")
    tokenizer = _tokenizer(args.model)
    spec = ct2.build_spec(model, report, tokenizer)  # refuses a family before anything is written
    files = ModelDir(args.model).auxiliary_files() if Path(args.model).is_dir() else []
    steps.start("write", f"writing {out} ({args.quantization})")
    ct2.write(spec, out, args.quantization, files=files, force=args.force,
              own_weights=own)
    steps.start("run", "running it in CTranslate2 and the model in PyTorch")
    gen = torch.Generator().manual_seed(args.seed)
    ids = None
    if args.text:
        from .convert_cmd import text_inputs

        ids = text_inputs(args.model, args.text)["input_ids"]
    inputs = ct2.check_inputs(model, spec.kind, gen, ids=ids)
    got = ct2.engine_logits(out, spec.kind, inputs)
    want = ct2.torch_logits(float_model, spec.kind, inputs)
    result = {"ctranslate2": str(out), "quantization": args.quantization, "kind": spec.kind,
              "int_weights": args.int_weights, "layer_norm_epsilon": spec.eps,
              "streams": spec.streams, "centred_tables": spec.centred_tables,
              "norms": [{"name": n.name, "form": n.form, "why": n.why, "stream": n.stream} for n in spec.norms],
              "vocabulary": "tokenizer" if tokenizer is not None else "placeholder tokens <i> (no tokenizer in DIR)",
              "bytes": ct2.model_bytes(out), "ct2_vs_pytorch": ct2.compare(got, want, spec.kind),
              "tolerance": TOLERANCE}
    if gptq_res is not None:
        from .export_int import gptq_summary

        result["ct2_vs_dequantized"] = ct2.compare(got, ct2.torch_logits(model, spec.kind, inputs), spec.kind)
        result["gptq"] = gptq_summary(gptq_res, args, 8 if args.int_weights == "gptq" else 7, None, True)
    if spec.kind == "generator":
        result["greedy_equal"] = ct2.greedy_equal(out, float_model, inputs)
    steps.end()
    exact = args.quantization == "float32"
    passed = (result["ct2_vs_pytorch"]["max_rel_error"] <= TOLERANCE and result.get("greedy_equal", True)) \
        if exact else True
    result["checked"] = "float32: error and greedy tokens" if exact else "integer/half type: error reported"
    result["passed"] = passed
    _print(args, result)
    return 0 if passed else 1


def _print(args, result: dict) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
        return
    d = result["ct2_vs_pytorch"]
    top1 = d.get("top1_agreement")
    rows = [["CTranslate2 vs PyTorch", sci(d["max_abs_error"]), sci(d["max_rel_error"]),
             "" if top1 is None else f"top-1 agreement {100 * top1:.2f}%"]]
    if "ct2_vs_dequantized" in result:
        d = result["ct2_vs_dequantized"]
        top1 = d.get("top1_agreement")
        rows.append(["CTranslate2 vs PyTorch, GPTQ weights dequantized", sci(d["max_abs_error"]),
                     sci(d["max_rel_error"]), "" if top1 is None else f"top-1 agreement {100 * top1:.2f}%"])
    print(table(rows, header=["check", "max abs", "max rel", ""]))
    if "gptq" in result:
        from .export_int import print_gptq

        print_gptq(result["gptq"])
    forms: dict[str, int] = {}
    for n in result["norms"]:
        forms[n["form"]] = forms.get(n["form"], 0) + 1
    print(f"\n  {result['ctranslate2']}: {result['quantization']}, {result['bytes'] / 1e6:.1f} MB, "
          + ", ".join(f"{v} {k}" for k, v in sorted(forms.items()))
          + (f", layer_norm_epsilon {result['layer_norm_epsilon']:g}" if result["layer_norm_epsilon"] else ""))
    for stream, form in result["streams"].items():
        if any(n["stream"] == stream for n in result["norms"]):
            print(f"  {stream} stream: {form}")
    if result["centred_tables"]:
        print(f"  centred embedding table(s) written in place of the Recenter after them: "
              f"{', '.join(result['centred_tables'])}")
    if "greedy_equal" in result:
        print(f"  greedy tokens {'equal' if result['greedy_equal'] else 'DIFFER'}")
    if result["passed"] and result["quantization"] == "float32":
        print(f"  PASS: CTranslate2 within {result['tolerance']:.0e} of PyTorch (float32), same greedy tokens")
    elif result["quantization"] == "float32":
        print(f"  FAIL: CTranslate2 differs from PyTorch beyond {result['tolerance']:.0e} (float32)")
    else:
        print(f"  {result['quantization']}: error and top-1 agreement above are the quantization's (not checked)")
