"""Loading source models, saving converted checkpoints atomically, and loading them back.

A saved directory holds:

- ``model.safetensors`` when the conversion is *stock-reloadable*: the converted weights written
  in the stock architecture's layout (each RMSNorm saved as a LayerNorm with weight 1 / bias 0
  where its affine was folded away). Plain ``transformers`` loads it, normfold not imported, and
  computes the same function, because LayerNorm on a zero-mean input is RMSNorm.
- ``normfold_model.safetensors`` otherwise (explicit Recenter ops, added biases, ...): a different
  file name so that stock ``from_pretrained`` fails loudly instead of silently computing
  something else. ``normfold.load`` reads both.
- ``config.json`` (+ generation config, tokenizer files copied from the source) and
  ``normfold.json``: the conversion report, whose ``structure`` `normfold.load` replays.

Only safetensors are written; pickles are never loaded (``weights_only=True`` in transformers).
"""

from __future__ import annotations

import contextlib

import copy
import errno
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import checkpoint_guard as guard
from .checkpoint import ModelDir, file_digest
from .checkpoint.writer import can_write, save_safetensors
from .adapters.base import get, parent_and_leaf
from .errors import (CheckpointError, ModelNotFoundError, NormfoldError, NotAModelError, OutputExistsError,
                     OutputWriteError, ReportSchemaError)
from .nn import norm_type
from .nn.hooks import add_input_recenter, add_output_recenter
from .report import ConversionReport, Structure

STOCK_WEIGHTS = "model.safetensors"
STOCK_INDEX = "model.safetensors.index.json"
NORMFOLD_WEIGHTS = "normfold_model.safetensors"
NORMFOLD_INDEX = "normfold_model.safetensors.index.json"
REPORT_FILE = "normfold.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def transformers_module():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise NormfoldError("loading Hugging Face models needs transformers: pip install 'normfold[hf]'") from exc
    return transformers


def default_model_path() -> Path:
    """The bundled default model (a small GPT-2 trained on the King James Bible)."""
    return Path(__file__).parent / "data" / "kjv-gpt2"


def _looks_like_hub_id(source: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", source)) and not source.startswith(".")


def model_class(config):
    """The transformers class named in config.architectures (AutoModel's choice when absent)."""
    transformers = transformers_module()
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    try:
        return transformers.AutoModel._model_mapping[type(config)]
    except KeyError:
        raise NotAModelError(f"transformers has no model class for config type {type(config).__name__}") from None


def load_source(source: str | os.PathLike | None, dtype: str | torch.dtype | None = None, *,
                trust_remote_code: bool = False) -> tuple[nn.Module, dict]:
    """Load MODEL for conversion: a local HF directory, a hub id (when online), or None = bundled model.

    A local directory is inspected first (`normfold.checkpoint_guard`): broken or hostile weight files,
    configs that need the checkpoint's own code (unless trust_remote_code) and weights whose shapes
    disagree with the config are refused before transformers reads them.

    Returns (model in eval mode, source description)."""
    transformers = transformers_module()
    bundled = source is None
    path = default_model_path() if bundled else Path(source)
    torch_dtype = _parse_dtype(dtype)
    if path.exists():
        if not path.is_dir():
            raise NotAModelError(f"{path} is a file; MODEL must be a Hugging Face model directory "
                                 "(with config.json and weights) or a hub id")
        if not (path / "config.json").is_file():
            raise NotAModelError(f"{path} is not a Hugging Face model directory: it has no config.json")
        where = str(path)
    elif not bundled and _looks_like_hub_id(str(source)):
        where = str(source)
    else:
        raise ModelNotFoundError(f"{source}: no such directory (MODEL must be a local Hugging Face model "
                                 "directory or a hub id like 'gpt2')")
    info = None
    if path.exists():
        guard.check_remote_code(path / "config.json", trust_remote_code)
        info = guard.inspect_checkpoint(path)  # before any loader touches the files
    try:
        config = transformers.AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
        cls = model_class(config)
        if info is not None:
            guard.check_shapes(info, _on_meta(cls, config))
        model = cls.from_pretrained(where, dtype=torch_dtype or "auto", trust_remote_code=trust_remote_code)
    except NormfoldError:
        raise
    except RuntimeError as exc:  # transformers' own size-mismatch report, if check_shapes missed a renamed key
        if "mismatched" in str(exc) or "size mismatch" in str(exc):
            raise guard.CheckpointError(f"{path}: weights do not match config.json ({_first_line(exc)}); use the "
                                        "config.json published with these weights") from None
        raise
    except (OSError, ValueError, KeyError, EnvironmentError) as exc:
        if path.exists():
            raise NotAModelError(f"{path} could not be loaded as a Hugging Face model: {_first_line(exc)}") from exc
        raise ModelNotFoundError(f"{source}: not a local directory, and loading it from the Hugging Face hub "
                                 f"failed: {_first_line(exc)}") from exc
    model.eval()
    info = {"model": "bundled:kjv-gpt2" if bundled else str(source), "architecture": type(model).__name__,
            "model_type": getattr(config, "model_type", None), "path": str(path) if path.exists() else None}
    return model, info


def _on_meta(cls, config) -> nn.Module | None:
    """The model the config builds, on the meta device (no memory); None if it cannot be built there."""
    try:
        with torch.device("meta"):
            return cls(config)
    except Exception:  # exotic constructors: transformers' own size check still applies
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:400]


def _parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype)]
    except KeyError:
        raise NormfoldError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}") from None


# ---- saving ----------------------------------------------------------------------------------------

def check_output_dir(out: str | os.PathLike, force: bool) -> Path:
    """Fail early (before any work) if `out` exists and --force was not given."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory; choose another --out (normfold never "
                                "replaces a file)")
    if out.exists() and not force:
        raise OutputExistsError(f"{out} already exists; choose another --out or pass --force to replace it")
    _check_writable(out.absolute().parent, out)
    return out


def _check_writable(parent: Path, out: Path) -> None:
    """The output is written as a temporary directory beside `out`: make sure one can be created there
    (by trying: os.access says yes to root even on read-only file systems)."""
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputWriteError(f"cannot write {out}: {existing} is a file, not a directory; choose another --out")
    try:
        probe = Path(tempfile.mkdtemp(prefix=".normfold-probe-", dir=existing))
        probe.rmdir()
    except OSError as exc:
        raise OutputWriteError(f"cannot write {out}: {existing} is not writable ({exc.strerror or exc}); choose "
                               "another --out on a writable file system") from None


def _write_failed(out: Path, exc: BaseException) -> OutputWriteError:
    text = str(exc)
    errno_ = getattr(exc, "errno", None)
    full = errno_ in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) or any(
        k in text for k in ("No space left", "File too large", "Disk quota", "os error 28", "os error 27"))
    why = "the disk is full (or a file-size / quota limit was hit)" if full else _first_line(exc)
    return OutputWriteError(f"writing {out} failed: {why}. The partial output was removed and nothing was written "
                            f"at {out}; free space (or choose --out on another disk) and run again")


@contextlib.contextmanager
def output_lock(out: str | os.PathLike):
    """`.{name}.lock` beside `out`, created exclusively: a second conversion into `out` fails at once.
    A lock whose process is gone (kill -9, power cut) is stale and taken over."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{out.name}.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            if not _stale(lock):
                raise OutputExistsError(f"another normfold conversion is writing {out} (lock file {lock}); wait for "
                                        "it to finish or choose another --out") from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
    else:
        raise OutputExistsError(f"could not take the lock {lock} for {out}; choose another --out")
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        yield lock
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)


def _stale(lock: Path) -> bool:
    """True when the lock names a process that no longer exists (on this machine)."""
    try:
        pid = int(lock.read_text().strip() or "0")
    except (OSError, ValueError):
        return False  # being written right now, or not ours: respect it
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def export_state_dict(model: nn.Module, report: ConversionReport) -> dict[str, torch.Tensor]:
    """State dict in the stock layout: folded-away norm affines written back as ones / zeros."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if report.stock_reloadable:
        for rec in report.structure.norms:
            norm = get(model, rec.name)
            ref = next(iter(norm.parameters()), None)
            dtype = ref.dtype if ref is not None else _float_dtype(model)
            shape = tuple(norm.normalized_shape)
            if rec.stock_weight and f"{rec.name}.weight" not in state:
                state[f"{rec.name}.weight"] = torch.ones(shape, dtype=dtype)
            if rec.stock_bias and f"{rec.name}.bias" not in state:
                state[f"{rec.name}.bias"] = torch.zeros(shape, dtype=dtype)
    return _dedupe(state)


def _float_dtype(model: nn.Module) -> torch.dtype:
    from .modelinfo import working_dtype

    return working_dtype(model)


def _dedupe(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: keep the first name of each tied tensor (transformers
    re-ties the others from the config)."""
    seen: dict[tuple, str] = {}
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = name
        out[name] = t.contiguous().cpu()
    return out


def save(model: nn.Module, report: ConversionReport, out: str | os.PathLike, *, force: bool = False,
         source_dir: str | os.PathLike | None = None) -> Path:
    """Write `model` + `report` to directory `out` atomically (temp dir, then rename).

    An existing `out` is only replaced with force=True, and only once the new directory is complete:
    if anything fails, the old directory is left as it was and no partial output remains."""
    from safetensors.torch import save_file

    out = check_output_dir(out, force).absolute()
    # the files copied from the source, checked before any output exists (nothing from outside it)
    auxiliary = ModelDir(source_dir).auxiliary_files() if source_dir is not None else []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    backup = None
    try:
        weights = STOCK_WEIGHTS if report.stock_reloadable else NORMFOLD_WEIGHTS
        # one metadata key: safetensors writes __metadata__ from a Rust HashMap, so with two keys their
        # order (and the file's bytes) changed from run to run (issue 11 item 5: repeatable conversions)
        state = export_state_dict(model, report)
        # tamper evidence: `normfold verify CONVERTED` checks the digest, computed as the file is written
        # (same bytes as safetensors' save_file: checkpoint.writer lays the header out as it does)
        if can_write(state):
            digest = save_safetensors(state, tmp / weights, metadata={"format": "pt"})
        else:  # a dtype the writer does not know: safetensors writes it, the file is read back once
            save_file(state, str(tmp / weights), metadata={"format": "pt"})
            digest = {"sha256": file_digest(tmp / weights), "bytes": (tmp / weights).stat().st_size}
        del state
        report.weight_files = {weights: digest}
        config = getattr(model, "config", None)
        if config is not None:
            config = copy.deepcopy(config)
            config.architectures = [type(model).__name__]  # so loaders pick this head class
            config.save_pretrained(tmp)
        gen = getattr(model, "generation_config", None)
        if gen is not None and source_dir is None:
            try:
                gen.save_pretrained(tmp)
            except Exception:  # generation config is optional; a bad one must not fail the save
                pass
        for f in auxiliary:
            shutil.copy2(f, tmp / f.name)
        (tmp / REPORT_FILE).write_text(report.to_json() + "\n")
        apply_umask(tmp)
        if out.exists():
            backup = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out, backup)
        os.rename(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if backup is not None and not out.exists():
            os.rename(backup, out)
        if isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError":
            raise _write_failed(out, exc) from None
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    return out


def apply_umask(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only files; give the result the usual permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


def weight_file_bytes(directory: str | os.PathLike) -> int:
    """Total size of the safetensors weight files in a model directory (0 if none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    return sum(f.stat().st_size for f in directory.glob("*.safetensors") if f.is_file())


def rewrite_report(directory: str | os.PathLike, report: ConversionReport) -> None:
    """Replace `normfold.json` in a written checkpoint atomically (temp file, then rename)."""
    directory = Path(directory)
    fd, tmp = tempfile.mkstemp(prefix=f".{REPORT_FILE}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(report.to_json() + "\n")
        os.chmod(tmp, (directory / REPORT_FILE).stat().st_mode & 0o777)
        os.replace(tmp, directory / REPORT_FILE)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# ---- loading back --------------------------------------------------------------------------------------

def read_report(path: str | os.PathLike) -> ConversionReport:
    """The `normfold.json` of a checkpoint directory, read through the path policy and validated against
    the report schema (`ReportSchemaError`, exit code 2, on anything it does not describe)."""
    directory = ModelDir(path)
    if not directory.exists(REPORT_FILE):
        raise CheckpointError(f"{path} is not a normfold checkpoint (no {REPORT_FILE}); "
                              "load plain models with transformers or convert them with `normfold convert`")
    f = directory.file(REPORT_FILE)
    if f.stat().st_size > MAX_REPORT_BYTES:
        raise ReportSchemaError(f"{f} is {f.stat().st_size} bytes; a normfold report is far smaller "
                                f"(limit {MAX_REPORT_BYTES}): not a report normfold wrote")
    try:
        data = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ReportSchemaError(f"{f} is not a valid normfold report (not JSON: {_first_line(exc)}); "
                                "re-download the checkpoint or reconvert the model") from None
    try:
        return ConversionReport.from_dict(data)
    except ReportSchemaError as exc:
        raise _located(exc, f) from None


def _located(exc: ReportSchemaError, report_path: Path) -> ReportSchemaError:
    """The schema's message with the report's path instead of its bare name, and what to do."""
    text = str(exc).removeprefix(f"{REPORT_FILE}: ").removeprefix(REPORT_FILE)
    text = f"{report_path}{'' if text.startswith(' ') else ': '}{text}"
    if "upgrade normfold" not in text and "reconvert" not in text:
        text += "; re-download the checkpoint or reconvert the model"
    return ReportSchemaError(text)


MAX_REPORT_BYTES = 64 * 1024 * 1024  # a 48-block model's report is ~80 KB


def _norm_width(module: nn.Module) -> int | None:
    """The normalized width of a norm module (LayerNorm-like: `normalized_shape`, else a 1-D weight)."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, int):
        return shape
    if isinstance(shape, (tuple, list)) and shape and all(isinstance(d, int) for d in shape):
        return shape[-1]
    w = module._parameters.get("weight") if isinstance(module, nn.Module) else None
    return int(w.shape[-1]) if w is not None and w.dim() == 1 else None


def validate_structure(model: nn.Module, structure: Structure) -> None:
    """Check a report's structure against the model that config.json builds (on any device, meta included),
    before anything is changed: every path names a module / parameter of the model (through
    `named_modules()` / `named_parameters()`), each recorded norm is a norm of the recorded width, recorded
    shapes and dims fit the parameters. `ReportSchemaError` otherwise."""
    from .adapters.base import submodule

    modules = dict(model.named_modules(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    arch = type(model).__name__

    def module(path: str, where: str) -> nn.Module:
        if path not in modules or not path:
            raise ReportSchemaError(f"normfold.json: {where} names {path[:120]!r}, which is not a module of the "
                                    f"{arch} that config.json builds; the report does not belong to this model")
        return submodule(model, path)

    def param(path: str, where: str) -> torch.Tensor:
        if path not in params:
            raise ReportSchemaError(f"normfold.json: {where} names {path[:120]!r}, which is not a parameter of the "
                                    f"{arch} that config.json builds; the report does not belong to this model")
        return params[path]

    seen = set()
    for i, rec in enumerate(structure.norms):
        where = f"structure.norms[{i}]"
        m = module(rec.name, f"{where}.name")
        if rec.name in seen:
            raise ReportSchemaError(f"normfold.json: {where} records {rec.name!r} a second time")
        seen.add(rec.name)
        width = _norm_width(m)
        if width is None:
            raise ReportSchemaError(f"normfold.json: {where} records {rec.name!r} as a norm, but in {arch} it is a "
                                    f"{type(m).__name__}, not a norm")
        if not (math.isfinite(rec.eps) and 0 <= rec.eps < 1):
            raise ReportSchemaError(f"normfold.json: {where}.eps is {rec.eps}; a norm's eps lies in [0, 1)")
        if "width" in rec.options and rec.options["width"] != width:
            raise ReportSchemaError(f"normfold.json: {where}.options.width is {rec.options['width']}, but "
                                    f"{rec.name} of the {arch} that config.json builds is {width} wide")
        for j, path in enumerate(rec.folded_into):
            module(path, f"{where}.folded_into[{j}]")
    for key in ("recenter_after", "recenter_before", "added_bias"):
        for j, path in enumerate(getattr(structure, key)):
            m = module(path, f"structure.{key}[{j}]")
            if key == "added_bias":
                w = m._parameters.get("weight")
                if w is None or w.dim() != 2:
                    raise ReportSchemaError(f"normfold.json: structure.added_bias[{j}] names {path!r}, a "
                                            f"{type(m).__name__} without a matrix weight to add a bias beside")
    state_keys = set(model.state_dict(keep_vars=True))
    for j, name in enumerate(structure.untied):
        if name not in params and name not in state_keys:
            param(name, f"structure.untied[{j}]")
    comp = structure.compression or {}
    for name, shape in comp.get("shapes", {}).items():
        p = param(name, "structure.compression.shapes")
        if len(shape) != p.dim() or any(d not in (o, o - 1) or d < 0 for d, o in zip(shape, p.shape)):
            raise ReportSchemaError(f"normfold.json: structure.compression.shapes gives {name} shape {shape[:8]}, "
                                    f"which does not fit its shape {list(p.shape)} from config.json (each "
                                    "dimension stays or loses one coordinate)")
    for key in ("compress_after", "compress_before", "widen_after", "narrow_before"):
        for j, path in enumerate(comp.get(key, [])):
            module(path, f"structure.compression.{key}[{j}]")
    for key in ("writer_params", "reader_params"):
        for name, dim in comp.get(key, {}).items():
            p = param(name, f"structure.compression.{key}")
            if not -p.dim() <= dim < p.dim():
                raise ReportSchemaError(f"normfold.json: structure.compression.{key} gives {name} the axis {dim}; "
                                        f"it has {p.dim()}")
    for j, tie in enumerate(comp.get("tied_heads", [])):
        module(tie["head"], f"structure.compression.tied_heads[{j}].head")
        table = module(tie["table"], f"structure.compression.tied_heads[{j}].table")
        w = table._parameters.get("weight")
        if w is None or w.dim() != 2:
            raise ReportSchemaError(f"normfold.json: structure.compression.tied_heads[{j}].table names "
                                    f"{tie['table']!r}, which has no table (a matrix weight)")


# Parts of a recorded `Structure` that a higher layer knows how to rebuild (a target's own modules and
# hooks): field name -> apply(model, part). `normfold.compress` registers "compression"; io imports none
# of them, so the layers stay one-way.
STRUCTURE_PARTS: dict[str, Callable[[nn.Module, object], None]] = {}


def register_structure_part(field_name: str, apply: Callable[[nn.Module, object], None]) -> None:
    """Make `apply_structure` (and so `normfold.load`) call `apply(model, structure.<field_name>)` when that
    part of the recorded structure is non-empty."""
    STRUCTURE_PARTS[field_name] = apply


def apply_structure(model: nn.Module, structure: Structure) -> nn.Module:
    """Rebuild normfold's modules on a stock model: swap the recorded norms (taking their values from
    the loaded LayerNorms), re-attach Recenter ops and create added biases.

    The structure is validated first (`validate_structure`: paths through the module tree only, widths);
    nothing is changed when it does not fit the model."""
    from .adapters.base import submodule

    validate_structure(model, structure)
    try:
        for rec in structure.norms:
            ln = submodule(model, rec.name)
            cls = norm_type(rec.type)
            new = cls.from_layernorm(ln, keep_weight=rec.weight, keep_bias=rec.bias, **rec.options)
            head, _, leaf = rec.name.rpartition(".")
            setattr(submodule(model, head), leaf, new)
        for path in structure.recenter_after:
            add_output_recenter(submodule(model, path))
        for path in structure.recenter_before:
            add_input_recenter(submodule(model, path))
        for path in structure.added_bias:
            module = submodule(model, path)
            if getattr(module, "bias", None) is None:
                out_features = module.weight.shape[0]
                module.bias = nn.Parameter(torch.zeros(out_features, dtype=module.weight.dtype,
                                                       device=module.weight.device))
        apply_tied_heads(model, structure.tied_heads)
        if structure.rotation:
            _apply_rotation_hooks(model, structure.rotation)
        for path in structure.rotation.get("online", []) if structure.rotation else []:  # online Hadamard inputs
            from .algebra import layout_of
            from .nn.online import add_input_hadamard

            module = dict(model.named_modules()).get(str(path))
            if module is None:
                raise CheckpointError(f"normfold.json: online rotation at {path!r}, which is not a module of this model")
            lay = layout_of(module)
            if lay is None or lay.in_dim is None:
                raise CheckpointError(f"normfold.json: online rotation at {path}, which is not a linear module")
            try:
                add_input_hadamard(module, int(getattr(module, lay.weight).shape[lay.in_dim]))
            except ValueError as exc:
                raise CheckpointError(f"normfold.json: online rotation at {path}: {exc}") from None
        for field_name, apply_part in STRUCTURE_PARTS.items():  # e.g. Pre-CRMSNorm's resized writers/readers
            part = getattr(structure, field_name, None)
            if part:
                apply_part(model, part)
    except (ValueError, TypeError, KeyError, LookupError) as exc:  # e.g. an option value the module refuses
        raise ReportSchemaError(f"normfold.json: its structure cannot be rebuilt on {type(model).__name__}: "
                                f"{_first_line(exc)}") from None
    return model


def _apply_rotation_hooks(model: nn.Module, rotation: dict) -> None:
    """The explicit stream rotations of a rotated checkpoint (normfold.rotate), Q rebuilt from kind + seed."""
    from .algebra import rotation_matrix
    from .nn.online import add_input_rotation, add_output_rotation

    modules = dict(model.named_modules())
    widths = {int(getattr(m, "normalized_shape", (0,))[-1]) for m in modules.values() if hasattr(m, "normalized_shape")}
    explicit = rotation.get("explicit", [])
    if not isinstance(explicit, list):
        raise CheckpointError("normfold.json: structure.rotation.explicit must be a list")
    for e in explicit:
        try:
            if not isinstance(e, dict) or set(e) - {"path", "where", "width", "transpose"}:
                raise ValueError("unknown or missing fields")
            width = int(e["width"])
            if width not in widths:  # also bounds the d×d matrix built below
                raise ValueError(f"width {width} is not the width of any norm of this model")
            module = modules[str(e["path"])]
            ref = next(iter(model.parameters()), None)
            if ref is not None and ref.is_meta:  # checking a report against the config's meta model: shapes only
                q = torch.empty(width, width, device="meta")
            else:
                with torch.device("cpu"):
                    q, _ = rotation_matrix(str(rotation["kind"]), width, int(rotation.get("seed", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"normfold.json: bad explicit rotation entry {e!r}: {exc}") from None
        q = (q.T if e.get("transpose") else q).contiguous().to(ref.dtype if ref is not None else torch.float32)
        if e.get("where") == "output":
            add_output_rotation(module, q)
        elif e.get("where") == "input":
            add_input_rotation(module, q)
        else:
            raise CheckpointError(f"normfold.json: explicit rotation at {e.get('path')}: unknown place {e.get('where')!r}")


def apply_tied_heads(model: nn.Module, records: list[dict]) -> None:
    """Replace each recorded head by an `nn.TiedHead` reading the recorded embedding table (its mean,
    scale and bias are filled from the checkpoint; an existing bias Parameter is reused, so aliases of
    it stay shared). Paths are resolved through named_modules() only."""
    from .nn import TiedHead

    if not records:
        return
    modules = dict(model.named_modules())
    for rec in records:
        head, table = modules.get(rec["head"]), modules.get(rec["table"])
        if not isinstance(head, nn.Linear) or not isinstance(table, nn.Embedding):
            raise CheckpointError(f"normfold.json records a head {rec['head']!r} tied to the table {rec['table']!r}, "
                                  f"but this model has no such linear head / embedding ({type(head).__name__}, "
                                  f"{type(table).__name__})")
        w = table.weight
        if tuple(head.weight.shape) != tuple(w.shape):
            raise CheckpointError(f"normfold.json ties {rec['head']} {tuple(head.weight.shape)} to {rec['table']} "
                                  f"{tuple(w.shape)}: the shapes differ")
        bias = head.bias if rec["bias"] else None
        if rec["bias"] and bias is None:
            bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype), requires_grad=False)
        mean = torch.zeros(w.shape[0], dtype=w.dtype)
        scale = torch.ones(w.shape[1], dtype=w.dtype) if rec["scale"] else None
        parent, leaf = parent_and_leaf(model, rec["head"])
        setattr(parent, leaf, TiedHead(table, mean, scale, bias))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _stored_dtype(state: dict) -> torch.dtype | None:
    """float64 if any stored tensor is float64, else None (the float32 default holds bf16/fp16 exactly)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in state.values()) else None


def _read_config(path: Path):
    transformers = transformers_module()
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: config.json could not be read ({_first_line(exc)}); re-download the "
                              "checkpoint") from None


def check_report_fits(path: Path, report: ConversionReport, cls, config, tensors: dict[str, tuple[str, tuple]],
                      stock: bool) -> None:
    """Before any memory is allocated: the report's structure, replayed on the model config.json builds on
    the meta device, must name that model's modules, and its dtype and shapes must be those of the weights
    (`tensors`: {name: (safetensors dtype, shape)} from the headers). ReportSchemaError otherwise."""
    meta = _on_meta(cls, config)
    if meta is None:
        raise CheckpointError(f"{path}: the model config.json describes cannot be built ({cls.__name__})")
    if report.architecture and report.architecture != cls.__name__:
        raise ReportSchemaError(f"{REPORT_FILE}: it describes a {report.architecture[:80]}, but config.json builds "
                                f"a {cls.__name__}; the report does not belong to these weights")
    if report.dtype not in ("",) + tuple(DTYPES):
        raise ReportSchemaError(f"{REPORT_FILE}: dtype {report.dtype[:40]!r} is not one of {', '.join(DTYPES)}")
    floats = {d for d, _ in tensors.values() if d in _ST_FLOATS}
    if report.dtype and floats and _ST_FLOATS_BY_NAME[report.dtype] not in floats:
        raise ReportSchemaError(f"{REPORT_FILE}: it says the weights are {report.dtype}, but they are stored as "
                                f"{', '.join(sorted(floats))}; the report does not belong to these weights")
    if stock:  # the stock layout: the norms' affines are stored as in the stock model
        guard.check_shapes(guard.CheckpointInfo(path, "safetensors", [], {
            k: guard.TensorEntry(k, d, tuple(sh), "") for k, (d, sh) in tensors.items()}), meta)
        validate_structure(meta, report.structure)
        return
    with torch.device("meta"):
        apply_structure(meta, report.structure)
    expected = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    tied = set(getattr(meta, "all_tied_weights_keys", {}) or {})
    bad = [f"{k}: file {list(sh)}, model {list(expected[k])}" for k, (_, sh) in tensors.items()
           if k in expected and tuple(sh) != expected[k]]
    unexpected = [k for k in tensors if k not in expected]
    missing = [k for k in expected if k not in tensors and k not in tied]
    if bad or unexpected or missing:
        parts = ([f"shapes differ ({'; '.join(bad[:3])})"] if bad else []) + \
                ([f"unexpected tensors {unexpected[:3]}"] if unexpected else []) + \
                ([f"missing tensors {missing[:3]}"] if missing else [])
        raise ReportSchemaError(f"{REPORT_FILE}: the weights in {path} do not match config.json with the structure "
                                f"it records: {', '.join(parts)}; the report, config and weights do not belong together")


_ST_FLOATS_BY_NAME = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
_ST_FLOATS = set(_ST_FLOATS_BY_NAME.values())


def inspect_converted(path: str | os.PathLike):
    """Everything `load` checks before it builds anything: (report, config, model class, stock layout?).
    Also used by block-wise verification, which builds the model without weights."""
    path = Path(path)
    if not path.is_dir():
        raise ModelNotFoundError(f"{path}: no such directory")
    directory = ModelDir(path)
    directory.check_all()
    report = read_report(path)
    directory.file("config.json")
    config = _read_config(path)
    cls = model_class(config)
    stock = directory.exists(STOCK_WEIGHTS) or directory.exists(STOCK_INDEX)
    if stock:  # sharded: normfold.stream
        info = guard.inspect_checkpoint(path)
        tensors = {k: (e.dtype, e.shape) for k, e in info.tensors.items()}
    elif directory.exists(NORMFOLD_WEIGHTS) or directory.exists(NORMFOLD_INDEX):
        tensors = {e.name: (e.dtype, e.shape) for f in normfold_weight_files(directory)
                   for e in guard.read_safetensors_header(f)}
    else:
        raise CheckpointError(f"{path} has neither {STOCK_WEIGHTS} nor {NORMFOLD_WEIGHTS}")
    try:
        check_report_fits(path, report, cls, config, tensors, stock)
    except ReportSchemaError as exc:
        raise _located(exc, path / REPORT_FILE) from None
    return report, config, cls, stock


def normfold_weight_files(directory: ModelDir) -> list[Path]:
    """The weight files of a checkpoint in normfold's own layout (one file, or shards with an index)."""
    from .checkpoint import weight_files

    found = weight_files(directory, NORMFOLD_INDEX, NORMFOLD_WEIGHTS)
    if found is None:
        raise CheckpointError(f"{directory.path} has neither {STOCK_WEIGHTS} nor {NORMFOLD_WEIGHTS}")
    return found[0]


def load(path: str | os.PathLike, dtype: str | torch.dtype | None = None, *, fast: bool = True) -> nn.Module:
    """Load a checkpoint written by `normfold convert` / `normfold.save` with normfold's fast norms.

    Before anything is built: every file is checked by the path policy (`normfold.checkpoint.ModelDir`),
    `normfold.json` against its schema, and its structure against config.json and the weights' headers
    (`check_report_fits`); any failure is a NormfoldError. The returned model (eval mode) has the report
    at `model.normfold_report`. `fast=False` skips the runtime fast paths of `normfold.fastpath` (exact
    rewrites of how the model computes: fused add + norm blocks, padded Pre-CRMS writers); the
    checkpoint's tensors are the same either way."""
    path = Path(path)
    torch_dtype = _parse_dtype(dtype)
    report, config, cls, stock = inspect_converted(path)
    directory = ModelDir(path)
    if stock:
        if report.structure.tied_heads:  # their row means are never in a stock file: it was not written by normfold
            raise CheckpointError(f"{path}: normfold.json records tied heads (nn.TiedHead) but the weights are in the "
                                  f"stock {STOCK_WEIGHTS}, which cannot hold them; the checkpoint was altered")
        model = cls.from_pretrained(path, dtype=torch_dtype or "auto")
        apply_structure(model, report.structure)
    else:
        from safetensors.torch import load_file

        state = {}
        for f in normfold_weight_files(directory):
            state.update(load_file(str(f)))
        # build in the stored dtype: load_state_dict copies into the existing parameters, so a float32
        # skeleton would round float64 weights before any later .to(float64)
        with _default_dtype(_stored_dtype(state)):
            model = cls(config)
            apply_structure(model, report.structure)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise CheckpointError(f"{path}: weights do not match the recorded structure "
                                  f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
        if torch_dtype is not None:
            model = model.to(torch_dtype)
        elif report.dtype in DTYPES:
            model = model.to(DTYPES[report.dtype])
    model.eval()
    if fast:
        from . import fastpath

        fastpath.apply(model)
    model.normfold_report = report
    return model
