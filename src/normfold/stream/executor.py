"""Streaming conversion: a safetensors checkpoint converted tensor by tensor, never materialized.

    report = stream_convert(source_dir, out_dir)

Two passes over one plan, both with the in-memory conversion's own code (normfold.convert):

1. *Structure*, on a model built on the meta device: the registered adapter's plan and the variant's
   `apply` run on meta tensors (shapes only, no arithmetic). That yields the exact report (norm
   records, untied parameters, Recenter hooks, stock-reloadability) and the output tensor names,
   dtypes and shapes, so every output header is known before any data is written. The values
   `apply` asks about (is a norm's β all zero, is a tied head unchanged) are read from the checkpoint
   beforehand and answered by the plan's tensor source (`plan.CheckpointValues`): nothing is patched.
2. *Values*, on a second meta model: the edits are grouped into components (edits that share a
   parameter: a norm with its readers, a writer alone, ...). Each component's parameters are read
   from the checkpoint into real tensors, the same edit functions (`fold_scales`, `center_writer_at`,
   `swap_norm`) run on them in plan order, the results are written and the modules go back to meta.
   Every output tensor therefore goes through the exact roundings of the in-memory path: the files
   hold the same bytes as `normfold.convert` + `normfold.save` (tests/stream/test_stream_convert.py).

Tensors no edit touches are copied file to file in bounded chunks (checked finite on the way).

`--to crmsnorm` (and `pad`) streams too: the structure pass runs the crmsnorm variant on the meta model, and each
computed Pre-RMSNorm tensor then goes through `compress.crmsnorm.compressed_value`, the compression's own
per-tensor operations (same bytes as the in-memory conversion). Reading, computing and writing overlap (a reader
and a writer thread, `writer.write_checkpoint`), and freed tensor memory is reused within a budget
(`safetensors_io.reuse_freed_memory`). `prepare` does every check that needs no weights: the CLI's
`--stream auto` streams whenever it succeeds.

`rotate="hadamard"|"orthogonal"` streams too (`stream/rotation.py`: each component in float64 from read to one
rounding, the in-memory rotation's own functions; the same bytes), explicit rotation hooks, `rotate_online` and
`rotate_attention="online"` included (recorded in the structure as the in-memory rotation records them); the
value/output and query/key rotations (`rotate_attention="vo"`, `"both"`, `"qk"`, `"all"`) do not stream.

The parts: `source` (the checkpoint's headers, the meta model, tensor names), `plan` (edits, components, output
tensors and files), `compute` (one component's values), `writer` (files written, overlapped with reading and
computing), `safetensors_io` (bytes in and out); this module prepares and runs them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .. import checkpoint
from ..adapters import find_adapter
from ..conversion import VARIANTS, edited_params, finish_report, layernorm_names, new_report, recentre_tied_tables
from ..conversion import untie as untie_params
from ..errors import NormfoldError
from ..modelinfo import working_dtype
from ..options import ConvertOptions, resolve as resolve_options
from ..report import ConversionReport
from .compute import CHUNK_BYTES, Computer, row_chunks  # noqa: F401 (re-exported)
from .plan import (PENDING, assign_files, checkpoint_values, components, output_tensors,  # noqa: F401
                   owners, plan_edits, tied_aliases)
from .source import (INDEX, Source, StreamUnsupportedError, checkpoint_dtype, meta_model, open_source,  # noqa: F401
                     source_names, weight_files)
from .writer import write_streamed



Progress = Callable[[str], None]

STREAMED_TARGETS = ("rmsnorm", "crmsnorm")



@dataclass
class Prepared:
    """What `prepare` found: the source, its meta model, names and the adapter's plan."""
    source: Source
    dtype: torch.dtype
    original: nn.Module
    names: dict[str, str]
    adapter: object
    plan: object
    options: ConvertOptions



def _options(options, to, keep_affine, fold_final, allow_new_bias, pad, untie, rotate=None,
             rotate_seed=None, rotate_online=None, rotate_attention=None) -> ConvertOptions:
    options = resolve_options(options, "stream_convert", to=to, keep_affine=keep_affine, fold_final=fold_final,
                              allow_new_bias=allow_new_bias, pad=pad, untie=untie, rotate=rotate,
                              rotate_seed=rotate_seed, rotate_online=rotate_online,
                              rotate_attention=rotate_attention)
    options = options.replace(keep_affine=bool(options.keep_affine))
    if options.to not in STREAMED_TARGETS or options.variant_options:
        what = f"--to {options.to}" if options.to not in STREAMED_TARGETS else "--option"
        raise StreamUnsupportedError(f"streaming converts --to {' or '.join(STREAMED_TARGETS)} without --option; "
                                     f"{what} needs the in-memory conversion (--stream never, or normfold.convert)")
    if options.rotate_attention not in (None, "online"):
        raise StreamUnsupportedError(f"--rotate-attention {options.rotate_attention} needs the in-memory conversion "
                                     "(--stream never, or normfold.convert); only --rotate-attention online streams")
    try:
        return options.check()  # the rules every conversion follows (ConvertOptions.check), the same messages
    except NormfoldError as exc:
        raise StreamUnsupportedError(str(exc)) from exc



def prepare(source_dir: str | os.PathLike, *, to: str | None = None, options: ConvertOptions | None = None,
            keep_affine: bool | None = None, fold_final: bool | None = None, allow_new_bias: bool | None = None,
            pad: bool | None = None, untie: bool | None = None, rotate: str | None = None,
            rotate_seed: int | None = None, rotate_online: bool | None = None,
            rotate_attention: str | None = None) -> Prepared:
    """Everything `stream_convert` checks before it writes anything (headers, dtypes, names, the adapter and
    its plan, on a meta model: no weights read but norm biases later). Raises StreamUnsupportedError (or
    another NormfoldError) when this source or option cannot stream; the CLI's `--stream auto` then
    converts in memory."""
    from .reverse import is_normfold_checkpoint

    if is_normfold_checkpoint(source_dir):
        raise StreamUnsupportedError(f"{source_dir} is a normfold checkpoint (normfold.json): its conversions are "
                                     "reverse ones; stream_convert(..., to='layernorm') streams a Pre-RMSNorm / "
                                     "Pre-CRMSNorm one back (normfold.stream.reverse), the others convert in memory (--stream never)")
    options = _options(options, to, keep_affine, fold_final, allow_new_bias, pad, untie, rotate, rotate_seed,
                       rotate_online, rotate_attention)
    if options.rotate is not None:
        from .rotation import variant

        try:
            variant(options)  # refuses what normfold.convert refuses (--keep-affine, unknown kinds)
        except NormfoldError as exc:
            raise StreamUnsupportedError(str(exc)) from exc
    checkpoint.ModelDir(source_dir).check_all()  # config, weights, tokenizer files: nothing from outside
    source = open_source(source_dir)
    dtype = checkpoint_dtype(source)
    original = meta_model(source.path, dtype, set(source.tensors))
    names = source_names(original, source)
    adapter = find_adapter(original)
    if adapter.check is not None:
        adapter.check(original)
    plan = recentre_tied_tables(original, adapter.plan(original), options)  # as normfold.convert does
    if options.rotate is not None:
        from .rotation import check_plan

        check_plan(plan)
    return Prepared(source, dtype, original, names, adapter, plan, options)



def stream_convert(source_dir: str | os.PathLike, out_dir: str | os.PathLike, *, to: str | None = None,
                   options: ConvertOptions | None = None, keep_affine: bool | None = None,
                   fold_final: bool | None = None, allow_new_bias: bool | None = None, pad: bool | None = None,
                   untie: bool | None = None, rotate: str | None = None, rotate_seed: int | None = None,
                   rotate_online: bool | None = None, rotate_attention: str | None = None,
                   progress: Progress | None = None,
                   prepared: Prepared | None = None) -> ConversionReport:
    """Convert the safetensors checkpoint in `source_dir` into `out_dir` (an existing empty directory)
    shard by shard, to Pre-RMSNorm or Pre-CRMSNorm (`pad` too), rotated with `rotate` / `rotate_seed`. Writes the weights (sharded like the source
    when it is stock-reloadable, else one normfold_model.safetensors), config.json, the tokenizer/generation
    files and normfold.json: the same bytes as `normfold.convert` + `normfold.save`.
    Verification is not run here (the report says so); see `normfold.cli.convert_stream.verify_streamed`.
    `prepared`: the result of `prepare` for the same source and options (skips redoing it)."""
    say = progress or (lambda msg: None)
    out = Path(out_dir)
    if not out.is_dir() or any(out.iterdir()):
        raise NormfoldError(f"{out} must be an existing empty directory")
    t0 = time.perf_counter()
    if prepared is None:
        from .reverse import REVERSE_TARGETS, is_normfold_checkpoint, stream_reverse

        target = to if to is not None else (options.to if options is not None else None)
        if is_normfold_checkpoint(source_dir):
            extra = [k for k, v in dict(keep_affine=keep_affine, fold_final=fold_final, allow_new_bias=allow_new_bias,
                                        pad=pad, untie=untie).items() if v]
            if target not in REVERSE_TARGETS or extra or (options is not None and options.variant_options):
                raise StreamUnsupportedError(
                    f"{source_dir} is a normfold checkpoint: streaming converts it --to layernorm (or, from "
                    f"Pre-CRMSNorm, --to rmsnorm) only, without options (asked: --to "
                    f"{target}{''.join(' --' + k for k in extra)}); convert it in memory "
                    "(--stream never, or normfold.load + normfold.convert)")
            return stream_reverse(source_dir, out, to=target, progress=progress)
        prepared = prepare(source_dir, to=to, options=options, keep_affine=keep_affine, fold_final=fold_final,
                           allow_new_bias=allow_new_bias, pad=pad, untie=untie, rotate=rotate, rotate_seed=rotate_seed,
                           rotate_online=rotate_online, rotate_attention=rotate_attention)
    source, dtype, original, names = prepared.source, prepared.dtype, prepared.original, prepared.names
    adapter, plan, options = prepared.adapter, prepared.plan, prepared.options
    to = options.to
    say(f"{type(original).__name__}, {dtype}, {len(source.shards)} shard(s), adapter {adapter.display_name}")

    # pass 1: the structure and the report, by the variant's own apply, on meta tensors
    from ..sizes import measure, size_report

    structure_model = copy.deepcopy(original)
    layernorms = layernorm_names(original)
    report = new_report(type(original).__name__, working_dtype(original), layernorms, adapter, plan,
                        options)  # as normfold.convert starts it
    before = measure(original)
    rotating = options.rotate is not None
    if rotating:
        from . import rotation
    variant = rotation.variant(options) if rotating else VARIANTS[to]
    # the value questions (β all zero, tied head unchanged) answered from the checkpoint: the model has no values
    values = checkpoint_values(structure_model, plan, names, source, options)
    variant.apply(structure_model, dataclasses.replace(plan, values=values), options, report)
    structure_model.eval()
    report.size = size_report(before, structure_model)
    finish_report(report, layernorms, plan)
    report.source = {"model": str(source_dir), "architecture": type(original).__name__,
                     "model_type": getattr(original.config, "model_type", None), "path": str(source_dir)}
    report.notes.append("converted shard by shard from the safetensors files (normfold.stream)")
    outputs = output_tensors(structure_model, report)

    # pass 2: values, component by component, on the untransformed meta model
    values_model = copy.deepcopy(original)
    untie_params(values_model, edited_params(values_model, plan, options))
    comps = components(plan_edits(values_model, plan, options, report.structure.tied_heads))
    owner = owners(comps, outputs)
    compression = report.structure.compression if to == "crmsnorm" else None
    if rotating:  # float64 from read to one rounding, each stream tensor ·Q (stream/rotation.py)
        from ..rotate import rotation_of

        computer = rotation.RotatingComputer(values_model, plan, options, source, names,
                                             rotation.targets(structure_model, plan, report),
                                             rotation_of(report.structure.rotation), outputs,
                                             rotation.online_targets(structure_model, report))
        computer.check_owned(comps)
    else:
        computer = Computer(values_model, plan, options, source, names, compression)
    owner = {k: v for k, v in owner.items() if k not in computer.head_means}  # computed from the source table
    tied = tied_aliases(structure_model, [o for o in outputs if o.name not in computer.head_means], owner, comps)
    computer.aliases = {a: name for a, (name, _) in tied.items()}
    owner.update({a: i for a, (_, i) in tied.items()})
    files = assign_files(source, report, outputs, owner, comps, names)
    return write_streamed(out, files, outputs, owner, comps, computer, names, source, say, structure_model, report, t0)



