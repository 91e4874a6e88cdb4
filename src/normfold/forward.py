"""Running a model the way every check runs it: floating inputs cast to the model's dtype, hidden states
asked for where the forward accepts them, every tensor output flattened under a stable name. Base layer:
verification, analysis and the streamed checks all use it."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from .modelinfo import working_dtype

# outputs that are residual-stream states (compared after centring): fnmatch patterns
CENTERED_OUTPUTS = ("*hidden_states[[]*[]]",)


def accepts(model: nn.Module, name: str) -> bool:
    """Whether `model.forward` takes a keyword `name` (or **kwargs)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def cast_inputs(inputs: dict, dtype: torch.dtype) -> dict:
    return {k: (v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}


@torch.no_grad()
def run_model(model: nn.Module, inputs: dict) -> dict[str, Tensor]:
    """Forward `model` on `inputs` (floats cast to its dtype) and flatten every tensor output."""
    kwargs = cast_inputs(inputs, working_dtype(model))
    if accepts(model, "output_hidden_states"):
        kwargs.setdefault("output_hidden_states", True)
    if "use_cache" in getattr(inspect.signature(model.forward), "parameters", {}):
        kwargs.setdefault("use_cache", False)
    return flatten_outputs(model(**kwargs))


def flatten_outputs(out, prefix: str = "") -> dict[str, Tensor]:
    """{'logits': t, 'hidden_states[0]': t, 'vision_model_output.pooler_output': t, ...}; caches skipped."""
    flat: dict[str, Tensor] = {}
    if isinstance(out, Tensor):
        if out.is_floating_point():
            flat[prefix or "output"] = out
        return flat
    if isinstance(out, dict) or hasattr(out, "items"):
        for key, value in out.items():
            if key in ("past_key_values", "cache") or value is None:
                continue
            flat.update(flatten_outputs(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(out, (tuple, list)):
        for i, value in enumerate(out):
            flat.update(flatten_outputs(value, f"{prefix}[{i}]" if prefix else f"output[{i}]"))
    return flat
