"""Helpers for families built from sub-models ("towers"): CLIP's text and vision models, Whisper's
encoder and decoder. The same tower class sits at different paths depending on the head class
(`CLIPModel.vision_model`, `CLIPVisionModel` itself, `WhisperForConditionalGeneration.model.encoder`),
so plans find the tower by class name and expand a tower-relative `StreamTemplate` there.
Also: the shared decision for a LayerNorm sitting on the stream right after the embeddings.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .base import NormSite, StreamPlan, StreamTemplate, base_prefix, get, join


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


def embedding_norm_on_stream(model: nn.Module, stream: StreamPlan, path: str) -> str:
    """A LayerNorm sitting on the stream right after the embeddings (CLIP's pre_layrnorm, mBART's
    layernorm_embedding). Its input is zero-mean (centred writers): it becomes an RMSNorm keeping
    its affine, because its output *is* the stream. That output γ⊙n + β is zero-mean for every
    input and every weight value only when the norm has no γ: then β (if any) is centred like a
    writer; otherwise an explicit Recenter follows the norm. The test is structural, not on values
    (a γ that happens to be constant is not looked for), so the plan holds for any weights, as
    training-time reparametrization needs. Returns a note for the report."""
    ln = get(model, path)
    stream.norms.append(NormSite(path))
    if ln.weight is None:
        if getattr(ln, "bias", None) is not None:
            stream.writers.append(join(path, "bias"))
        return f"{path} has no weight: centring its bias keeps the stream zero-mean (no Recenter needed)"
    stream.recenter_after.append(path)
    return (f"{path} sits on the stream: converted to RMSNorm (its input is zero-mean), but its affine "
            "output γ⊙n + β is not zero-mean, so an explicit Recenter follows it (one O(d) op per token "
            "instead of a LayerNorm in every block); stock transformers needs no Recenter (its LayerNorms "
            "re-centre their input)")
