"""Falcon (transformers 5's FalconDecoderLayer). Sequential block (parallel_attn=False,
new_decoder_architecture=False, the RW style): the attention output's `dropout_add` onto the residual fused
with post_attention_layernorm. Every block: the last `dropout_add` handed off to the next block's first norm
(input_layernorm, or ln_attn in the new decoder architecture with two norms) / ln_f
(normfold.fastpath.handoff); in parallel blocks (Falcon-7B's parallel_attn, Falcon-40B's new decoder
architecture) that add is the only one. ln_mlp, where present, reads the block's input and recomputes."""

from __future__ import annotations

from torch.nn import functional as F

from .. import handoff
from ..blocks import FusedBlock, fusable, register
from ..handoff import Stack, register_stack


def _sequential(block) -> bool:
    cfg = block.config
    return not cfg.parallel_attn and not cfg.new_decoder_architecture


def _two_norms(cfg) -> bool:
    return cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2


def _applies(block) -> bool:
    cfg = block.config
    if _sequential(block):
        return fusable(block.post_attention_layernorm)
    if _two_norms(cfg):
        return fusable(block.ln_attn) and fusable(block.ln_mlp)
    return cfg.parallel_attn and fusable(block.input_layernorm)  # one norm read by attention and MLP


def _forward(base):
    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        if not _applies(self):
            return base.forward(self, hidden_states, alibi, attention_mask, position_ids=position_ids,
                                layer_past=layer_past, use_cache=use_cache, output_attentions=output_attentions,
                                position_embeddings=position_embeddings, **kwargs)
        cfg = self.config
        residual = hidden_states
        if _two_norms(cfg):
            attention_layernorm_out = self.ln_attn(hidden_states)
            mlp_layernorm_out = self.ln_mlp(hidden_states)
        else:
            attention_layernorm_out = self.input_layernorm(hidden_states)
        attention_output, attn_weights = self.self_attention(
            attention_layernorm_out, layer_past=layer_past, attention_mask=attention_mask, position_ids=position_ids,
            alibi=alibi, use_cache=use_cache, output_attentions=output_attentions,
            position_embeddings=position_embeddings)
        if _sequential(self):
            # dropout_add(attention_output, residual, ...) is `residual + dropout(attention_output)`: the add
            # runs inside post_attention_layernorm
            attention_output = F.dropout(attention_output, p=cfg.attention_dropout, training=self.training)
            residual, mlp_layernorm_out = self.post_attention_layernorm(attention_output, residual)
            mlp_output = self.mlp(mlp_layernorm_out)
        else:
            if not _two_norms(cfg):
                mlp_layernorm_out = attention_layernorm_out
            mlp_output = self.mlp(mlp_layernorm_out)
            mlp_output += attention_output
        # dropout_add(mlp_output, residual, ...): residual + dropout(mlp_output), maybe with the next norm
        output = handoff.add(self, F.dropout(mlp_output, p=cfg.hidden_dropout, training=self.training), residual)
        return output, attn_weights
    return forward


register(FusedBlock("FalconDecoderLayer", "transformers.models.falcon.modeling_falcon", (), _forward,
                    ("self", "hidden_states", "alibi", "attention_mask", "position_ids", "layer_past",
                     "use_cache", "output_attentions", "position_embeddings", "kwargs"),
                    applies=_applies, hands_off=True, entry=("ln_attn", "input_layernorm")))
register_stack(Stack("FalconModel", "transformers.models.falcon.modeling_falcon", "h", "ln_f"))
