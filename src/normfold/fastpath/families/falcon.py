"""Falcon (transformers 5's FalconDecoderLayer), the sequential block only (parallel_attn=False,
new_decoder_architecture=False, the RW style): the attention output's `dropout_add` onto the residual
fused with post_attention_layernorm. Parallel blocks (Falcon-7B / 40B, the new decoder architecture)
have no add before a norm inside the block and keep transformers' code."""

from __future__ import annotations

from torch.nn import functional as F

from ..blocks import FusedBlock, fusable, register


def _sequential(block) -> bool:
    cfg = block.config
    return not cfg.parallel_attn and not cfg.new_decoder_architecture


def _forward(base):
    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        if not _sequential(self) or not fusable(self.post_attention_layernorm):
            return base.forward(self, hidden_states, alibi, attention_mask, position_ids=position_ids,
                                layer_past=layer_past, use_cache=use_cache, output_attentions=output_attentions,
                                position_embeddings=position_embeddings, **kwargs)
        residual = hidden_states
        attention_layernorm_out = self.input_layernorm(hidden_states)
        attention_output, attn_weights = self.self_attention(
            attention_layernorm_out, layer_past=layer_past, attention_mask=attention_mask, position_ids=position_ids,
            alibi=alibi, use_cache=use_cache, output_attentions=output_attentions,
            position_embeddings=position_embeddings)
        # dropout_add(attention_output, residual, ...) is `residual + dropout(attention_output)`: the add
        # runs inside post_attention_layernorm
        attention_output = F.dropout(attention_output, p=self.config.attention_dropout, training=self.training)
        residual, mlp_layernorm_out = self.post_attention_layernorm(attention_output, residual)
        mlp_output = self.mlp(mlp_layernorm_out)
        output = residual + F.dropout(mlp_output, p=self.config.hidden_dropout, training=self.training)
        return output, attn_weights
    return forward


register(FusedBlock("FalconDecoderLayer", "transformers.models.falcon.modeling_falcon", ("post_attention_layernorm",),
                    _forward, ("self", "hidden_states", "alibi", "attention_mask", "position_ids", "layer_past",
                               "use_cache", "output_attentions", "position_embeddings", "kwargs"),
                    applies=_sequential))
