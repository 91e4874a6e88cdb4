"""Helpers for families built from sub-models ("towers"): CLIP's text and vision models, Whisper's
encoder and decoder. The same tower class sits at different paths depending on the head class
(`CLIPModel.vision_model`, `CLIPVisionModel` itself, `WhisperForConditionalGeneration.model.encoder`),
so plans find the tower by class name and expand a tower-relative `StreamTemplate` there.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .base import StreamPlan, StreamTemplate, base_prefix, get, join


def module_path(model: nn.Module, *class_names: str) -> str | None:
    """Path of the first module (the root included, as '') whose class is one of `class_names`."""
    for name, module in model.named_modules():
        if type(module).__name__ in class_names:
            return name
    return None


def expand_at(template: StreamTemplate, model: nn.Module, path: str) -> StreamPlan:
    """Expand `template` (paths relative to a tower) on the tower at `path` from the model root.

    `StreamTemplate.expand` prepends the HF base-model prefix itself, so `root` is `path` made
    relative to that prefix."""
    base = base_prefix(model)
    if not base or path == base or path.startswith(base + "."):
        root = path[len(base):].lstrip(".") if base else path
    else:  # a tower outside the base model: undo the prefix expand() will add
        raise ValueError(f"tower {path!r} is not below {type(model).__name__}'s base model {base!r}")
    return replace(template, root=join(root, template.root)).expand(model)


def present(model: nn.Module, path: str) -> bool:
    """The attribute at `path` exists and is not None (HF keeps optional parts as None)."""
    try:
        return get(model, path) is not None
    except AttributeError:
        return False
