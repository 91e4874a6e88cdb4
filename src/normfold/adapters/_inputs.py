"""Example inputs for the vision, multimodal and audio families (what `Adapter.example_inputs`
returns: pixel_values at the configured size, token ids with an end-of-text token, log-mel
features of the length Whisper expects, and the extra inputs some heads take)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

BATCH = 2


def sub_config(model: nn.Module, name: str):
    """`config.<name>` of a dual-tower model, or the config itself for a single tower."""
    cfg = model.config
    return getattr(cfg, name, None) or cfg


def pixel_values(model: nn.Module, generator: torch.Generator) -> torch.Tensor:
    cfg = sub_config(model, "vision_config")
    size = cfg.image_size if isinstance(cfg.image_size, int) else cfg.image_size[0]
    return torch.randn(BATCH, cfg.num_channels, size, size, generator=generator)


def text_ids(model: nn.Module, generator: torch.Generator, seq: int = 7) -> torch.Tensor:
    """Token ids, each row ending in the end-of-text token (CLIP pools the hidden state there)."""
    cfg = sub_config(model, "text_config")
    seq = min(seq, cfg.max_position_embeddings)
    ids = torch.randint(3, cfg.vocab_size - 1, (BATCH, seq), generator=generator)
    eos = getattr(cfg, "eos_token_id", None)
    if isinstance(eos, int) and 0 <= eos < cfg.vocab_size:
        ids[:, -1] = eos
    return ids


def image_inputs(model: nn.Module, generator: torch.Generator) -> dict:
    inputs = {"pixel_values": pixel_values(model, generator)}
    cfg = model.config
    if type(model).__name__.endswith("ForMaskedImageModeling") and cfg.patch_size == cfg.encoder_stride:
        # exercise the mask token (a stream writer only this head has)
        n = (cfg.image_size // cfg.patch_size) ** 2
        inputs["bool_masked_pos"] = torch.rand(BATCH, n, generator=generator) < 0.5
    return inputs


def image_text_inputs(model: nn.Module, generator: torch.Generator) -> dict:
    """input_ids and/or pixel_values, whichever towers the model has."""
    params = inspect.signature(model.forward).parameters
    inputs = {}
    if "input_ids" in params:
        inputs["input_ids"] = text_ids(model, generator)
    if "pixel_values" in params:
        inputs["pixel_values"] = pixel_values(model, generator)
    return inputs
