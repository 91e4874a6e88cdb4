"""GPT-NeoX (transformers 5's GPTNeoXLayer) with use_parallel_residual=False: the attention output's add
fused with post_attention_layernorm. Parallel-residual layers (Pythia, GPT-NeoX-20B) are not fused here:
their post_attention_layernorm reads the block's input, not a sum (`applies` leaves them alone)."""

from __future__ import annotations

from ..blocks import FusedBlock, fusable, register


def _forward(base):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False, layer_past=None,
                position_embeddings=None, **kwargs):
        if self.use_parallel_residual or not fusable(self.post_attention_layernorm):
            return base.forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=use_cache, layer_past=layer_past,
                                position_embeddings=position_embeddings, **kwargs)
        attn_output, _ = self.attention(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                        position_ids=position_ids, layer_past=layer_past, use_cache=use_cache,
                                        position_embeddings=position_embeddings, **kwargs)
        attn_output = self.post_attention_dropout(attn_output)
        # attn_output + hidden_states, then post_attention_layernorm
        attn_output, normed = self.post_attention_layernorm(attn_output, hidden_states)
        mlp_output = self.mlp(normed)
        mlp_output = self.post_mlp_dropout(mlp_output)
        hidden_states = mlp_output + attn_output
        return hidden_states
    return forward


register(FusedBlock("GPTNeoXLayer", "transformers.models.gpt_neox.modeling_gpt_neox", ("post_attention_layernorm",),
                    _forward, ("self", "hidden_states", "attention_mask", "position_ids", "use_cache", "layer_past",
                               "position_embeddings", "kwargs"),
                    applies=lambda block: not block.use_parallel_residual))
