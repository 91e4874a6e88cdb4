"""Models without weights for block-wise verification: the config's model class built with its parameters
on the meta device (normfold's recorded structure replayed), the checkpoint names of its parameters, and its
units (the blocks of each layer stack and the modules outside them)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError



@contextlib.contextmanager
def _parameters_on_meta():
    """Build modules with parameters on the meta device but real buffers (rotary tables, masks and
    position ids computed in __init__ are needed and not always in the checkpoint) — accelerate's
    `init_empty_weights(include_buffers=False)`, without depending on accelerate."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register



def placeholder(shape, dtype: torch.dtype) -> nn.Parameter:
    """A weight that holds no memory (one NaN, stride 0): anything that reads a weight outside its
    unit's hooks computes NaN and fails the check instead of silently using stale values."""
    fill = float("nan") if dtype.is_floating_point else 0
    return nn.Parameter(torch.full((), fill, dtype=dtype).expand(tuple(shape)), requires_grad=False)



def build_skeleton(directory: Path, structure=None, names: set[str] | None = None) -> nn.Module:
    """The model class of `directory`'s config, parameters on meta, normfold's structure replayed.
    `names` (the checkpoint's tensor names) picks the constructor keywords the weights imply
    (`io.init_kwargs`: a ViTModel without its pooler, ...)."""
    from ..io import init_kwargs, transformers_module, apply_structure, model_class

    transformers = transformers_module()
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{directory}: config.json could not be read: {str(exc).splitlines()[0][:300]}") from exc
    cls = model_class(config)
    kwargs = init_kwargs(cls, config, names) if names else {}
    with _parameters_on_meta():
        model = cls(config, **kwargs)
        if structure is not None:
            apply_structure(model, structure, real_rotations=True)  # Q: a real buffer, like the others
    return model.eval()



def checkpoint_keys(model: nn.Module, keys: list[str], wanted: set[str]) -> dict[str, str]:
    """Model parameter name → checkpoint key, with transformers' own renamings (legacy names such as
    ViT's `encoder.layer.0.attention.attention.query` for `layers.0.attention.q_proj`, GPT-NeoX's
    `embed_out`) and base-model prefix handling: the names `from_pretrained` would load under."""
    out = {k: k for k in keys}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # transformers 4.x: checkpoint names are the module names (up to the prefix)
        get_model_conversion_mapping = None
    prefix = getattr(model, "base_model_prefix", "") or None
    if get_model_conversion_mapping is None:
        for k in keys:
            if prefix and k.startswith(prefix + ".") and k not in wanted:
                out.setdefault(k[len(prefix) + 1:], k)
            elif prefix and f"{prefix}.{k}" in wanted:
                out.setdefault(f"{prefix}.{k}", k)
        return out
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = {k: True for k in wanted}
    for k in keys:
        new, pattern = rename_source_key(k, renamings, converters, prefix, meta)
        if pattern is None and new != k:
            out.setdefault(new, k)
        # Keys merged or split by a converter (fused qkv, stacked experts) are not loadable one by one:
        # their parameter stays unresolved and `load` names it.
    return out



def _is_stack(m: nn.Module) -> bool:
    kids = list(m.children())
    return (isinstance(m, nn.ModuleList) and len(kids) >= 1 and len({type(k) for k in kids}) == 1
            and all(any(True for _ in k.children()) and any(True for _ in k.parameters()) for k in kids))



def find_units(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """(blocks, others, resident): blocks are the children of every layer stack (ModuleList of one
    block type); others are the largest subtrees outside the stacks that own parameters (embeddings,
    norms, heads); resident are modules owning parameters directly while also containing a stack
    (loaded for the whole pass; small in practice, e.g. a logit scale). A model without a stack is
    one unit: verified correctly, but with no memory saving."""
    blocks, others, resident = [], [], []

    def has_stack(m):
        return any(_is_stack(x) for x in m.modules())

    def visit(m: nn.Module, path: str) -> None:
        if _is_stack(m):
            blocks.extend(f"{path}.{k}" if path else k for k, _ in m.named_children())
            return
        if not has_stack(m):
            if any(True for _ in m.parameters()):
                others.append(path)
            return
        if any(p is not None for p in m._parameters.values()):
            resident.append(path)
        for k, child in m.named_children():
            visit(child, f"{path}.{k}" if path else k)

    visit(model, "")
    return blocks, others, resident
