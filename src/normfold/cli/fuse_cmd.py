"""`normfold fuse DIR --out DIR2`: fold a fine-tuned UN checkpoint's norms into its linear layers."""

from __future__ import annotations

import argparse

from .ui import Steps, sci, table

HELP = "fold the offline norms (UnifiedNorm) of a fine-tuned checkpoint into its linear layers"

DESCRIPTION = """\
Write the inference checkpoint of a model trained with offline norms.

DIR is a checkpoint written by `normfold convert MODEL --to un` (or normfold.save) and fine-tuned.
In eval mode each UnifiedNorm is a fixed per-channel affine x*scale + shift (paper 004, eq. 1),
which folds into the linear layers that read its output (or, failing that, the one that writes its
input); the norm module is then removed. Norms with no such neighbour stay as a fixed affine and
the report says why. The fused model is checked against the unfused one: in float64 (relative
error must be <= 1e-9) and in the model's dtype. DIR2 is written atomically; load it with
normfold.load(DIR2).
"""

EPILOG = """\
examples:
  normfold convert ./gpt2 --to un --out ./gpt2-un    (then fine-tune and normfold.save it to ./gpt2-un-ft)
  normfold fuse ./gpt2-un-ft --out ./gpt2-un-fused

exit codes: 0 fused and verified; 1 verification failed (nothing written); 2 bad input: missing DIR,
not a normfold checkpoint, no offline norms in it, existing DIR2 without --force (message on
stderr, nothing written).
"""


def add_parser(sub) -> None:
    p = sub.add_parser("fuse", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="normfold checkpoint with UnifiedNorm modules")
    p.add_argument("--out", metavar="DIR2", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="replace DIR2 if it exists (only once the new one is complete)")
    p.add_argument("--keep-final", action="store_true",
                   help="keep final norms (ln_f, ...) as fixed affines instead of folding them into the heads")
    p.add_argument("--seed", type=int, default=0, help="seed of the random verification inputs (default 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout instead of a table")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(run=run)


def run(args) -> int:
    import torch

    from .. import io
    from ..errors import NormfoldError, VerificationFailedError
    from ..unified.fuse import checkpoint_report, example_inputs, fuse_offline_norms
    from ..nn.offline import offline_norms

    io.check_output_dir(args.out, args.force)  # fail before any work
    steps = Steps(total=3, quiet=args.quiet)
    steps.start("load", f"loading {args.dir}")
    model = io.load(args.dir)
    base = model.normfold_report
    if not offline_norms(model):
        raise NormfoldError(f"{args.dir} has no offline norms to fuse (its normfold.json says variant "
                            f"{base.variant!r}); fuse works on checkpoints written by `normfold convert MODEL "
                            "--to un` and fine-tuned")
    steps.note(f"{type(model).__name__}, {len(offline_norms(model))} offline norm(s)")
    steps.start("fuse", "fusing and verifying (float64 and working dtype)")
    inputs = example_inputs(model, torch.Generator().manual_seed(args.seed))
    fused, fusion = fuse_offline_norms(model, inputs, inplace=True, fold_final=not args.keep_final)
    from ..modelinfo import working_dtype

    report = checkpoint_report(base, fusion, str(working_dtype(fused)).replace("torch.", ""),
                               source={"model": str(args.dir), "un_source": base.source})
    passed = bool(fusion.verification and fusion.verification["passed"])
    written = None
    if passed:
        steps.start("save", f"writing {args.out}")
        written = io.save(fused, report, args.out, force=args.force)
    steps.end()
    print(report.to_json() if args.json else summary(fusion, written))
    if not passed:
        raise VerificationFailedError("verification failed: the fused model's outputs differ from the unfused "
                                      "model's beyond tolerance (see above); nothing was written")
    return 0


def summary(fusion, written) -> str:
    lines = [f"normfold fuse: -> {written or '(not written)'}", ""]
    rows = [[f["name"], f"-> {', '.join(f['into'])}", f"{f['direction']} ({f['source']})"] for f in fusion.fused]
    rows += [[k["name"], "kept (fixed affine)", k["reason"]] for k in fusion.kept]
    lines.append(table(rows, header=["norm", "folded into", "how"]))
    v = fusion.verification
    if v:
        f = v["fp64"]
        lines.append("")
        lines.append(table([
            ["float64: fused vs unfused", sci(f["max_abs_error"]), sci(f["max_rel_error"]),
             f"{'pass' if f['passed'] else 'FAIL'} (tolerance {f['tolerance']:g})"],
            [f"{v['dtype']}: fused vs unfused", sci(v["max_abs_error"]), sci(v["max_rel_error"]),
             "pass" if v["working"]["passed"] else "FAIL"],
        ], header=["verification", "max abs", "max rel", ""]))
    for n in fusion.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
