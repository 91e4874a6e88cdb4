"""DeiT (transformers 5's DeiTLayer, a copy of ViTLayer): ViT's fused forward — the attention output's add
fused with layernorm_after, the MLP add handed off to the next layer's layernorm_before / the final
layernorm (normfold.fastpath.handoff)."""

from __future__ import annotations

from ..blocks import FusedBlock
from ..handoff import Stack
from .vit import layer_forward

BLOCKS = (
    FusedBlock("DeiTLayer", "transformers.models.deit.modeling_deit", ("layernorm_after",), layer_forward,
               {"b80c65684c27ccfd": "5.24.0"}, hands_off=True, entry=("layernorm_before",)),
)
STACKS = (
    Stack("DeiTModel", "transformers.models.deit.modeling_deit", "layers", "layernorm"),
)
