"""`normfold convert --stream {auto,always,never}`: when and how the CLI converts shard by shard.

auto (default) streams whenever MODEL is a local directory of safetensors weights that the streamed
conversion can read (one floating dtype, an adapter's plan, tensors transformers only renames) and no option
needs the model in memory (`blockers`): whatever its size, since streaming is both faster and smaller than
loading the model. A Pre-RMSNorm or Pre-CRMSNorm normfold checkpoint `--to layernorm` (and a Pre-CRMSNorm one
`--to rmsnorm`) streams back (`stream.reverse`, verified by `verify_reverse`). always streams or says why it cannot; never keeps the
in-memory path. The output is written into a temporary directory beside --out, renamed at the end and removed
on any failure (Ctrl-C included); a lock file `.{name}.lock` beside --out makes a second conversion into the
same directory fail cleanly.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from .. import checkpoint_guard as guard
from .. import io
from ..errors import NormfoldError, OutputExistsError, VerificationFailedError
from ..stream.executor import (STREAMED_TARGETS, StreamUnsupportedError, open_source, prepare,
                              stream_convert, weight_files)
from ..stream.reverse import REVERSE_TARGETS, prepare_reverse, stream_reverse

VERIFY_IN_MEMORY_BYTES = 256 * 1024**2  # verify streamed outputs in memory up to this source size


def blockers(args) -> list[str]:
    """Why this invocation needs the in-memory path (empty: it can stream)."""
    why = []
    model = Path(args.model) if args.model else io.default_model_path()
    if not model.is_dir():
        why.append(f"{args.model} is not a local directory")
    elif (model / io.REPORT_FILE).is_file():  # a normfold checkpoint: the way back
        if args.to not in REVERSE_TARGETS:
            why.append(f"--to {args.to} from a normfold checkpoint (streaming converts one back "
                       f"--to {' or '.join(REVERSE_TARGETS)})")
        for flag, on in (("--keep-affine", args.keep_affine), ("--fold-final", args.fold_final),
                         ("--allow-new-bias", args.allow_new_bias), ("--pad", args.pad),
                         ("--untie", getattr(args, "untie", False))):
            if on:
                why.append(f"{flag} with a normfold checkpoint (the streamed way back takes no options)")
    elif weight_files(model) is None:
        why.append("MODEL has no safetensors weights")
    if args.to not in STREAMED_TARGETS and not (model.is_dir() and (model / io.REPORT_FILE).is_file()):
        why.append(f"--to {args.to} (streaming converts --to {' or '.join(STREAMED_TARGETS)}, and a normfold "
                   f"checkpoint --to {' or '.join(REVERSE_TARGETS)})")
    for flag, on in (("--inputs", getattr(args, "inputs", None)), ("--text", args.text), ("--auto", args.auto),
                     ("--option", args.option), ("--dry-run", args.dry_run),
                     (f"--rotate-attention {getattr(args, 'rotate_attention', None)}",
                      getattr(args, "rotate_attention", None) not in (None, "online"))):
        if on:
            why.append(f"{flag} needs the in-memory model")
    if args.dtype not in ("auto", None):
        why.append("--dtype other than auto (streaming keeps the checkpoint's dtype)")
    if not args.out and not args.dry_run:
        why.append("no --out")
    return why


def is_reverse(source_dir: Path) -> bool:
    """MODEL is a normfold checkpoint: its streamed conversion is the way back (normfold.stream.reverse)."""
    return (Path(source_dir) / io.REPORT_FILE).is_file()


def _prepare_reverse(args, source_dir: Path):
    """`prepare_reverse`'s checks. Above VERIFY_IN_MEMORY_BYTES a reverse output is verified block by block with
    the roles swapped, its own normfold.json structure (added biases, heads tied to centred tables) replayed."""
    src_report, *_ = prepare_reverse(source_dir, args.to)
    return src_report


def _prepare(args, source_dir: Path):
    return prepare(source_dir, to=args.to, keep_affine=args.keep_affine, fold_final=args.fold_final,
                   allow_new_bias=args.allow_new_bias, pad=args.pad, untie=getattr(args, "untie", False),
                   rotate=getattr(args, "rotate", None), rotate_seed=getattr(args, "rotate_seed", None),
                   rotate_online=getattr(args, "rotate_online", None) or None,
                   rotate_attention=getattr(args, "rotate_attention", None))


def maybe_stream(args, summarize=None) -> int | None:
    """Run the streamed conversion when --stream says so; None = use the in-memory path.

    auto streams whenever `blockers` finds nothing and `normfold.stream.executor.prepare` accepts the source
    (any size); otherwise the in-memory path runs and reports whatever is wrong with MODEL itself."""
    mode = getattr(args, "stream", "never") or "never"
    if mode == "never":
        return None
    why = blockers(args)
    if why:
        if mode == "always":
            raise StreamUnsupportedError("--stream always cannot stream this conversion: " + "; ".join(why)
                                         + ". Use --stream never (or auto) to convert in memory.")
        return None
    source_dir = Path(args.model) if args.model else io.default_model_path()
    prepared = None
    if is_reverse(source_dir):
        try:
            _prepare_reverse(args, source_dir)
        except NormfoldError as exc:
            if mode == "always":
                raise StreamUnsupportedError(f"--stream always cannot stream this conversion: {exc}. Use --stream "
                                             "never (or auto) to convert in memory.") from exc
            return None
    elif mode == "auto":
        try:
            prepared = _prepare(args, source_dir)
        except NormfoldError:
            return None  # not streamable (or broken): the in-memory path converts it or says what is wrong
    return run_streamed(args, source_dir, summarize, prepared=prepared)


def run_streamed(args, source_dir: Path, summarize=None, prepared=None) -> int:
    from .ui import Steps

    guard.check_remote_code(source_dir / "config.json", getattr(args, "trust_remote_code", False))
    if is_reverse(source_dir):  # a normfold checkpoint: checked as normfold.load checks it (io.inspect_converted)
        _prepare_reverse(args, source_dir)
    else:
        guard.inspect_checkpoint(source_dir)  # broken or hostile files end here, before any work
    out = io.check_output_dir(args.out, args.force).absolute()
    steps = Steps(total=2, quiet=args.quiet)
    note = _whole_command_progress(steps.note, source_dir, args.to, rotate=bool(getattr(args, "rotate", None)))
    with output_lock(out), _disk_errors(out):
        with staged(out, args.force) as tmp:
            # announced once the lock and the staging directory exist: a Ctrl-C / SIGTERM from here on
            # removes both (signal tests send it as soon as this line appears)
            steps.start("convert", f"converting {source_dir} shard by shard (--stream)")
            if is_reverse(source_dir):
                report = stream_reverse(source_dir, tmp, to=args.to, progress=note)
                steps.start("verify", "verifying")
                verify_reverse(source_dir, tmp, report, fp64_tol=args.fp64_tol, seed=args.seed, progress=note)
            else:
                prepared = prepared or _prepare(args, source_dir)
                report = stream_convert(source_dir, tmp, prepared=prepared, progress=note)
                steps.start("verify", "verifying")
                verify_streamed(source_dir, tmp, report, fp64_tol=args.fp64_tol, seed=args.seed,
                                fold_final=args.fold_final, keep_affine=args.keep_affine,
                                allow_new_bias=args.allow_new_bias, pad=bool(args.pad),
                                untie=getattr(args, "untie", False), options=prepared.options, progress=note)
            if not args.model:
                report.source["model"] = "bundled:kjv-gpt2"  # as the in-memory path names it
            v = report.verification
            if v.get("performed", True) and not v["passed"] and not args.save_failed:
                blocks = (v.get("blockwise") or {}).get("failed_blocks") or []
                where = f" (blocks beyond tolerance: {', '.join(blocks)})" if blocks else ""
                if args.json:
                    print(report.to_json())
                elif summarize is not None:
                    print(summarize(report, None, args))  # the table shows what failed
                raise VerificationFailedError(f"verification failed: the streamed conversion's outputs differ beyond "
                                              f"tolerance{where}; nothing was written (use --save-failed to keep it "
                                              "anyway)")
    steps.end()
    report.seconds.update({k: round(t, 3) for k, t in steps.times.items()})
    before, after = io.weight_file_bytes(source_dir), io.weight_file_bytes(out)
    if before:
        report.size["disk_bytes"] = {"before": before, "after": after, "change": after - before}
    (out / io.REPORT_FILE).write_text(report.to_json() + "\n")
    if args.json:
        print(report.to_json())
    elif summarize is not None:
        print(summarize(report, out, args))
    v = report.verification
    if v.get("performed", True) and not v["passed"]:
        raise VerificationFailedError("verification failed: the converted model's outputs differ beyond tolerance")
    return 0


def _whole_command_progress(say, source_dir: Path, to: str, rotate: bool = False):
    """`say` carrying one time-left estimate for conversion and verification together (stream.progress): the
    writer's lines and the block-wise verifier's count the verification still to come. The phases' weights are
    per element of the checkpoint, so their ratio is the same for every size; a source verified in memory
    (up to VERIFY_IN_MEMORY_BYTES) weighs one conversion."""
    from ..stream.progress import (CONVERT_WEIGHT, CONVERT_WEIGHTS, IN_MEMORY_VERIFY_WEIGHT, ROTATE_CONVERT_WEIGHT,
                                   VERIFY_PASS_WEIGHTS, Reporter, Work)

    try:
        blockwise = open_source(source_dir).total_bytes > VERIFY_IN_MEMORY_BYTES
    except NormfoldError:  # the conversion itself says what is wrong
        blockwise = True
    verify = sum(VERIFY_PASS_WEIGHTS) if blockwise else IN_MEMORY_VERIFY_WEIGHT
    convert = ROTATE_CONVERT_WEIGHT if rotate else CONVERT_WEIGHTS.get(to, CONVERT_WEIGHT)
    return Reporter(say, Work({"convert": convert, "verify": verify}))


@contextlib.contextmanager
def _disk_errors(out: Path):
    """A full disk / quota / file-size limit is the user's to fix, not a normfold bug: exit 2 with a message
    (the staged output is already removed)."""
    import errno

    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise NormfoldError(f"writing {out} failed: the disk is full (or a file-size / quota limit was hit: "
                                f"{exc.strerror}); nothing was written. Free space (the output is about as large "
                                "as MODEL) or choose another --out.") from exc
        raise


output_lock = io.output_lock  # shared with the in-memory path


@contextlib.contextmanager
def staged(out: Path, force: bool):
    """A temporary directory beside `out`, renamed to `out` when the block succeeds, removed on any
    exception (KeyboardInterrupt included). An existing `out` (force) is replaced only at the end."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    backup = None
    try:
        yield tmp
        if out.exists():
            if not force:
                raise OutputExistsError(f"{out} appeared while converting; nothing was written")
            backup = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out, backup)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if backup is not None and not out.exists():
            os.rename(backup, out)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def verify_streamed(source_dir: Path, out_dir: Path, report, *, fp64_tol: float = 1e-9, seed: int = 0,
                     fold_final: bool = False, keep_affine: bool = False, allow_new_bias: bool = False,
                     pad: bool = False, untie: bool = False, options=None, progress=None) -> None:
    """Verify a streamed output: sources up to VERIFY_IN_MEMORY_BYTES in memory exactly as `normfold convert`
    verifies them, larger ones block by block in bounded memory (`normfold.stream.blockverify`, same
    tolerances). `options`: the conversion's (a rotation is verified in the original basis, as normfold.convert
    verifies it). Updates `report` and normfold.json."""
    import torch

    from ..adapters import find_adapter
    from ..conversion import ROTATOR, VARIANTS, centered_outputs, rotating_variant
    from ..options import ConvertOptions
    from ..report import ConversionReport
    from ..verify import FinalNorms, verify_conversion

    rotate = options.rotate if options is not None else None
    # rotated: the final norms' outputs lacking γ/β are skipped, the exact ones compared (verify.FinalNorms; the
    # block-wise verifier decides the same from normfold.json)
    final_norms = (FinalNorms.of(report.structure) if rotate is not None
                   else FinalNorms.folded(report.structure) if fold_final else None)
    if open_source(source_dir).total_bytes > VERIFY_IN_MEMORY_BYTES:
        # too big to hold twice: block by block, each converted block on the original's hidden states
        from ..stream.blockverify import verify_blockwise

        (Path(out_dir) / io.REPORT_FILE).write_text(report.to_json() + "\n")  # its structure is replayed
        # the stored (rounded) weights run in float64, so the tolerance is `normfold verify`'s
        # (verify.stored_weights_tolerance: 1024 ulp for float32, 8 ulp for 16-bit), unless --fp64-tol is set
        # (not inside safetensors_io.reuse_freed_memory: its peak, the float64 embedding table, is one unit, and
        # keeping freed memory within budget saved little system time there: 9.6 -> 8.2 s, 1215 -> 1247 MB)
        report.verification = verify_blockwise(source_dir, out_dir, seed=seed, progress=progress,
                                               fp64_tol=None if fp64_tol == 1e-9 else fp64_tol, fold_final=fold_final)
        # buffered reads, although the output was written past the page cache: O_DIRECT reads are synchronous and
        # made the verification 5.3-6.1 -> 9.5-9.9 s on the 1.68 GB checkpoint (quiet, 2026-11-28), buffered 6.9-7.2 s
    else:
        original, _ = io.load_source(source_dir)
        converted = io.load(out_dir)
        adapter = find_adapter(original)
        variant = VARIANTS[report.variant]
        if rotate is None:
            options = ConvertOptions(to=report.variant, keep_affine=keep_affine, fold_final=fold_final,
                                     allow_new_bias=allow_new_bias, pad=pad, untie=untie)
        else:
            variant = rotating_variant(variant, rotate, options.rotate_seed, options.keep_affine,
                                       bool(options.rotate_online), options.rotate_attention)

        def reconvert(m):
            scratch = ConversionReport(variant=report.variant, adapter=adapter.name, architecture="", dtype="",
                                       layernorms_total=0)
            variant.apply(m, adapter.plan(m), options, scratch)
            return m.eval()

        inputs = adapter.example_inputs(original, torch.Generator().manual_seed(seed))
        centered = centered_outputs(adapter.plan(original))
        output_map = ROTATOR["rotator"].output_map(report.structure.rotation, centered) if rotate else None
        report.verification = verify_conversion(original, converted, inputs, reconvert=reconvert, fp64_tol=fp64_tol,
                                                centered=centered, output_map=output_map,
                                                final_norms=final_norms).to_dict()
    (Path(out_dir) / io.REPORT_FILE).write_text(report.to_json() + "\n")


def verify_reverse(source_dir: Path, out_dir: Path, report, *, fp64_tol: float = 1e-9, seed: int = 0,
                   progress=None) -> None:
    """Verify a streamed way back (normfold checkpoint -> LayerNorm, or Pre-CRMSNorm -> Pre-RMSNorm). Sources up
    to VERIFY_IN_MEMORY_BYTES: in memory, as the in-memory reverse conversion verifies itself
    (`compress.reverse.convert_converted`: the source against the output, float64 re-conversion, plus its
    input-rounding allowance). Larger ones: block by block with the roles swapped: the output (a plain LayerNorm
    model; a Pre-RMSNorm output: its tensors are those of its LayerNorm form, which computes the same function on
    its zero-mean stream; either one's normfold.json structure, added biases or centred tied tables, is replayed
    by the verifier) is ORIGINAL, the normfold
    source (its structure replayed from normfold.json) is CONVERTED, exactly the pair a forward
    conversion verifies. Each source block runs on the output's hidden states; streams are compared centred
    (the output's stream carries the tied table's row means again, the source's does not; both models' norms
    centre or are fed centred states), the last d coordinates as they are. Tolerances are `normfold verify`'s
    for the stored dtype. Updates `report` and normfold.json."""
    import torch

    from ..adapters import find_adapter
    from ..compress.reverse import decompress, input_rounding, to_layernorm
    from ..conversion import centered_outputs
    from ..verify import verify_conversion

    src_report, *_, source = prepare_reverse(source_dir, report.variant)
    if source.total_bytes > VERIFY_IN_MEMORY_BYTES:
        from ..stream.blockverify import verify_blockwise

        # a rotated source's way back keeps the rotated basis (to_layernorm changes no stream tensor), so the two
        # streams compare as they are: no map by Q
        v = verify_blockwise(out_dir, source_dir, seed=seed, progress=progress,
                             fp64_tol=None if fp64_tol == 1e-9 else fp64_tol,
                             same_basis=bool(src_report.structure.rotation))
        v["roles"] = ("reverse conversion checked block by block with the roles swapped: ORIGINAL = the streamed "
                      "LayerNorm output, CONVERTED = the normfold source")
    else:
        model = io.load(source_dir)
        target = io.load(out_dir)
        adapter = find_adapter(model)
        inputs = adapter.example_inputs(model, torch.Generator().manual_seed(seed))
        centered = tuple(report.centered_outputs) or centered_outputs(adapter.plan(target))
        crms = bool(src_report.structure.compression)  # Pre-CRMSNorm: decompress first; its stream is zero-mean
        rounding = 0.0 if crms else input_rounding(model, inputs, centered)
        if report.variant == "rmsnorm":  # Pre-CRMSNorm -> Pre-RMSNorm: decompress only
            reconvert = (lambda m: decompress(m).eval())
        elif crms:
            reconvert = (lambda m: to_layernorm(decompress(m)).eval())
        else:
            reconvert = (lambda m: to_layernorm(m).eval())
        v = verify_conversion(model, target, inputs, reconvert=reconvert, fp64_tol=fp64_tol + 2 * rounding,
                              centered=centered).to_dict()
        if v.get("fp64") is not None:
            v["fp64"]["input_rounding"] = rounding
    report.verification = v
    (Path(out_dir) / io.REPORT_FILE).write_text(report.to_json() + "\n")
