"""The source of a streamed conversion: a local safetensors checkpoint read as headers only (`Source`, every
file name checked by `normfold.checkpoint`'s path policy), the model class of its config built on the meta
device, and the checkpoint name of every state-dict entry (transformers' own load-time renaming)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import checkpoint, io
from ..errors import CheckpointError, NormfoldError
from . import safetensors_io as st

INDEX = io.STOCK_INDEX



class StreamUnsupportedError(NormfoldError):
    """This checkpoint or option needs the in-memory conversion (`--stream never`)."""



@dataclass
class Source:
    path: Path
    shards: list[Path]  # in index order
    tensors: dict[str, st.TensorInfo]
    sharded: bool

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.shards)



def weight_files(source_dir: str | os.PathLike) -> tuple[list[Path], bool] | None:
    """The safetensors weight files of a model directory (and whether sharded), or None; every name
    checked by the path policy (`normfold.checkpoint`)."""
    return checkpoint.weight_files(checkpoint.ModelDir(source_dir), INDEX, io.STOCK_WEIGHTS)



def open_source(source_dir: str | os.PathLike) -> Source:
    found = weight_files(source_dir)
    if found is None:
        raise StreamUnsupportedError(f"{source_dir} has no safetensors weights (model.safetensors or {INDEX}); "
                                     "streaming reads only safetensors; convert it in memory (--stream never)")
    shards, sharded = found
    tensors: dict[str, st.TensorInfo] = {}
    for shard in shards:
        infos, _ = st.read_header(shard)
        tensors.update(infos)
    return Source(Path(source_dir), shards, tensors, sharded)



def checkpoint_dtype(source: Source) -> torch.dtype:
    floats = {i.dtype for i in source.tensors.values() if i.dtype in ("F64", "F32", "F16", "BF16")}
    if len(floats) != 1:
        raise StreamUnsupportedError(f"the checkpoint mixes floating dtypes ({', '.join(sorted(floats)) or 'none'}); "
                                     "streaming keeps one dtype; convert it in memory (--stream never)")
    return st.TORCH_DTYPES[floats.pop()]



def meta_model(source_dir: Path, dtype: torch.dtype, names: set[str] | None = None) -> nn.Module:
    """The model class named by the config, built on the meta device (no memory, no init), tied as
    from_pretrained ties it, in eval mode; with the constructor keywords the tensor `names` imply
    (`io.init_kwargs`)."""
    transformers = io.transformers_module()
    config = transformers.AutoConfig.from_pretrained(source_dir)  # never trust_remote_code
    cls = io.model_class(config)
    kwargs = io.init_kwargs(cls, config, names) if names else {}
    with torch.device("meta"):
        model = cls(config, **kwargs)
    model = model.to(dtype)
    model.config.dtype = dtype  # as from_pretrained(dtype="auto") records it
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()



def _renamed(model: nn.Module, source: Source) -> dict[str, str]:
    """{model name: checkpoint name} by transformers' own load-time key renaming (legacy names such as
    GPT-NeoX's embed_out, the base-model prefix added or stripped). A key that transformers converts
    (merges, splits) rather than renames cannot be copied tensor by tensor: refused."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # older transformers: names are used as stored
        return {k: k for k in source.tensors}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out: dict[str, str] = {}
    for key in source.tensors:
        new, converter = rename_source_key(key, renamings, converters, prefix, meta)
        if converter is not None:
            raise StreamUnsupportedError(
                f"transformers converts checkpoint tensor {key} on load (pattern {converter}), not just renames it; "
                "streaming copies tensors one by one; convert this model in memory (--stream never)")
        out.setdefault(new, key)
    return out



def source_names(model: nn.Module, source: Source) -> dict[str, str]:
    """{state-dict name: checkpoint tensor name}; tied aliases map to whichever alias is stored."""
    renamed = _renamed(model, source)
    groups: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    out = {}
    for names in groups.values():
        found = next((renamed[n] for n in names if n in renamed), None)
        if found is None:
            raise StreamUnsupportedError(
                f"the checkpoint has no tensor for {names[0]} of {type(model).__name__}; its tensor names differ "
                "from the model class's (transformers may rename them on load); convert it in memory "
                "(--stream never)")
        info = source.tensors[found]
        for name in names:
            if tuple(state[name].shape) != info.shape:
                raise CheckpointError(
                    f"{found} has shape {list(info.shape)} in the checkpoint but the config gives "
                    f"{names[0]} shape {list(state[name].shape)}; the weights do not belong to this config")
            if st.TORCH_DTYPES.get(info.dtype) != state[name].dtype:
                raise StreamUnsupportedError(
                    f"{found} is stored as {info.dtype} but the model holds it as {state[name].dtype}; "
                    "convert it in memory (--stream never)")
            out[name] = found
    return out
