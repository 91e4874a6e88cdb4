"""Structural edits expressed as forward hooks, so state-dict keys stay those of the stock model."""

from __future__ import annotations

from torch import Tensor, nn

_MARK = "_normfold_recenter_handle"
_INPUT_MARK = "_normfold_input_recenter_handle"


def _recenter(x: Tensor) -> Tensor:
    # Two passes, the same in real arithmetic: where the rows' means are large against their spread (an
    # uncentred embedding table, the Recenter form of a tied table), x − mean is exact (Sterbenz) and its error
    # is the rounding of the mean, eps·|mean|, which the second pass removes (a few ulps of the result instead).
    y = x - x.mean(dim=-1, keepdim=True)
    return y - y.mean(dim=-1, keepdim=True)


def _recenter_output(module: nn.Module, args, output):
    return _recenter(output)


def add_output_recenter(module: nn.Module) -> None:
    """Recenter `module`'s output over its last dimension (an explicit Recenter after a non-linear
    stem or after a norm sitting on the stream). Idempotent; visible as `module._normfold_recenter_handle`."""
    if getattr(module, _MARK, None) is None:
        setattr(module, _MARK, module.register_forward_hook(_recenter_output))


def has_output_recenter(module: nn.Module) -> bool:
    return getattr(module, _MARK, None) is not None


def _recenter_input(module: nn.Module, args, kwargs):
    # The stream is the first positional argument (HF layers: hidden_states), or passed by name.
    if args and isinstance(args[0], Tensor):
        return (_recenter(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return args, {**kwargs, "hidden_states": _recenter(kwargs["hidden_states"])}
    raise TypeError(f"normfold: cannot find the stream input of {type(module).__name__} to recenter "
                    "(expected a tensor as first argument or as hidden_states=)")


def add_input_recenter(module: nn.Module) -> None:
    """Recenter `module`'s stream input (first argument) over its last dimension: an explicit Recenter
    where the stream is built by code that is not a module (Whisper's conv → functional GELU stem).
    Idempotent; visible as `module._normfold_input_recenter_handle`."""
    if getattr(module, _INPUT_MARK, None) is None:
        setattr(module, _INPUT_MARK, module.register_forward_pre_hook(_recenter_input, with_kwargs=True))


def has_input_recenter(module: nn.Module) -> bool:
    return getattr(module, _INPUT_MARK, None) is not None
