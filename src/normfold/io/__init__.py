"""Loading source models, saving converted checkpoints atomically, and loading them back. Writing a
directory safely (checks before any work, the lock, permissions) is `io.atomic`; replaying a report's
structure on a stock model is `io.structure`; both are re-exported here.

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
import inspect
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from .. import checkpoint_guard as guard
from ..checkpoint import ModelDir, file_digest
from ..checkpoint.writer import can_write, save_safetensors
from ..adapters.base import get
from ..errors import CheckpointError, ModelNotFoundError, NormfoldError, NotAModelError, ReportSchemaError, first_line
from ..report import ConversionReport
from .atomic import (apply_umask, check_output_dir, output_lock, staged_dir, write_failed)  # noqa: F401  (re-exported)
from .structure import (STRUCTURE_PARTS, apply_structure, apply_tied_heads, register_structure_part,  # noqa: F401
                        validate_structure)

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
    return Path(__file__).resolve().parent.parent / "data" / "kjv-gpt2"


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
        kwargs = {}
        if info is not None:
            kwargs = init_kwargs(cls, config, set(info.tensors))
            guard.check_shapes(info, _on_meta(cls, config, kwargs))
        model = cls.from_pretrained(where, dtype=torch_dtype or "auto", trust_remote_code=trust_remote_code,
                                    **kwargs)
    except NormfoldError:
        raise
    except RuntimeError as exc:  # transformers' own size-mismatch report, if check_shapes missed a renamed key
        if "mismatched" in str(exc) or "size mismatch" in str(exc):
            raise guard.CheckpointError(f"{path}: weights do not match config.json ({first_line(exc)}); use the "
                                        "config.json published with these weights") from None
        raise
    except (OSError, ValueError, KeyError, EnvironmentError) as exc:
        if path.exists():
            raise NotAModelError(f"{path} could not be loaded as a Hugging Face model: {first_line(exc)}") from exc
        raise ModelNotFoundError(f"{source}: not a local directory, and loading it from the Hugging Face hub "
                                 f"failed: {first_line(exc)}") from exc
    model.eval()
    info = {"model": "bundled:kjv-gpt2" if bundled else str(source), "architecture": type(model).__name__,
            "model_type": getattr(config, "model_type", None), "path": str(path) if path.exists() else None}
    return model, info


def _on_meta(cls, config, kwargs: dict | None = None) -> nn.Module | None:
    """The model the config builds, on the meta device (no memory); None if it cannot be built there."""
    try:
        with torch.device("meta"):
            return cls(config, **(kwargs or {}))
    except Exception:  # exotic constructors: transformers' own size check still applies
        return None


def init_kwargs(cls, config, names: set[str]) -> dict:
    """The keyword arguments of `cls(config, **kwargs)` that a checkpoint holding the tensors `names` was
    built with, where they differ from the defaults.

    transformers records some constructor choices nowhere but in which tensors exist: config.json does
    not say that a model is `ViTModel(config, add_pooling_layer=False)` (no pooler) or
    `ViTModel(config, use_mask_token=True)` (a mask token), and `from_pretrained` would give the first a
    pooler with random weights. For each boolean keyword of the class's constructor, the model is built
    on the meta device with the other value, which adds or removes some tensors; the keyword takes the
    other value when every tensor only that build has is in the checkpoint and every tensor only the
    default build has is absent. A checkpoint matching neither build keeps the default (the weights
    then fail the checks against the model, which name the tensors). Constructors that cannot be
    inspected or built on the meta device keep their defaults."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # after self, config
    except (TypeError, ValueError):
        return {}
    flags = [p.name for p in params if isinstance(p.default, bool)
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not flags:
        return {}
    base = _on_meta(cls, config)
    if base is None:
        return {}
    default = set(base.state_dict())
    out = {}
    for name in flags:
        value = not next(p.default for p in params if p.name == name)
        other = _on_meta(cls, config, {name: value})
        if other is None:
            continue
        keys = set(other.state_dict())
        only_default, only_other = default - keys, keys - default
        if (only_default or only_other) and only_other <= names and not (only_default & names):
            out[name] = value
    return out


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
    return _dedupe(state, retied_names(model))


def retied_names(model: nn.Module) -> set[str]:
    """The parameter names transformers ties again on load from the config (`all_tied_weights_keys`' keys:
    the heads of tied embedding/head pairs): where a tensor is shared, the name saved is another one."""
    return set(getattr(model, "all_tied_weights_keys", None) or {})


def saved_names(aliases: list[list[str]], retied: set[str]) -> set[str]:
    """For each group of names sharing one tensor, the one name saved: the first that transformers does not
    tie again from the config (the embedding, not the head), else the first."""
    return {next((n for n in names if n not in retied), names[0]) for names in aliases}


def _float_dtype(model: nn.Module) -> torch.dtype:
    from ..modelinfo import working_dtype

    return working_dtype(model)


def _dedupe(state: dict[str, torch.Tensor], retied: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: keep one name of each tied tensor (`saved_names`; transformers
    re-ties the others from the config)."""
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if t.numel():
            groups.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype),
                              []).append(name)
    keep = saved_names(list(groups.values()), retied)
    return {name: t.contiguous().cpu() for name, t in state.items() if not t.numel() or name in keep}


def save(model: nn.Module, report: ConversionReport, out: str | os.PathLike, *, force: bool = False,
         source_dir: str | os.PathLike | None = None) -> Path:
    """Write `model` + `report` to directory `out` atomically (temp dir, then rename).

    An existing `out` is only replaced with force=True, and only once the new directory is complete:
    if anything fails, the old directory is left as it was and no partial output remains."""
    from safetensors.torch import save_file

    out = check_output_dir(out, force).absolute()
    # the files copied from the source, checked before any output exists (nothing from outside it)
    auxiliary = ModelDir(source_dir).auxiliary_files() if source_dir is not None else []
    with staged_dir(out, write_errors=("SafetensorError",)) as tmp:
        weights = STOCK_WEIGHTS if report.stock_reloadable else NORMFOLD_WEIGHTS
        # one metadata key: safetensors writes __metadata__ from a Rust HashMap, so with two keys their
        # order (and the file's bytes) changed from run to run (conversions must be repeatable)
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
    return out


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
        raise ReportSchemaError(f"{f} is not a valid normfold report (not JSON: {first_line(exc)}); "
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


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None):
    """torch's default dtype set to `dtype` (None: unchanged) inside the block, restored after it."""
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
        raise CheckpointError(f"{path}: config.json could not be read ({first_line(exc)}); re-download the "
                              "checkpoint") from None


def check_report_fits(path: Path, report: ConversionReport, cls, config, tensors: dict[str, tuple[str, tuple]],
                      stock: bool, kwargs: dict | None = None) -> None:
    """Before any memory is allocated: the report's structure, replayed on the model config.json builds on
    the meta device (`cls(config, **kwargs)`), must name that model's modules, and its dtype and shapes
    must be those of the weights (`tensors`: {name: (safetensors dtype, shape)} from the headers), every
    tensor the model needs present (tied ones aside). ReportSchemaError otherwise."""
    meta = _on_meta(cls, config, kwargs)
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
        tied = set(getattr(meta, "all_tied_weights_keys", {}) or {})
        missing = [k for k in meta.state_dict() if k not in tensors and k not in tied]
        if missing:  # from_pretrained would fill them with random values
            raise ReportSchemaError(f"{REPORT_FILE}: the weights in {path} lack tensors the {cls.__name__} that "
                                    f"config.json builds needs: {missing[:3]}; the report, config and weights do "
                                    "not belong together")
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
    Also used by block-wise verification, which builds the model without weights. The constructor
    keywords the weights imply (`init_kwargs`) are `inspect_converted_kwargs`'s fifth value."""
    return inspect_converted_kwargs(path)[:4]


def inspect_converted_kwargs(path: str | os.PathLike):
    """`inspect_converted` plus the keyword arguments the model class must be built with (`init_kwargs`):
    (report, config, model class, stock layout?, kwargs)."""
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
    kwargs = init_kwargs(cls, config, set(tensors))
    try:
        check_report_fits(path, report, cls, config, tensors, stock, kwargs)
    except ReportSchemaError as exc:
        raise _located(exc, path / REPORT_FILE) from None
    return report, config, cls, stock, kwargs


def normfold_weight_files(directory: ModelDir) -> list[Path]:
    """The weight files of a checkpoint in normfold's own layout (one file, or shards with an index)."""
    from ..checkpoint import weight_files

    found = weight_files(directory, NORMFOLD_INDEX, NORMFOLD_WEIGHTS)
    if found is None:
        raise CheckpointError(f"{directory.path} has neither {STOCK_WEIGHTS} nor {NORMFOLD_WEIGHTS}")
    return found[0]


ALIGN_BYTES = 64  # what torch's CPU allocator gives every fresh tensor (one AVX-512 vector, one cache line)


def realign(model: nn.Module) -> int:
    """Copy every CPU parameter and buffer whose data does not start on an ALIGN_BYTES boundary into fresh
    memory (same values, strides and Parameter objects: ties, optimizers and hooks are unaffected).
    Returns how many were copied.

    transformers 5's `from_pretrained` leaves a safetensors checkpoint's tensors at addresses ≡ 8 (mod 64)
    (measured: 149 of ViT-S/16's 151 tensors), and oneDNN's float32 GEMMs run 1–2 % slower with such a
    weight at ViT-S / GPT-2 widths (docs/performance-breakdown.md); a model built in memory, or loaded
    through `load_state_dict`, has aligned ones. A tensor that shares its storage with another is left
    where it is (copying it would break the sharing)."""
    tensors = list(model.parameters()) + list(model.buffers())
    users: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "cpu" and t.numel():
            key = t.untyped_storage().data_ptr()
            users[key] = users.get(key, 0) + 1
    moved = 0
    with torch.no_grad():
        for t in tensors:
            if t.device.type != "cpu" or not t.numel() or t.data_ptr() % ALIGN_BYTES == 0 \
                    or users[t.untyped_storage().data_ptr()] != 1:
                continue
            t.data = t.data.clone()
            moved += 1
    return moved


def load(path: str | os.PathLike, dtype: str | torch.dtype | None = None, *, fast: bool = True) -> nn.Module:
    """Load a checkpoint written by `normfold convert` / `normfold.save` with normfold's fast norms.

    Before anything is built: every file is checked by the path policy (`normfold.checkpoint.ModelDir`),
    `normfold.json` against its schema, and its structure against config.json and the weights' headers
    (`check_report_fits`); any failure is a NormfoldError. The returned model (eval mode) has the report
    at `model.normfold_report`. `fast=False` skips the runtime fast paths of `normfold.fastpath` (exact
    rewrites of how the model computes: fused add + norm blocks, padded Pre-CRMS writers, bfloat16 tied
    heads packed into one GEMM: `nn.TiedHead.pack`); the checkpoint's tensors are the same either way. Either
    way a stock checkpoint's tensors are copied to 64-byte aligned memory (`realign`: from_pretrained leaves
    them 8 bytes off, which slows float32 GEMMs by 1–2 %)."""
    path = Path(path)
    torch_dtype = _parse_dtype(dtype)
    report, config, cls, stock, kwargs = inspect_converted_kwargs(path)
    directory = ModelDir(path)
    if stock:
        if report.structure.tied_heads:  # their row means are never in a stock file: it was not written by normfold
            raise CheckpointError(f"{path}: normfold.json records tied heads (nn.TiedHead) but the weights are in the "
                                  f"stock {STOCK_WEIGHTS}, which cannot hold them; the checkpoint was altered")
        model = cls.from_pretrained(path, dtype=torch_dtype or "auto", **kwargs)
        realign(model)
        apply_structure(model, report.structure)
    else:
        from safetensors.torch import load_file

        state = {}
        for f in normfold_weight_files(directory):
            state.update(load_file(str(f)))
        # build in the stored dtype: load_state_dict copies into the existing parameters, so a float32
        # skeleton would round float64 weights before any later .to(float64)
        with default_dtype(_stored_dtype(state)):
            model = cls(config, **kwargs)
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
        from .. import fastpath

        fastpath.apply(model)  # fused blocks, padded writers, packed tied heads
    model.normfold_report = report
    return model
