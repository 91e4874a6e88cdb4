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
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from torch import nn

from . import checkpoint_guard as guard
from .adapters.base import get, parent_and_leaf
from .errors import (CheckpointError, ModelNotFoundError, NormfoldError, NotAModelError, OutputExistsError,
                     OutputWriteError)
from .nn import norm_type
from .nn.hooks import add_input_recenter, add_output_recenter
from .report import ConversionReport, Structure

STOCK_WEIGHTS = "model.safetensors"
STOCK_INDEX = "model.safetensors.index.json"
NORMFOLD_WEIGHTS = "normfold_model.safetensors"
REPORT_FILE = "normfold.json"
# Files copied verbatim from the source model directory (tokenizer, processor, generation config).
_AUXILIARY = re.compile(r"(tokenizer.*|vocab.*|merges\.txt|special_tokens_map\.json|added_tokens\.json|"
                        r"generation_config\.json|preprocessor_config\.json|processor_config\.json|"
                        r".*\.model|chat_template.*)$")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _transformers():
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
    transformers = _transformers()
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
    transformers = _transformers()
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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    backup = None
    try:
        weights = STOCK_WEIGHTS if report.stock_reloadable else NORMFOLD_WEIGHTS
        # one metadata key: safetensors writes __metadata__ from a Rust HashMap, so with two keys their
        # order (and the file's bytes) changed from run to run (issue 11 item 5: repeatable conversions)
        save_file(export_state_dict(model, report), str(tmp / weights), metadata={"format": "pt"})
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
        if source_dir is not None:
            for f in Path(source_dir).iterdir():
                if f.is_file() and _AUXILIARY.fullmatch(f.name):
                    shutil.copy2(f, tmp / f.name)
        (tmp / REPORT_FILE).write_text(report.to_json() + "\n")
        _apply_umask(tmp)
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


def _apply_umask(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only files; give the result the usual permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


# ---- loading back --------------------------------------------------------------------------------------

def read_report(path: str | os.PathLike) -> ConversionReport:
    f = Path(path) / REPORT_FILE
    if not f.is_file():
        raise CheckpointError(f"{path} is not a normfold checkpoint (no {REPORT_FILE}); "
                              "load plain models with transformers or convert them with `normfold convert`")
    try:
        return ConversionReport.from_dict(json.loads(f.read_text()))
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{f} is not a valid normfold report: {exc}") from exc


def apply_structure(model: nn.Module, structure: Structure) -> nn.Module:
    """Rebuild normfold's modules on a stock model: swap the recorded norms (taking their values from
    the loaded LayerNorms), re-attach Recenter ops and create added biases."""
    for rec in structure.norms:
        ln = get(model, rec.name)
        cls = norm_type(rec.type)
        new = cls.from_layernorm(ln, keep_weight=rec.weight, keep_bias=rec.bias, **rec.options)
        parent, leaf = parent_and_leaf(model, rec.name)
        setattr(parent, leaf, new)
    for path in structure.recenter_after:
        add_output_recenter(get(model, path))
    for path in structure.recenter_before:
        add_input_recenter(get(model, path))
    for path in structure.added_bias:
        module = get(model, path)
        if getattr(module, "bias", None) is None:
            out_features = module.weight.shape[0]
            module.bias = nn.Parameter(torch.zeros(out_features, dtype=module.weight.dtype))
    if structure.compression:  # Pre-CRMSNorm: resized writers/readers and compress hooks
        from .compress.runtime import apply_compression

        apply_compression(model, structure.compression)
    return model


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


def load(path: str | os.PathLike, dtype: str | torch.dtype | None = None, *, fast: bool = True) -> nn.Module:
    """Load a checkpoint written by `normfold convert` / `normfold.save` with normfold's fast norms.

    The returned model (eval mode) has the report at `model.normfold_report`. `fast=False` skips
    the runtime fast paths of `normfold.fastpath` (exact rewrites of how the model computes, e.g.
    padded writers on a Pre-CRMS stream); the checkpoint's tensors are the same either way."""
    transformers = _transformers()
    path = Path(path)
    if not path.is_dir():
        raise ModelNotFoundError(f"{path}: no such directory")
    report = read_report(path)
    torch_dtype = _parse_dtype(dtype)
    config = transformers.AutoConfig.from_pretrained(path)
    cls = model_class(config)
    if (path / STOCK_WEIGHTS).is_file() or (path / STOCK_INDEX).is_file():  # sharded: normfold.stream
        model = cls.from_pretrained(path, dtype=torch_dtype or "auto")
        apply_structure(model, report.structure)
    elif (path / NORMFOLD_WEIGHTS).is_file():
        from safetensors.torch import load_file

        state = load_file(str(path / NORMFOLD_WEIGHTS))
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
    else:
        raise CheckpointError(f"{path} has neither {STOCK_WEIGHTS} nor {NORMFOLD_WEIGHTS}")
    model.eval()
    if fast:
        from . import fastpath

        fastpath.apply(model)
    model.normfold_report = report
    return model
