"""Falcon (transformers 5's FalconDecoderLayer; two copies: up to 5.24 the layer takes `alibi` and passes it to
the attention, from 5.25 the attention builds it). Sequential block (parallel_attn=False,
new_decoder_architecture=False, the RW style): the attention output's `dropout_add` onto the residual fused
with post_attention_layernorm. Every block: the last `dropout_add` handed off to the next block's first norm
(input_layernorm, or ln_attn in the new decoder architecture with two norms) / ln_f
(normfold.fastpath.handoff); in parallel blocks (Falcon-7B's parallel_attn, Falcon-40B's new decoder
architecture) that add is the only one. ln_mlp, where present, reads the block's input and recomputes."""

from __future__ import annotations

from torch.nn import functional as F

from .. import handoff
from ..blocks import FusedBlock, fusable
from ..handoff import Stack


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


def _fused(self, hidden_states, attention_mask, position_ids, layer_past, use_cache, output_attentions,
           position_embeddings, **alibi):
    """transformers' FalconDecoderLayer.forward with the adds fused; `alibi` ({} or {"alibi": tensor}) is passed
    to the attention as the release's own layer does."""
    cfg = self.config
    residual = hidden_states
    if _two_norms(cfg):
        attention_layernorm_out = self.ln_attn(hidden_states)
        mlp_layernorm_out = self.ln_mlp(hidden_states)
    else:
        attention_layernorm_out = self.input_layernorm(hidden_states)
    attention_output, attn_weights = self.self_attention(
        attention_layernorm_out, layer_past=layer_past, attention_mask=attention_mask, position_ids=position_ids,
        use_cache=use_cache, output_attentions=output_attentions, position_embeddings=position_embeddings, **alibi)
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


def _forward_with_alibi(base):  # transformers <= 5.24
    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        if not _applies(self):
            return base.forward(self, hidden_states, alibi, attention_mask, position_ids=position_ids,
                                layer_past=layer_past, use_cache=use_cache, output_attentions=output_attentions,
                                position_embeddings=position_embeddings, **kwargs)
        return _fused(self, hidden_states, attention_mask, position_ids, layer_past, use_cache, output_attentions,
                      position_embeddings, alibi=alibi)
    return forward


def _forward(base):  # transformers >= 5.25
    def forward(self, hidden_states, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        if not _applies(self):
            return base.forward(self, hidden_states, attention_mask, position_ids=position_ids, layer_past=layer_past,
                                use_cache=use_cache, output_attentions=output_attentions,
                                position_embeddings=position_embeddings, **kwargs)
        return _fused(self, hidden_states, attention_mask, position_ids, layer_past, use_cache, output_attentions,
                      position_embeddings)
    return forward


_MODULE = "transformers.models.falcon.modeling_falcon"
BLOCKS = tuple(FusedBlock("FalconDecoderLayer", _MODULE, (), _factory, _sources, applies=_applies, hands_off=True,
                          entry=("ln_attn", "input_layernorm"))
               for _factory, _sources in ((_forward_with_alibi, {"4f6896c9681165e2": "5.24.0"}),
                                          (_forward, {"a59d3db40fc7c790": "5.25.0"})))
STACKS = (Stack("FalconModel", _MODULE, "h", "ln_f"),)
