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
  calls   per-call time of normfold.nn.RMSNorm (as a conversion builds it) and CRMSNorm vs
          nn.LayerNorm at decode sizes ((1, d), (16, d)), every dtype
  epilogue
          the norm folded into the next matrix multiply (normfold.nn.NormLinear: (x·Wᵀ)·s + b) vs
          RMSNorm then F.linear vs F.linear alone, at GPT-2 small's QKV / MLP shapes, float32 and
          bfloat16 (--compile adds both forms under torch.compile)
  e2e     paper 001 Table 3: ViT (Table 2 sizes) and GPT-3 Small/Medium with random weights, as
          Pre-LN, Pre-RMSNorm and Pre-CRMSNorm (converted by normfold, same function) and without
          norms (the floor), plus a second Pre-LN copy as an A/A control; time as per-round
          ratios to Pre-LN, the share of the LN-to-no-norm gap captured and (CPU) the norms' own
          time from forward hooks. CPU: float32 and bfloat16; --device cuda: autocast (amp-bf16)
  hf      transformers models through the public API (normfold.convert -> save -> load):
          ViT-S/16 at batch 1 and GPT-2 small's shape (4 layers with --quick, 256 tokens), float32
          and bfloat16: original vs an A/A copy, Pre-RMS, Pre-CRMS and no norm at all (the floor),
          per-round paired ratios, gap captured, the norms' share of the forward from hooks
  convert conversion time and peak memory of `normfold convert` on the bundled model and a
          GPT-2-medium-sized random checkpoint
  un      inference of models with fused Unified Normalization vs their LayerNorm originals and
          the no-norm floor (ViT-Ti/16 and a small GPT-2; --batches, default 1,8)
  train   training from scratch (the bundled model's architecture on its KJV text): LayerNorm vs
          normfold.train Pre-RMSNorm / Pre-CRMSNorm vs a naive RMSNorm swap vs LayerNorm from θ₀
          moved by 1 ulp (the float32 chaos floor); loss curves (CSV, PNG)
          (--steps, default 120; --text FILE: the KJV as printed by Debian's `bible` tool)
  quant   fake quantization (RTN, W8A8 / W4A8 / W4A4 per token and per tensor, W8 / W4 weight-only) of
          MODEL (default: the bundled one; perplexity on held-out KJV chapters) and of a GPT-2 with outlier
          channels: original vs plain vs rotated (--rotate hadamard) vs rotated + online Hadamard, with
          activation crest factors at the linears' inputs (docs/rotation.md); --gptq: GPTQ vs RTN
          weights (group sizes, clipping searched per layer, online Hadamard on the attention output
          too) calibrated on --calibration FILE|bundled; --kv: a 4-bit KV cache with and without the
          value/output and query/key rotations, and W16A4 (4-bit activations on float weights)
  train-speed
          training step time (forward + backward + AdamW) of LayerNorm vs normfold.train-prepared
          models: the bundled model (8x256) and ViT-S/16 (batch 8), eager and torch.compile

  onnx    converted models in onnxruntime (2 threads, all graph optimisations, float32): the
          original vs Pre-RMS (RMSNormalization at opset 23, decomposed at opset 18, onnxruntime's
          SimplifiedLayerNormalization) vs Pre-CRMS vs the no-norm floor, and both after
          onnxruntime's transformer optimizer; an A/A control (GPT-2 width x 4 layers at 256
          tokens, ViT-S/16; --quick: GPT-2 x 2 layers at 128 tokens). Needs the onnx extra.

on a GPU (one command each):
  normfold bench ops --device cuda     Triton kernels vs F.layer_norm / F.rms_norm /
                                       aten._fused_rms_norm / x.clone(), forward and backward
  normfold bench e2e --device cuda     adds ViT-L/16 and ViT-H/14
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run benchmark suites (CSV + markdown + PNG)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=list(SUITES), help="which suite")
    p.add_argument("model", nargs="?", metavar="MODEL", help="model for the 'model' and 'quant' suites (default: bundled)")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default: "
                   "benchmarks/<suite>/<machine>-<date>, e.g. benchmarks/hf/epyc-avx2-2026-12-07)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and rounds (a smoke run)")
    p.add_argument("--rounds", type=int, help="timed rounds per candidate (default: 30 ops, 40 model)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device", default="cpu", help="ops/e2e/hf: cpu or cuda (default: cpu)")
    p.add_argument("--compile", action="store_true", help="e2e: also time every variant under torch.compile")
    p.add_argument("--models", type=_csv, metavar="M,..", help="e2e: subset of vit-tiny, vit-small, vit-base, "
                   "vit-large, vit-huge, gpt3-small, gpt3-medium")
    p.add_argument("--batches", type=_csv_int, metavar="B,..", help="e2e: ViT batch sizes (default 1,16,64); "
                   "un: batch sizes (default 1,8)")
    p.add_argument("--dtypes", type=_csv, metavar="D,..", help="ops, model: float32, bfloat16, float16; "
                   "e2e: those (CPU or GPU) and amp-bf16, amp-fp16 (GPU autocast)")
    p.add_argument("--to", default="rmsnorm", choices=["rmsnorm", "crmsnorm"],
                   help="model: crmsnorm also times Pre-CRMSNorm (d-1 stream) and its zero-padded form (--pad)")
    p.add_argument("--eager", action="store_true", help="ops --device cuda: time eager launches (with Python "
                   "overhead) instead of CUDA-graph replays")
    p.add_argument("--engine", choices=("ctranslate2", "onnxruntime"), default=None,
                   help="quant: real int8 runs in this engine, paired per input against the engine's own "
                        "conversion of the original (instead of fake quantization)")
    p.add_argument("--steps", type=int, help="train: optimizer steps (default 120)")
    p.add_argument("--gptq", action="store_true", help="quant: GPTQ vs round-to-nearest weights with clipping "
                   "search, group sizes, online rotations (writes quant_gptq.*); with --engine: GPTQ's integer "
                   "weights in the engine (CTranslate2 int8 rows, onnxruntime int4 MatMulNBits; quant_<engine>_gptq.*)")
    p.add_argument("--kv", action="store_true", help="quant: a 4-bit KV cache (absmax / clipped, with and without "
                   "the value/output and query/key rotations) and 4-bit activations on float weights (W16A4), "
                   "with the per-site error against a Gaussian vector's (writes quant_kv.*)")
    p.add_argument("--calibration", metavar="FILE|bundled", help="quant --gptq / --kv: calibration text (default "
                   "'bundled': KJV verses from the bundled model's training split, disjoint from the evaluation)")
    p.add_argument("--text", metavar="FILE", help="train: KJV text file (default: from Debian's bible-kjv packages)")
    p.add_argument("--no-compile", action="store_true", help="train-speed: eager only")
    p.add_argument("--dropout", action="store_true", help="train-speed: keep the models' dropout (p = 0.1): "
                   "the cost of normfold's exact dropout handling")
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

    return ops.run(args.out, quick=args.quick, rounds=args.rounds or (10 if args.quick else 30), progress=progress,
                   dtypes=_plain_dtypes(args.dtypes))


def _model(args):
    from ..bench import model

    kwargs = {"shapes": ((1, 64),), "dtypes": ("float32",)} if args.quick else {}
    if args.dtypes:
        kwargs["dtypes"] = _plain_dtypes(args.dtypes)
    return model.run(args.model, args.out, rounds=args.rounds or (5 if args.quick else 40),
                     progress=not args.quiet, to=args.to, **kwargs)


PLAIN_DTYPES = ("float32", "bfloat16", "float16")


def _plain_dtypes(names):
    return _dtypes_of(names, PLAIN_DTYPES)


def _calls(args):
    from ..bench import calls

    return calls.run(args.out, rounds=args.rounds or (5 if args.quick else 30), progress=not args.quiet,
                     dtypes=_plain_dtypes(args.dtypes), shapes=[(1, 768), (16, 768)] if args.quick else None)


def _epilogue(args):
    from ..bench import epilogue

    return epilogue.run(args.out, rounds=args.rounds or (5 if args.quick else 30), progress=not args.quiet,
                        dtypes=_dtypes_of(args.dtypes, epilogue.DTYPES), compile_=args.compile,
                        shapes=epilogue.SHAPES[:2] if args.quick else None)


def _dtypes_of(names, allowed):
    if not names:
        return None
    bad = [n for n in names if n not in allowed]
    if bad:
        raise BenchOptionError(f"--dtypes: {', '.join(bad)} not one of {', '.join(allowed)} for this suite")
    return tuple(names)


def _e2e(args):
    from ..bench import e2e

    return e2e.run(args.out, device=args.device, quick=args.quick, rounds=args.rounds, compile=args.compile,
                   progress=not args.quiet, models=args.models, batches=args.batches, dtypes=args.dtypes)


def _hf(args):
    from ..bench import hf

    return hf.run(args.out, quick=args.quick, rounds=args.rounds, progress=not args.quiet,
                  dtypes=_dtypes_of(args.dtypes, tuple(hf.DTYPES)), device=args.device)


def _convert(args):
    from ..bench import convert_cost

    return convert_cost.run(args.out, quick=args.quick, rounds=args.rounds, progress=not args.quiet)


def _un(args):
    from ..bench import un

    batches = (1,) if args.quick else tuple(args.batches or (1, 8))
    return un.run(args.out, batches=batches, rounds=args.rounds or (5 if args.quick else 10), progress=not args.quiet)


def _onnx(args):
    from ..bench import onnxrt

    return onnxrt.run(args.out, quick=args.quick, rounds=args.rounds, progress=not args.quiet)


def _train(args):
    from ..bench import train

    steps = args.steps or (20 if args.quick else 120)
    return train.run(args.out, steps=steps, text=args.text, progress=not args.quiet,
                     eval_every=5 if args.quick else 20)


def _quant(args):
    if args.engine and args.kv:
        raise BenchOptionError("'quant --engine' measures the engines' runs; --kv is a fake-quantized comparison: "
                               "run it separately")
    if args.engine:
        from ..bench import quant_engine

        if args.calibration is not None and not args.gptq:
            raise BenchOptionError("--calibration is for 'quant --gptq' (with or without --engine)")

        rows, _speed, paths = quant_engine.run(args.engine, args.model, args.out, inputs=8 if args.quick else 24,
                                               rounds=args.rounds or (3 if args.quick else 15),
                                               progress=not args.quiet, text=args.text, gptq=args.gptq,
                                               calibration=args.calibration or "bundled")
        return rows, paths
    from ..bench import quant

    if args.kv:
        if args.gptq:
            raise BenchOptionError("'quant --kv' and 'quant --gptq' write different tables: run them separately")
        from ..bench import quant_kv

        return quant_kv.run(args.model, args.out, calibration=args.calibration or "bundled", quick=args.quick,
                            progress=not args.quiet, text=args.text)
    if args.gptq:
        from ..bench import quant_gptq

        return quant_gptq.run(args.model, args.out, calibration=args.calibration or "bundled", quick=args.quick,
                              progress=not args.quiet, text=args.text)
    if args.calibration is not None:
        raise BenchOptionError("--calibration is for 'quant --gptq' and 'quant --kv'")
    return quant.run(args.model, args.out, quick=args.quick, progress=not args.quiet, text=args.text)


def _train_speed(args):
    from ..bench import train

    return train.run_speed(args.out, rounds=args.rounds or (3 if args.quick else 15), quick=args.quick,
                           compile=not args.no_compile, progress=not args.quiet, dropout=args.dropout)


# suite name -> runner(args) -> (rows, written paths)
SUITES = {"ops": _ops, "calls": _calls, "model": _model, "epilogue": _epilogue, "e2e": _e2e, "hf": _hf,
          "convert": _convert, "un": _un, "train": _train, "train-speed": _train_speed, "quant": _quant,
          "onnx": _onnx}


# The options each suite honours; any other option given a non-default value is refused (exit 2)
# rather than silently ignored.
ACCEPTS = {
    "ops": {"quick", "rounds", "device", "dtypes", "eager"},
    "model": {"model", "quick", "rounds", "dtypes", "to"},
    "calls": {"quick", "rounds", "dtypes"},
    "epilogue": {"quick", "rounds", "dtypes", "compile"},
    "e2e": {"quick", "rounds", "device", "compile", "models", "batches", "dtypes"},
    "hf": {"quick", "rounds", "dtypes", "device"},
    "convert": {"quick", "rounds"},
    "un": {"quick", "rounds", "batches"},
    "train": {"quick", "steps", "text"},
    "train-speed": {"quick", "rounds", "no_compile", "dropout"},
    "quant": {"model", "quick", "text", "gptq", "kv", "calibration", "engine", "rounds"},
    "onnx": {"quick", "rounds"},
}
_DEFAULTS = {"model": None, "quick": False, "rounds": None, "device": "cpu", "compile": False, "models": None,
             "batches": None, "dtypes": None, "eager": False, "to": "rmsnorm",
             "steps": None, "text": None, "gptq": False, "kv": False, "calibration": None, "no_compile": False, "dropout": False,
             "engine": None}


class BenchOptionError(ValueError):
    pass


def _refused(args) -> list[str]:
    out = []
    for opt, default in _DEFAULTS.items():
        if getattr(args, opt, default) != default and opt not in ACCEPTS[args.suite]:
            out.append("MODEL" if opt == "model" else "--" + opt.replace("_", "-"))
    if args.suite == "ops" and args.device == "cpu" and args.eager:
        out.append("--eager (only with --device cuda)")
    if args.suite == "ops" and args.device != "cpu" and args.dtypes:
        out.append("--dtypes (only on cpu)")
    return out


def run(args) -> int:
    import sys
    from pathlib import Path

    refused = _refused(args)
    if refused:
        print(f"normfold bench {args.suite}: does not take {', '.join(refused)} "
              f"(it honours: {', '.join(sorted(ACCEPTS[args.suite])) or 'no options'})", file=sys.stderr)
        return 2
    if args.device == "cpu" and not args.quiet:
        from ..ops import cpu

        st = cpu.status()
        call = f", called via {st['call']}" + (f" ({st['call_note']})" if st["call_note"] else "")
        print(f"normfold CPU kernel: {st['isa'] + ' path' + call if st['available'] else 'unavailable (' + str(st['error']) + ')'}"
              f" (this CPU: {st['cpu_isa']})", file=sys.stderr)
    if args.out is None:
        from ..bench.results import default_out
        from ..bench.timing import machine_info

        suite = args.suite + ("-engine" if getattr(args, "engine", None) else "")
        args.out = str(default_out(suite, machine_info()))
    try:
        rows, paths = SUITES[args.suite](args)
    except BenchOptionError as exc:
        print(f"normfold bench {args.suite}: {exc}", file=sys.stderr)
        return 2
    print(Path(paths["md"]).read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0
