"""Example inputs for image models (pixel_values at the configured size, plus the extra inputs
some heads take). Shared by the ViT, DeiT, CLIP and SigLIP adapters."""

from __future__ import annotations

import torch
from torch import nn


def vision_config(model: nn.Module):
    cfg = model.config
    return getattr(cfg, "vision_config", None) or cfg


def pixel_values(model: nn.Module, generator: torch.Generator, batch: int = 2) -> torch.Tensor:
    cfg = vision_config(model)
    size = cfg.image_size if isinstance(cfg.image_size, int) else cfg.image_size[0]
    return torch.randn(batch, cfg.num_channels, size, size, generator=generator)


def image_inputs(model: nn.Module, generator: torch.Generator) -> dict:
    inputs = {"pixel_values": pixel_values(model, generator)}
    cfg = model.config
    if type(model).__name__.endswith("ForMaskedImageModeling") and cfg.patch_size == cfg.encoder_stride:
        # exercise the mask token (a stream writer only this head has)
        n = (cfg.image_size // cfg.patch_size) ** 2
        inputs["bool_masked_pos"] = torch.rand(2, n, generator=generator) < 0.5
    return inputs
