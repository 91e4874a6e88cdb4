"""Phi (transformers 5's PhiDecoderLayer): a parallel block, `attn(ln(x)) + mlp(ln(x)) + x` (resid_dropout on
both branches), whose only add is the last one: handed off to the next layer's input_layernorm / the final
final_layernorm (normfold.fastpath.handoff). Fused only where input_layernorm is a normfold stream norm."""

from __future__ import annotations

from .. import handoff
from ..blocks import FusedBlock, fusable
from ..handoff import Stack


def _forward(base):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_outputs, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                         position_ids=position_ids, cache=cache, use_cache=use_cache,
                                         position_embeddings=position_embeddings, **kwargs)
        attn_outputs = self.resid_dropout(attn_outputs)
        feed_forward_hidden_states = self.resid_dropout(self.mlp(hidden_states))
        # attn_outputs + feed_forward_hidden_states + residual, the last add maybe with the next norm
        return handoff.add(self, attn_outputs + feed_forward_hidden_states, residual)
    return forward


BLOCKS = (
    FusedBlock("PhiDecoderLayer", "transformers.models.phi.modeling_phi", (), _forward,
               {"bed7bf574631eb5c": "5.24.0"},
               applies=lambda block: fusable(block.input_layernorm), hands_off=True,
               entry=("input_layernorm",)),
)
STACKS = (
    Stack("PhiModel", "transformers.models.phi.modeling_phi", "layers", "final_layernorm"),
)
