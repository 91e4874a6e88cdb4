"""GPT-NeoX (transformers 5's GPTNeoXLayer). Sequential residual (use_parallel_residual=False): the attention
output's add fused with post_attention_layernorm. Both: the layer's last add handed off to the next layer's
input_layernorm / final_layer_norm (normfold.fastpath.handoff); in a parallel-residual layer (Pythia,
GPT-NeoX-20B) that add, `mlp + attn + x`, is the only one (post_attention_layernorm reads the layer's
input and recomputes from it)."""

from __future__ import annotations

from .. import handoff
from ..blocks import FusedBlock, fusable
from ..handoff import Stack


def _applies(block) -> bool:
    return fusable(block.input_layernorm if block.use_parallel_residual else block.post_attention_layernorm)


def _forward(base):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False, layer_past=None,
                position_embeddings=None, **kwargs):
        if not _applies(self):
            return base.forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=use_cache, layer_past=layer_past,
                                position_embeddings=position_embeddings, **kwargs)
        attn_output, _ = self.attention(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                        position_ids=position_ids, layer_past=layer_past, use_cache=use_cache,
                                        position_embeddings=position_embeddings, **kwargs)
        attn_output = self.post_attention_dropout(attn_output)
        if self.use_parallel_residual:
            mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
            mlp_output = self.post_mlp_dropout(mlp_output)
            # mlp_output + attn_output + hidden_states, the last add maybe with the next norm
            return handoff.add(self, mlp_output + attn_output, hidden_states)
        # attn_output + hidden_states, then post_attention_layernorm
        attn_output, normed = self.post_attention_layernorm(attn_output, hidden_states)
        mlp_output = self.mlp(normed)
        mlp_output = self.post_mlp_dropout(mlp_output)
        return handoff.add(self, mlp_output, attn_output)  # mlp_output + attn_output
    return forward


BLOCKS = (
    FusedBlock("GPTNeoXLayer", "transformers.models.gpt_neox.modeling_gpt_neox", (), _forward,
               {"6c2ab23c0e376b11": "5.24.0"},
               applies=_applies, hands_off=True, entry=("input_layernorm",)),
)
STACKS = (
    Stack("GPTNeoXModel", "transformers.models.gpt_neox.modeling_gpt_neox", "layers", "final_layer_norm"),
)
