"""Example inputs built from a model's config, for models normfold has no adapter for: token ids for
text models, pixel values at the configured size for vision models, log-mel features for audio models
(keyed by `main_input_name`, the transformers convention). `normfold.adapters.example_inputs` is the
one entry point: the adapter's own examples when there is one, else these."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..errors import NormfoldError
from ..forward import accepts, cast_inputs


def _ids(cfg, g, batch, seq):
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def _pixels(cfg, g, batch, seq):
    size = getattr(cfg, "image_size", 32)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return torch.randn(batch, getattr(cfg, "num_channels", 3), h, w, generator=g)


def _features(cfg, g, batch, seq):
    frames = 2 * getattr(cfg, "max_source_positions", 1500)  # Whisper's conv stem halves the frames
    return torch.randn(batch, cfg.num_mel_bins, frames, generator=g)


# Keyed by the model's main_input_name (transformers convention).
INPUT_BUILDERS = {"input_ids": _ids, "pixel_values": _pixels, "input_features": _features}


def _main_input(model: nn.Module, cfg) -> str | None:
    main = getattr(model, "main_input_name", None)
    if main is None and cfg is not None:  # not a transformers model: guess from the config
        if isinstance(getattr(cfg, "image_size", None), int) and isinstance(getattr(cfg, "num_channels", None), int):
            return "pixel_values"
        if isinstance(getattr(cfg, "vocab_size", None), int):
            return "input_ids"
    return main


def config_inputs(model: nn.Module, g: torch.Generator, seq: int = 8) -> dict:
    """Forward kwargs built from `model.config` alone (no adapter consulted): batch 2 (1 for a
    sequence classifier without a pad token), at most `seq` tokens, decoder ids for encoder-decoders.
    Raises NormfoldError when the config says nothing to build from."""
    cfg = getattr(model, "config", None)
    main = _main_input(model, cfg)
    if cfg is None or main not in INPUT_BUILDERS:
        raise NormfoldError(
            f"cannot build example inputs for {type(model).__name__}"
            + (f" (main input {main!r})" if main else "")
            + ": pass them yourself, e.g. normfold.analyze(model, inputs={'x': torch.randn(2, 8, 64)})")
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or seq
    seq = max(2, min(seq, max_pos))
    classifier = type(model).__name__.endswith("ForSequenceClassification")
    batch = 1 if classifier and getattr(cfg, "pad_token_id", None) is None else 2
    inputs = {main: INPUT_BUILDERS[main](cfg, g, batch, seq)}
    params = forward_params(model)
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = torch.randint(0, cfg.vocab_size, (batch, 4), generator=g)
    return inputs


def forward_params(model: nn.Module) -> dict:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def modality_inputs(model: nn.Module, seed: int = 0) -> dict:
    """Trace/verification inputs built from the model's config (no adapter consulted): token ids for
    text models, pixel values at the config's image size for vision models, log-mel features for audio
    models; plus a fixed `noise` for models that draw random masks in forward (ViTMAE), so the original
    and the converted model see the same mask."""
    g = torch.Generator().manual_seed(seed)
    inputs = config_inputs(model, g)
    params = forward_params(model)
    cfg = getattr(model, "config", None)
    if "noise" in params and "pixel_values" in inputs and hasattr(cfg, "mask_ratio"):
        px = inputs["pixel_values"]
        patch = getattr(cfg, "patch_size", 16)
        ph, pw = (patch, patch) if isinstance(patch, int) else tuple(patch)
        n = (px.shape[-2] // ph) * (px.shape[-1] // pw)
        inputs["noise"] = torch.rand(px.shape[0], n, generator=g)
    return inputs


def trace_inputs(model: nn.Module, inputs, dtype: torch.dtype, seed: int = 0) -> dict:
    """The inputs the analysis traces `model` on, made in one place: `inputs` (default: `modality_inputs`) as
    `run_kwargs` makes them, floating inputs in `dtype` (the model's `working_dtype`)."""
    if inputs is None:
        inputs = modality_inputs(model, seed)
    return run_kwargs(model, inputs, dtype)


def run_kwargs(model: nn.Module, inputs, dtype: torch.dtype) -> dict:
    """`inputs` (see `as_kwargs`) as the forward keyword arguments normfold.verify runs the model with: floating
    inputs in `dtype` (the model's `working_dtype`), hidden states asked for (a final norm's output is one of
    them) and no cache, unless `inputs` says otherwise."""
    kwargs = as_kwargs(model, inputs)
    if "use_cache" in forward_params(model):
        kwargs.setdefault("use_cache", False)
    if accepts(model, "output_hidden_states"):
        kwargs.setdefault("output_hidden_states", True)
    return cast_inputs(kwargs, dtype)


def as_kwargs(model: nn.Module, inputs) -> dict:
    """Accept a dict of forward kwargs, or a tensor / tuple of tensors for the first positional params."""
    if isinstance(inputs, dict):
        return dict(inputs)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, (tuple, list)):
        names = [n for n, p in forward_params(model).items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(inputs) > len(names):
            raise NormfoldError(f"{type(model).__name__}.forward takes {len(names)} positional inputs, "
                                f"got {len(inputs)}")
        return dict(zip(names, inputs))
    raise NormfoldError(f"inputs must be a dict of forward() keyword arguments or tensors, not {type(inputs).__name__}")
