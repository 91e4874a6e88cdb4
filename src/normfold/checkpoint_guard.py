"""Inspect a model directory before anything loads it: refuse broken or hostile files cleanly.

Everything here reads bytes and JSON only (no torch deserialization, no transformers, no code from the
checkpoint), so a truncated file, an absurd header or a pickle with code in it ends in a one-paragraph
`CheckpointError` instead of a traceback from deep inside a loader.

    info = inspect_checkpoint(model_dir)          # validates every weight file's header
    check_shapes(model_dir, info, model_on_meta)   # header shapes vs what the config builds
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import ModelDir, weight_files
from .checkpoint.safetensors_format import WHAT_TO_DO, read_header
from .errors import CheckpointError, NormfoldError

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SINGLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"

_WHAT_TO_DO = WHAT_TO_DO


class RemoteCodeError(NormfoldError):
    """The model's config asks for code shipped with the checkpoint (trust_remote_code)."""


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str


@dataclass
class CheckpointInfo:
    """What a model directory holds, validated."""

    directory: Path
    format: str  # "safetensors" | "pickle"
    files: list[Path] = field(default_factory=list)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)  # safetensors only (from headers)

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    @property
    def largest_file_bytes(self) -> int:
        return max((f.stat().st_size for f in self.files), default=0)


def inspect_checkpoint(directory: str | os.PathLike) -> CheckpointInfo:
    """Find the weight files of an HF model directory and validate them without loading them.

    Every file normfold or transformers reads from the directory (config, weights, shard index, report,
    tokenizer files) is first checked by the path policy (`normfold.checkpoint.ModelDir`): one that
    resolves outside the directory (or outside a Hugging Face cache snapshot's blobs/) is refused."""
    model_dir = ModelDir(directory)
    model_dir.check_all()
    directory = model_dir.path
    found = weight_files(model_dir, SAFETENSORS_INDEX, SAFETENSORS_SINGLE)
    if found is not None:
        files = found[0]
        info = CheckpointInfo(directory, "safetensors", files)
        for f in files:
            for entry in read_safetensors_header(f):
                info.tensors[entry.name] = entry
        return info
    found = weight_files(model_dir, PICKLE_INDEX, PICKLE_SINGLE)
    if found is not None:
        files = found[0]
        for f in files:
            check_pickle_tensors_only(f)
        return CheckpointInfo(directory, "pickle", files)
    raise CheckpointError(f"{directory} could not be loaded as a Hugging Face model: it has no weights (expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, "
                          f"{PICKLE_SINGLE} or {PICKLE_INDEX} beside config.json)")


def read_safetensors_header(path: Path) -> list[TensorEntry]:
    """Validate one safetensors file's header against its size (`checkpoint.safetensors_format.read_header`);
    return its tensors."""
    infos, _ = read_header(path)
    return [TensorEntry(name, i.dtype, i.shape, path.name) for name, i in infos.items()]


def check_pickle_tensors_only(path: Path) -> None:
    """A pickle checkpoint is read only with torch.load(weights_only=True): tensors and plain containers.
    Anything else (code, arbitrary objects) is refused; nothing in it is executed."""
    import pickle

    import torch

    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty, not a PyTorch checkpoint: {_WHAT_TO_DO}")
    try:
        state = torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
        first = next((x for x in lines if "GLOBAL" in x or "Unsupported" in x), lines[0] if lines else "")[:300]
        raise CheckpointError(
            f"{path} is a pickle that contains objects other than tensors ({first}); normfold loads pickle "
            f"checkpoints only with torch.load(weights_only=True) and never runs code from them. If you trust "
            f"its source, convert it to safetensors yourself; otherwise do not use it") from None
    except Exception as exc:  # truncated zip, not a pickle, ...
        raise CheckpointError(f"{path} could not be read as a PyTorch checkpoint ({type(exc).__name__}: "
                              f"{str(exc).strip()[:200]}): {_WHAT_TO_DO}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict (a mapping of names to tensors): {_WHAT_TO_DO}")


def check_remote_code(config_path: Path, trust_remote_code: bool) -> None:
    """Refuse a config that needs code from the checkpoint unless the user said --trust-remote-code."""
    config_path = ModelDir(Path(config_path).parent).file(Path(config_path).name)
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path.parent} could not be loaded as a Hugging Face model: config.json is "
                              f"not valid JSON ({exc}): {_WHAT_TO_DO}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} is not a JSON object: {_WHAT_TO_DO}")
    if trust_remote_code:
        return
    needs = []
    if config.get("auto_map"):
        needs.append(f"its config has an auto_map ({', '.join(sorted(config['auto_map']))})")
    model_type = config.get("model_type")
    if model_type is not None and not _known_model_type(model_type):
        needs.append(f"its model_type {model_type!r} is not one transformers knows")
    if needs:
        raise RemoteCodeError(
            f"{config_path.parent} needs code shipped with the checkpoint ({'; '.join(needs)}). normfold does not "
            f"run code from checkpoints unless you pass --trust-remote-code (then transformers imports the "
            f"checkpoint's Python files: only do this for a source you trust)")


def _known_model_type(model_type: str) -> bool:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:  # no transformers: load_source fails later with its own message
        return True
    return model_type in CONFIG_MAPPING


def check_shapes(info: CheckpointInfo, model) -> None:
    """Compare header shapes with the parameters the config builds (model on the meta device)."""
    if not info.tensors or model is None:
        return
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    bad = []
    for name, entry in info.tensors.items():
        want = expected.get(name)
        if want is None and prefix:
            want = expected.get(f"{prefix}.{name}") or expected.get(name.removeprefix(f"{prefix}."))
        if want is not None and want != entry.shape:
            bad.append(f"{name}: file {list(entry.shape)}, config {list(want)}")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CheckpointError(
            f"{info.directory}: weights do not match config.json (tensor shapes differ): {'; '.join(bad[:3])}{more}. The config and the "
            f"weights come from different models or versions: use the config.json published with these weights")
