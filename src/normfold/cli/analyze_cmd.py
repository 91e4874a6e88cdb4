"""`normfold analyze [MODEL] [--json]`: which LayerNorms can be folded, and why the others cannot."""

from __future__ import annotations

import argparse

from .ui import Steps, table

HELP = "find which LayerNorms can be folded into RMSNorms, and why the others cannot"

DESCRIPTION = """\
Trace MODEL's forward pass and decide, for every LayerNorm, whether it can become an RMSNorm.

LayerNorm(x) equals RMSNorm(x) (same eps, same scale/shift) whenever x has zero mean over the
normalized dim. A LayerNorm is FOLDABLE when its input is zero-mean for every input once some
"writers" have their weights centred. The analysis follows every tensor from the model's inputs:

  writers      linear / Conv1D / conv / embedding outputs, and parameters added to the stream
               (cls tokens, position tables): zero-mean once centred -- allowed only if nothing
               but LayerNorms (which ignore a shift) and model outputs sees the change, and the
               weight is not also used elsewhere (a weight tied to a head gets untied)
  keep         view, reshape, permute, transpose, token selection, dtype casts, dropout in eval mode
  AND          add, sub, cat: zero-mean iff every operand is
  LayerNorm    its output is zero-mean only without affine (or constant scale and zero shift, for
               these weights only; --structural refuses that): a Post-LN norm's output g*n+b is
               NOT, so the next norm does not fold
  anything else  GELU, softmax, products, model inputs, buffers, dropout in training mode: not zero-mean

A non-foldable norm is reported with the op and module that break it, e.g. "input includes the
output of gelu after encoder.conv2 (not zero-mean)" or "input includes the affine output of
embeddings.LayerNorm". For foldable norms the report lists the writers to centre and the linear
modules reading the norm (its scale/shift moves into them).

MODEL is a local Hugging Face model directory (config.json + weights) or a hub id (needs a network).
Without MODEL, the bundled default model is used. From Python: normfold.analyze(model, inputs=...)
works on any torch.nn.Module torch.export (or torch.fx) can trace, with or without an adapter.
"""

EPILOG = """\
examples:
  normfold analyze ./my-bert                  table of all LayerNorms, foldable or not, and why
  normfold analyze ./my-bert --json > a.json  the same as JSON (per norm: foldable, reason, readers, writers)
  normfold analyze ./bloom --recenter         also allow an explicit Recenter op (not stock-reloadable)
  normfold analyze ./gpt2 --no-center-embeddings
                                              as paper 002's Table 7 "Foldable" column (tables left as is)

exit codes: 0 analysed (whatever the verdicts); 2 bad input: missing MODEL, not a model, a model
torch.export cannot trace (message on stderr).
"""


def add_parser(sub) -> None:
    p = sub.add_parser("analyze", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="HF model directory or hub id (default: the bundled kjv-gpt2 model)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout instead of a table")
    p.add_argument("--recenter", action="store_true",
                   help="allow explicit Recenter ops after modules whose output joins the stream but cannot be "
                        "centred by weights (e.g. BLOOM's embedding LayerNorm)")
    p.add_argument("--no-center-embeddings", action="store_true",
                   help="do not centre embedding tables or stream parameters (cls tokens, position tables)")
    p.add_argument("--structural", action="store_true",
                   help="count a LayerNorm output as zero-mean only without affine, not when its scale happens to be "
                        "constant and its shift zero (verdicts that hold for any weights, e.g. for training)")
    p.add_argument("--recentred-output", action="append", default=[], metavar="NAME",
                   help="a model output (as normfold verify names it, e.g. encoder_last_hidden_state) that carries "
                        "the residual stream and may come back recentred; hidden_states are always allowed")
    p.add_argument("--tracer", default="auto", choices=["auto", "export", "fx"],
                   help="torch.export, torch.fx, or auto: export, then fx for non-HF modules (default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random example inputs (default 0)")
    p.add_argument("--width", type=int, default=110, metavar="N", help="clip the table's reasons to N characters")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(run=run)


def run(args) -> int:
    from .. import io
    from ..analysis import analyze, example_inputs

    steps = Steps(total=3, quiet=args.quiet)
    steps.start("load", f"loading {args.model or 'the bundled default model (kjv-gpt2)'}")
    model, source = io.load_source(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    steps.note(f"{source['architecture']}, {n_params / 1e6:.1f} M parameters")
    inputs = example_inputs(model, seed=args.seed)
    steps.start("trace", "tracing the forward pass (torch.export)")

    def progress(msg: str) -> None:
        if msg.startswith("propagating"):
            steps.start("analyze", msg)
        else:
            steps.note(msg)

    report = analyze(model, inputs, center_embeddings=not args.no_center_embeddings, recenter=args.recenter,
                     structural=args.structural, recentred_outputs=tuple(args.recentred_output),
                     tracer=args.tracer, progress=progress)
    steps.end()
    report.source = source
    report.seconds.update({k: round(v, 3) for k, v in steps.times.items()})
    print(report.to_json() if args.json else summary(report, model, args))
    return 0


def summary(report, model, args) -> str:
    from ..adapters import find_adapter
    from ..errors import UnsupportedModelError

    lines = [f"normfold analyze: {report.source.get('model')} ({report.architecture}, traced with {report.tracer})", ""]
    folded = report.foldable
    rows = [["LayerNorms", f"{len(folded)} of {report.total} foldable"
             + ("" if report.center_embeddings else " (embeddings left as they are)")]]
    if report.writers:
        rows.append(["writers to centre", f"{len(report.writers)} ({_names([w.name for w in report.writers], 4)})"])
    affine = [n for n in folded if n.affine_foldable]
    if folded:
        rows.append(["affine", f"{len(affine)} of {len(folded)} foldable norms can move γ/β into linear readers"])
    recenters = sorted({r for n in folded for r in n.recenter})
    if recenters:
        rows.append(["explicit Recenter", f"after {', '.join(recenters)} (the result is not stock-reloadable)"])
    if report.other_norms:
        rows.append(["other norms", ", ".join(f"{k} x{v}" for k, v in report.other_norms.items())
                     + " (not LayerNorm: nothing to fold)"])
    lines.append(table(rows))
    if report.norms:
        lines += ["", report.table(width=args.width)]
    clipped = [n for n in report.norms if not n.foldable and len(n.reason) > args.width]
    for n in clipped[:10]:
        lines.append(f"  {n.name}: {n.reason}")
    for note in report.notes:
        lines.append(f"  note: {note}")
    lines.append("")
    try:
        adapter = find_adapter(model)
        lines.append(f"  convert: normfold convert {report.source.get('model') or ''} --out DIR "
                     f"(adapter: {adapter.display_name})".replace("  --out", " --out"))
    except UnsupportedModelError:
        if folded:
            lines.append("  no adapter for this architecture; convert from Python with the analysis' plan:\n"
                         "    report = normfold.analyze(model); normfold.convert(model, adapter=report.to_adapter())")
    secs = "  ".join(f"{k} {report.seconds[k]:.1f}s" for k in ("load", "trace", "analyze") if k in report.seconds)
    lines.append(f"  time: {secs}")
    return "\n".join(lines)


def _names(items: list[str], k: int) -> str:
    return ", ".join(items[:k]) + (f", +{len(items) - k} more" if len(items) > k else "")
