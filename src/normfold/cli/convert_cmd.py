"""`normfold convert [MODEL] --to rmsnorm --out DIR`."""

from __future__ import annotations

import argparse

from .ui import Steps, sci, skipped_lines, table

HELP = "convert a model and verify it (Pre-LN -> Pre-RMSNorm / Pre-CRMSNorm, and back)"

DESCRIPTION = """\
Convert MODEL into an arithmetically equivalent model and write it to DIR.

MODEL is a local Hugging Face model directory (config.json + weights) or a hub id (needs a network).
Without MODEL, the bundled default model is used: a small GPT-2 trained on the King James Bible.

What happens (--to rmsnorm):
  1. the embedding tables and every residual-branch output projection are centred, so the
     residual stream is zero-mean for every input (paper 001, Lemma 3.1);
  2. each LayerNorm's scale (and shift, where all its readers have a bias) is folded into the
     linear layers that read it (--keep-affine keeps them in the norm instead);
  3. each LayerNorm becomes an RMSNorm with the same eps: on zero-mean input they are equal;
  4. original and converted run side by side: in float64 (relative error must be <= 1e-9) and in
     the model's dtype (the conversion must add no more error than the original already has
     against its own float64 version);
  5. DIR is written atomically: weights (safetensors), config, tokenizer files, normfold.json.

--to un is different: every LayerNorm becomes a UnifiedNorm (paper 004) initialised from its scale,
shift and eps, for fine-tuning. That changes the model's function, so nothing is verified (the report
says so); after fine-tuning, `normfold fuse DIR --out DIR2` folds the norms into the linear layers.

--to crmsnorm goes one step further (paper 001 §3.2): the zero-mean stream keeps only its first d-1
coordinates (the last is minus the sum of the others), every writer drops its last output, every
reader folds the dropped input into the others, and every norm becomes a CRMSNorm. --pad keeps the
shapes d-wide with a zero last coordinate instead. Loads with normfold.load only.

MODEL may also be a normfold checkpoint: --to rmsnorm decompresses a Pre-CRMSNorm one, --to layernorm
turns a Pre-RMSNorm / Pre-CRMSNorm one back into the stock Pre-LN architecture (paper 001 App. C).

The result loads with plain transformers (AutoModelForCausalLM.from_pretrained(DIR)) where the
report says stock_reloadable, and with normfold.load(DIR) to get normfold's fast RMSNorm kernels.
A tied embedding/head (GPT-2, OPT, Whisper, ...) stays one tensor: the table stays the original,
shared with the stock head, and a Recenter after the embedding centres its output; plain
transformers reloads it too (its LayerNorms re-centre their input, so it needs no Recenter).
With --fold-final the head takes the final norm's γ and reads the centred table plus its row
means (normfold.load only). --untie writes an untied copy of the centred table instead. The
summary states the size change (parameters, weight bytes, files on disk) and which loader reads the result.
"""

EPILOG = """\
examples:
  normfold convert --out ./kjv-rms                    the bundled model
  normfold convert ./my-dinov2 --out ./dinov2-rms     no adapter: the plan normfold analyze derives
  normfold convert ./gpt2 --out ./gpt2-rms --auto     the derived plan although GPT-2 has an adapter
  normfold convert ./gpt2 --out ./gpt2-rms --force    replace an existing output directory
  normfold convert ./gpt2 --out ./gpt2-rms --untie    untied head, the table copied centred (+vocab x d)
  normfold convert ./gpt2 --out ./gpt2-rms --dtype bfloat16 --json > report.json
  normfold convert --to crmsnorm --out ./kjv-crms     Pre-CRMSNorm, d-1 stream (--pad: d, zero last)
  normfold convert ./kjv-crms --to layernorm --out ./kjv-ln   back to the stock Pre-LN architecture

A model whose family has no adapter is converted with the plan `normfold analyze` derives from a trace
(on inputs made from its config, or --inputs FILE.safetensors); the summary lists every LayerNorm it
converted or kept, and why.

exit codes: 0 converted and verified; 1 verification failed (nothing written unless
--save-failed); 2 bad input: missing MODEL, not a model, no LayerNorm that can be converted, existing DIR
without --force (message on stderr, nothing written).
"""


def add_parser(sub) -> None:
    from ..conversion import VARIANTS

    p = sub.add_parser("convert", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="HF model directory or hub id (default: the bundled kjv-gpt2 model)")
    p.add_argument("--to", default="rmsnorm", choices=sorted(VARIANTS), help="conversion target (default: rmsnorm)")
    p.add_argument("--out", metavar="DIR", help="output directory (required unless --dry-run)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists (only once the new one is complete)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "float64"],
                   help="load MODEL in this dtype and convert in it (default: the checkpoint's dtype)")
    p.add_argument("--keep-affine", action="store_true",
                   help="keep each norm's scale/shift inside the RMSNorm instead of folding them into readers")
    p.add_argument("--fold-final", action="store_true",
                   help="also fold final norms (ln_f) into the linear heads (logits unchanged; the returned "
                        "last hidden state then lacks the affine)")
    p.add_argument("--allow-new-bias", action="store_true",
                   help="let readers without a bias grow one to absorb the norm's shift (not stock-reloadable)")
    p.add_argument("--untie", action="store_true",
                   help="give a head tied to the embedding table its own copy of the (centred) table, no Recenter: "
                        "the untied plain transformers form (vocab x d more parameters). By default the tie is "
                        "kept (the original table and the stock head, a Recenter after the embedding, which stock "
                        "from_pretrained also reloads; with --fold-final the head reads the centred table plus its "
                        "row means: normfold.load only)")
    p.add_argument("--pad", action="store_true",
                   help="--to crmsnorm: keep every tensor d-wide with a zero last stream coordinate instead of d-1 "
                        "(paper 001 §3.4.2, for hardware that handles d-1 poorly)")
    p.add_argument("--rotate", choices=["hadamard", "orthogonal"], default=None,
                   help="rotate the residual stream by an orthogonal Q fixing the all-ones direction after the "
                        "Pre-RMSNorm conversion (randomized Hadamard where the width has a construction, else a "
                        "random orthogonal matrix); exact, for int8/int4 quantization (docs/rotation.md)")
    p.add_argument("--rotate-seed", type=int, default=0, metavar="N", help="seed of the rotation (default 0)")
    p.add_argument("--rotate-online", action="store_true",
                   help="with --rotate: also rotate the input of every MLP down-projection by a Hadamard at run "
                        "time (exact; for 4-bit activations; the checkpoint then needs normfold.load)")
    p.add_argument("--rotate-attention", choices=["vo", "online", "both", "qk", "all"], default=None,
                   help="with --rotate: rotations inside attention, exact. vo = each head's values ·H and the "
                        "output projection's rows of that head Hᵀ· (H a randomized head_dim Hadamard, seeded by "
                        "--rotate-seed; weights only, nothing added, stock-reloadable when the rest is; families: "
                        "GPT-2, GPT-Neo, GPT-J, GPT-NeoX, OPT, Phi, Falcon, BLOOM); online = a Hadamard on the "
                        "heads' concatenated output before the output projection at run time (for 4-bit "
                        "activations there; needs normfold.load); both; qk = each head's queries and keys ·R "
                        "(for a 4-bit KV cache: in the Q/K weights for learned positions and ALiBi, after the "
                        "rotary positions at run time for GPT-NeoX, GPT-J, Phi, Falcon, then needing "
                        "normfold.load); all = both + qk. online streams (shard by shard); the others convert "
                        "in memory (--stream always refuses them)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="option of the conversion target, repeatable (--to un: M, M_grad, warmup, alpha, "
                        "outlier_filtration; e.g. --option warmup=500)")
    p.add_argument("--auto", action="store_true",
                   help="use the plan derived from the analysis even when MODEL's family has an adapter "
                        "(models without one always get it)")
    p.add_argument("--inputs", metavar="FILE",
                   help="trace and verify on these forward inputs: a .safetensors file, one tensor per "
                        "keyword argument (e.g. pixel_values at another image size)")
    p.add_argument("--text", help="verify on this text (tokenized with MODEL's tokenizer) instead of random tokens")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers import Python code shipped with MODEL (configs with an auto_map or an "
                        "unknown model_type); without it such models are refused and nothing from them runs")
    p.add_argument("--seed", type=int, default=0, help="seed of the random verification inputs (default 0)")
    p.add_argument("--fp64-tol", type=float, default=1e-9, metavar="TOL",
                   help="max relative error of the float64 check (default 1e-9)")
    p.add_argument("--dry-run", action="store_true", help="convert and verify, write nothing")
    p.add_argument("--save-failed", action="store_true", help="write DIR even if verification fails")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout instead of a table")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--stream", choices=["auto", "always", "never"], default="auto",
                   help="convert a safetensors checkpoint shard by shard in bounded memory, verified block by "
                        "block above 256 MB: auto (default) whenever MODEL is a local directory of safetensors "
                        "weights that can stream: --to rmsnorm, --to crmsnorm (--pad), --rotate (--rotate-online, "
                        "--rotate-attention online, explicit rotation hooks: BLOOM, CLIP, Whisper, ...), and a Pre-RMSNorm or Pre-CRMSNorm "
                        "normfold checkpoint --to layernorm (the way "
                        "back); in memory when an option needs the model (--inputs, --text, "
                        "--auto, --option, --dry-run, --dtype, --to un, --rotate-attention vo|both), for Pre-CRMSNorm checkpoints --to "
                        "rmsnorm, and for sources streaming cannot read; "
                        "always = stream or exit 2 saying why; never = in memory (docs/large-checkpoints.md)")
    p.set_defaults(run=run)


def text_inputs(model_dir, text: str) -> dict:
    from pathlib import Path

    from ..checkpoint import ModelDir
    from ..errors import NormfoldError

    if Path(model_dir).is_dir():  # the tokenizer files through the path policy before transformers reads them
        ModelDir(model_dir).check_all()
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise NormfoldError(f"--text needs a tokenizer in the model directory: {exc}") from exc
    ids = tok(text, return_tensors="pt")["input_ids"]
    if ids.numel() == 0:
        raise NormfoldError("--text produced no tokens")
    return {"input_ids": ids}




def parse_options(pairs: list[str]) -> dict:
    """--option KEY=VALUE pairs; values parsed as JSON where possible (500, 0.9, true), else strings."""
    import json

    from ..errors import NormfoldError

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise NormfoldError(f"--option expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def run(args) -> int:
    from .. import io
    from .convert_stream import maybe_stream

    streamed = maybe_stream(args, summarize=summary)  # normfold.stream decides; None = in memory
    if streamed is not None:
        return streamed
    if args.out and not args.dry_run:
        io.check_output_dir(args.out, args.force)  # fail before any work (and before taking the lock)
        with io.output_lock(args.out):
            return _run_in_memory(args)
    return _run_in_memory(args)


def _run_in_memory(args) -> int:
    import torch

    from .. import io
    from ..conversion import convert
    from ..errors import NormfoldError, VerificationFailedError
    from ..options import ConvertOptions

    if not args.dry_run and not args.out:
        raise NormfoldError("--out DIR is required (or --dry-run to convert and verify without writing)")
    if args.out and not args.dry_run:
        io.check_output_dir(args.out, args.force)  # fail before any work
    options = parse_options(args.option)
    # every rule on how the options combine, before any work (ConvertOptions.check, as convert() runs it again)
    ConvertOptions(to=args.to, pad=bool(args.pad), untie=bool(getattr(args, "untie", False))).check()
    steps = Steps(total=3 if args.dry_run else 4, quiet=args.quiet)

    steps.start("load", f"loading {args.model or 'the bundled default model (kjv-gpt2)'}")
    model, source = _load(args.model, args.dtype, trust_remote_code=args.trust_remote_code)
    inputs = None
    if args.text:
        inputs = text_inputs(source["path"] or args.model, args.text)
    if getattr(args, "inputs", None):
        from ..analysis.autoplan import load_inputs

        inputs = {**(inputs or {}), **load_inputs(args.inputs)}
    adapter, analysis = _adapter(model, args, inputs, steps)
    n_params = sum(p.numel() for p in model.parameters())
    steps.note(f"{source['architecture']}, {n_params / 1e6:.1f} M parameters, adapter: {adapter.display_name}")

    steps.start("convert", f"converting to {args.to}")
    steps_verify = {"started": False}

    def progress(msg: str) -> None:
        if msg.startswith("verifying") and not steps_verify["started"]:
            steps_verify["started"] = True
            steps.start("verify", msg)
        else:
            steps.note(msg)

    if inputs is None:
        inputs = adapter.example_inputs(model, torch.Generator().manual_seed(args.seed))
    elif analysis is not None:
        inputs = analysis.inputs  # the traced inputs (with the flags verify runs the model with)
    converted, report = convert(model, to=args.to, keep_affine=args.keep_affine, fold_final=args.fold_final,
                                allow_new_bias=args.allow_new_bias, adapter=adapter, inputs=inputs,
                                fp64_tol=args.fp64_tol, progress=progress, variant_options=options,
                                pad=bool(args.pad), rotate=args.rotate, rotate_seed=args.rotate_seed,
                                rotate_online=args.rotate_online,
                                rotate_attention=getattr(args, "rotate_attention", None),
                                untie=getattr(args, "untie", False),
                                discard_original=True)  # not used again: verified in place (3x, not 5x)
    del model  # now a float64 copy of the conversion (2x the checkpoint): freed before saving
    report.source = source
    v = report.verification
    # A variant that is not output-exact (--to un) has nothing to verify: its report says so.
    passed = bool(v and (v["passed"] or v.get("performed") is False))
    steps.end()

    written = None
    if not args.dry_run and (passed or args.save_failed):
        steps.start("save", f"writing {args.out}")
        written = io.save(converted, report, args.out, force=args.force, source_dir=source["path"])
        disk = io.weight_file_bytes(source["path"]) if source.get("path") else 0
        if disk:
            after = io.weight_file_bytes(written)
            report.size["disk_bytes"] = {"before": disk, "after": after, "change": after - disk}
            io.rewrite_report(written, report)
    steps.end()
    report.seconds.update({k: round(v, 3) for k, v in steps.times.items()})

    if args.json:
        print(report.to_json())
    else:
        print(summary(report, written, args))
        if analysis is not None:
            print(derived_summary(analysis))
    if not passed:
        raise VerificationFailedError(
            "verification failed: the converted model's outputs differ beyond tolerance (see the table above)"
            + ("" if written else "; nothing was written (use --save-failed to keep it anyway)"))
    return 0


def _adapter(model, args, inputs, steps):
    """The registered adapter, or (none registered / --auto) the plan derived from the analysis."""
    from ..analysis.autoplan import resolve

    auto = getattr(args, "auto", False)

    def say(msg: str) -> None:
        if msg.startswith("no adapter"):
            steps.note(msg)

    adapter, analysis = resolve(model, auto=auto, inputs=inputs, seed=args.seed, progress=say)
    if analysis is not None:
        n = [x for x in analysis.norms if x.module]
        steps.note(f"{'--auto: ' if auto else 'no registered adapter: '}plan derived from the analysis "
                   f"({analysis.tracer} trace): {sum(x.foldable for x in n)} of {len(n)} LayerNorms foldable")
    return adapter, analysis


def derived_summary(analysis) -> str:
    """Which norms the derived plan converted or kept, and why (the analysis' verdicts)."""
    from ..analysis.autoplan import describe

    lines = describe(analysis)
    head = f"\n  plan derived from the analysis ({analysis.tracer} trace, no hand-written adapter used):"
    shown = lines[:12] + ([f"... and {len(lines) - 12} more (normfold analyze MODEL)"] if len(lines) > 12 else [])
    return "\n".join([head] + [f"    {x}" for x in shown])


def _load(model, dtype, trust_remote_code=False):
    """MODEL: a normfold checkpoint (normfold.json: converted back with --to rmsnorm/layernorm/crmsnorm,
    paper 001 App. C) or any Hugging Face model."""
    from pathlib import Path

    from .. import io

    if model is not None and (Path(model) / io.REPORT_FILE).is_file():
        loaded = io.load(model, dtype=None if dtype == "auto" else dtype)
        return loaded, {"model": str(model), "architecture": type(loaded).__name__,
                        "model_type": getattr(loaded.config, "model_type", None), "path": str(model),
                        "normfold_variant": loaded.normfold_report.variant}
    return io.load_source(model, dtype=dtype, trust_remote_code=trust_remote_code)


def _change(d: dict, unit: str = "") -> str:
    pct = 100 * d["change"] / d["before"] if d["before"] else 0.0
    return f"{d['before']:,}{unit} -> {d['after']:,}{unit} ({d['change']:+,}{unit}, {pct:+.2f}%)"


def _size_rows(size: dict) -> list[list[str]]:
    if not size:
        return []
    rows = [["parameters", _change(size["parameters"])]]
    if size.get("weight_bytes"):
        rows.append(["weight bytes", _change(size["weight_bytes"], " B")])
    if size.get("disk_bytes"):
        rows.append(["on disk", _change(size["disk_bytes"], " B") + " (weight files)"])
    w = size.get("stream_width", {})
    if w.get("after"):
        rows.append(["stream width", ", ".join(f"{k} {w['before'].get(k, '?')} -> {v}" for k, v in w["after"].items())])
    return rows


def summary(report, written, args) -> str:
    d = report.to_dict()
    ln = d["layernorms"]
    norms = report.structure.norms
    folded = [n for n in norms if n.folded_into]
    kept_affine = [n.name for n in norms if n.weight or n.bias]
    lines = [f"normfold convert: {d['source'].get('model')} ({report.architecture}, {report.dtype}) -> "
             f"{written or '(not written)'}  [{report.variant}]", ""]
    rows = [
        ["LayerNorms", f"{ln['total']} total: {ln['converted']} converted, {len(ln['kept'])} kept"],
        ["affine", f"{len(folded)} folded into their readers, {len(kept_affine)} kept in the norm"
                   + (f" ({', '.join(kept_affine[:3])}{', ...' if len(kept_affine) > 3 else ''})" if kept_affine else "")],
        ["tensors edited", f"{report.tensors_edited} ({len(report.centered)} writers centred, "
                           f"{len(report.structure.untied)} tied parameters untied)"],
        ["reload", ("stock transformers: yes (from_pretrained); normfold.load: yes"
                    + (" (tied head kept as one tensor)" if report.keeps_tie else "") if report.stock_reloadable
                    else "stock transformers: no; normfold.load: yes"
                    + (" (tied head kept as one tensor; see notes)" if report.keeps_tie else " (see notes)"))],
    ]
    rows += _size_rows(report.size)
    lines.append(table(rows))
    for k in ln["kept"][:10]:
        lines.append(f"  kept: {k['name']}: {k['reason']}")
    if len(ln["kept"]) > 10:
        lines.append(f"  ... and {len(ln['kept']) - 10} more kept norms (see normfold.json)")
    v = report.verification
    if v and v.get("performed") is False:
        lines += ["", f"  verification: not performed: {v['reason']}"]
    elif v:
        lines.append("")
        vrows = []
        if v["fp64"]:
            f = v["fp64"]
            vrows.append(["float64: converted vs original", sci(f["max_abs_error"]), sci(f["max_rel_error"]),
                          f"{'pass' if f['passed'] else 'FAIL'} (tolerance {f['tolerance']:g})"])
        top1 = "" if v["top1_agreement"] is None else f"top-1 agreement {100 * v['top1_agreement']:.2f}%"
        vrows.append([f"{v['dtype']}: converted vs original", sci(v["max_abs_error"]), sci(v["max_rel_error"]), top1])
        b = v["baseline"]
        vrows.append([f"{v['dtype']}: original vs its float64 self", sci(b["max_abs_error"]),
                      sci(b["max_rel_error"]), "floating-point baseline"])
        worst = max(v["working"]["outputs"], key=lambda r: r["converted_rel_error"], default=None)
        if worst:
            vrows.append([f"{v['dtype']}: converted vs float64 original", "", sci(worst["converted_rel_error"]),
                          f"{'pass' if v['working']['passed'] else 'FAIL'} (<= 4x baseline; worst: {worst['name']})"])
        lines.append(table(vrows, header=["verification", "max abs", "max rel", ""]))
        lines.extend(skipped_lines(v))
        for r in v["working"]["outputs"]:
            if not r["ok"] and r.get("why"):
                lines.append(f"  why {r['name']} fails: {r['why']}")
            elif r["ok"] and r.get("note"):
                lines.append(f"  note on {r['name']}: {r['note']}")
    for w in report.warnings:
        lines.append(f"  warning: {w}")
    for n in report.notes:
        lines.append(f"  note: {n}")
    secs = "  ".join(f"{k} {report.seconds[k]:.1f}s" for k in ("load", "convert", "verify", "save")
                     if k in report.seconds)
    lines += ["", f"  time: {secs}"]
    if written:
        lines.append(f"  report: {written}/normfold.json")
    return "\n".join(lines)
