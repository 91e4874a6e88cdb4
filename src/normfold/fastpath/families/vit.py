"""ViT (transformers 5's ViTLayer): the attention output's add fused with layernorm_after; the MLP add handed
off to the next layer's layernorm_before / the final layernorm (normfold.fastpath.handoff)."""

from __future__ import annotations

from .. import handoff
from ..blocks import FusedBlock, fusable
from ..handoff import Stack


def layer_forward(base):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if not fusable(self.layernorm_after):
            return base.forward(self, hidden_states, attention_mask, **kwargs)
        residual = hidden_states
        hidden_states = self.layernorm_before(hidden_states)
        hidden_states, _ = self.attention(hidden_states, attention_mask, **kwargs)
        hidden_states = self.dropout(hidden_states)
        residual, hidden_states = self.layernorm_after(hidden_states, residual)  # + residual, then the norm
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return handoff.add(self, hidden_states, residual)
    return forward


BLOCKS = (
    FusedBlock("ViTLayer", "transformers.models.vit.modeling_vit", ("layernorm_after",), layer_forward,
               {"b80c65684c27ccfd": "5.24.0"}, hands_off=True, entry=("layernorm_before",)),
)
STACKS = (
    Stack("ViTModel", "transformers.models.vit.modeling_vit", "layers", "layernorm"),
)
