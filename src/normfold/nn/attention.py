"""Hooks on the queries, keys and values an attention module hands to its attention function.

transformers 5.x attention modules compute q, k, v, apply the positions (RoPE) and update the KV cache, then
call `ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)`. A
hooked module gets its own view of the config (every attribute is the model's config, except
`_attn_implementation`, which names normfold's attention function); that function runs the module's hooks
on (q, k, v) and then the attention function the model's config names (the family's eager one for "eager").
The model's config, its masks and every other module are untouched.

- `add_qk_rotation(module, r)`: q ← q·R and k ← k·R per head after the positions (R orthogonal, head_dim ×
  head_dim, a non-persistent buffer): q·kᵀ = q·R·Rᵀ·kᵀ, so attention is unchanged (QuaRot's rotation of the
  keys for a 4-bit KV cache, for rotary families where R cannot go into the weights).
- `add_attention_hook(module, fn)`: fn(module, q, k, v) -> (q, k, v) after every hook added before
  (normfold bench quant's fake-quantized KV cache).

Families whose attention does not go through that interface (BLOOM, GPT-Neo in transformers 5.25) are refused
with a ValueError.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import Tensor, nn

NAME = "normfold_hooked"
_HOOKS = "_normfold_attention_hooks"
_R = "_normfold_qk_rotation"


class _HookedConfig:
    """The model's config as one attention module sees it: `_attn_implementation` is normfold's function,
    everything else (reads and writes) is the model's config."""

    def __init__(self, base) -> None:
        object.__setattr__(self, "_normfold_base", base)

    @property
    def _attn_implementation(self) -> str:
        return NAME

    def __getattr__(self, name):  # only for names not found on the proxy itself
        if name.startswith("__") or name == "_normfold_base":
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_normfold_base"), name)

    def __setattr__(self, name, value) -> None:
        setattr(object.__getattribute__(self, "_normfold_base"), name, value)


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for fn in getattr(module, _HOOKS, ()):
        query, key, value = fn(module, query, key, value)
    inner = module.config._normfold_base._attn_implementation
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return ALL_ATTENTION_FUNCTIONS.get_interface(inner, eager)(module, query, key, value, attention_mask, **kwargs)


def _install(module: nn.Module) -> list:
    hooks = getattr(module, _HOOKS, None)
    if hooks is not None:
        return hooks
    src = sys.modules.get(type(module).__module__)
    if (getattr(src, "ALL_ATTENTION_FUNCTIONS", None) is None or getattr(src, "eager_attention_forward", None) is None
            or getattr(module, "config", None) is None):
        raise ValueError(f"{type(module).__name__} does not call transformers' attention interface "
                         "(ALL_ATTENTION_FUNCTIONS) with its own config: its queries and keys cannot be hooked")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ALL_ATTENTION_FUNCTIONS.get(NAME) is not _attention:
        ALL_ATTENTION_FUNCTIONS.register(NAME, _attention)
    hooks = []
    object.__setattr__(module, _HOOKS, hooks)  # a plain attribute (deep-copied with the module)
    module.config = _HookedConfig(module.config)
    return hooks


def add_attention_hook(module: nn.Module, fn: Callable) -> None:
    """Run fn(module, q, k, v) -> (q, k, v) on what `module` hands to its attention function (after RoPE and
    the cache update; q, k, v as (batch, heads, tokens, head_dim)), after the hooks added before."""
    _install(module).append(fn)


def _rotate_qk(module: nn.Module, query: Tensor, key: Tensor, value: Tensor):
    r = getattr(module, _R)
    return query @ r.to(query.dtype), key @ r.to(key.dtype), value


def add_qk_rotation(module: nn.Module, r: Tensor) -> None:
    """q ← q·R, k ← k·R per head after the positions, before any other hook (R: head_dim × head_dim,
    orthogonal; a non-persistent buffer). Idempotent."""
    if has_qk_rotation(module):
        return
    hooks = _install(module)
    module.register_buffer(_R, r.detach().clone(), persistent=False)
    hooks.insert(0, _rotate_qk)


def has_qk_rotation(module: nn.Module) -> bool:
    return _rotate_qk in getattr(module, _HOOKS, ())


__all__ = ["add_attention_hook", "add_qk_rotation", "has_qk_rotation", "NAME"]
