"""Online Hadamard rotation of a linear module's input (QuaRot's rotation before the MLP down-projection).

`add_input_hadamard(module)` makes the module see x·H_n/√n instead of x (a forward pre-hook running
`normfold.ops.hadamard.fwht`, plain aten ops, so the model still exports); the caller rotates the
module's weight along its input axis by the same matrix, W ← W·H_n/√n in torch's (out, in) layout, so
the output is unchanged: x·H·Hᵀ·Wᵀ = x·Wᵀ. State-dict keys stay the stock model's (the Hadamard core is a
non-persistent buffer rebuilt from the width).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.hadamard import fwht_fast, hadamard_core, hadamard_factor

_MARK = "_normfold_hadamard_handle"
_CORE = "_normfold_hadamard_core"


def _rotate_input(module: nn.Module, args):
    x = args[0]
    core = getattr(module, _CORE, None)
    return (fwht_fast(x, None if core is None else core.to(x.dtype)), *args[1:])


def add_input_hadamard(module: nn.Module, width: int) -> None:
    """Rotate `module`'s first input (last axis, `width` wide) by H_width/√width on every call.
    Idempotent. Raises ValueError when `width` has no Hadamard construction."""
    f = hadamard_factor(width)
    if f is None:
        raise ValueError(f"no Hadamard construction for width {width}")
    if getattr(module, _MARK, None) is not None:
        return
    m, _ = f
    ref = next(iter(module.parameters()), None)
    dtype = ref.dtype if ref is not None else torch.float32
    core = None if m == 1 else hadamard_core(m).to(dtype)
    if core is not None:
        module.register_buffer(_CORE, core, persistent=False)
    setattr(module, _MARK, module.register_forward_pre_hook(_rotate_input))


def has_input_hadamard(module: nn.Module) -> bool:
    return getattr(module, _MARK, None) is not None


__all__ = ["add_input_hadamard", "has_input_hadamard", "add_output_rotation", "add_input_rotation"]


# ---- explicit stream rotations (x ← x·Q at a point where the stream is not written by linear maps) ----------

_OUT_MARK = "_normfold_rotation_out_handle"
_IN_MARK = "_normfold_rotation_in_handle"
_Q_OUT = "_normfold_rotation_q_out"
_Q_IN = "_normfold_rotation_q_in"


def _rotate_output(module: nn.Module, args, output):
    q = getattr(module, _Q_OUT)
    return output @ q.to(output.dtype)


def _rotate_stream_input(module: nn.Module, args, kwargs):
    q = getattr(module, _Q_IN)
    if args and isinstance(args[0], Tensor):
        return (args[0] @ q.to(args[0].dtype), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        x = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": x @ q.to(x.dtype)}
    raise TypeError(f"normfold: cannot find the stream input of {type(module).__name__} to rotate "
                    "(expected a tensor as first argument or as hidden_states=)")


def add_output_rotation(module: nn.Module, q: Tensor) -> None:
    """`module`'s output becomes output·Q (Q: d×d, a non-persistent buffer). Idempotent."""
    if getattr(module, _OUT_MARK, None) is None:
        module.register_buffer(_Q_OUT, q.detach().clone(), persistent=False)
        setattr(module, _OUT_MARK, module.register_forward_hook(_rotate_output))


def add_input_rotation(module: nn.Module, q: Tensor) -> None:
    """`module`'s stream input (first argument or hidden_states=) becomes x·Q. Idempotent."""
    if getattr(module, _IN_MARK, None) is None:
        module.register_buffer(_Q_IN, q.detach().clone(), persistent=False)
        setattr(module, _IN_MARK, module.register_forward_pre_hook(_rotate_stream_input, with_kwargs=True))
