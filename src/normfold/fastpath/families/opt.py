"""OPT (transformers 5's OPTDecoderLayer, Pre-LN: do_layer_norm_before=True): the attention output's add
fused with final_layer_norm. Post-LN layers (OPT-350m style, do_layer_norm_before=False) keep
transformers' code."""

from __future__ import annotations

from torch import nn

from ..blocks import FusedBlock, fusable
from ._cache_kwarg import renames_past_key_values


def _forward(base):
    @renames_past_key_values(base)
    def forward(self, hidden_states, attention_mask=None, cache=None, use_cache=False, position_ids=None, **kwargs):
        if not self.do_layer_norm_before or not fusable(self.final_layer_norm):
            return base.forward(self, hidden_states, attention_mask=attention_mask, cache=cache, use_cache=use_cache,
                                position_ids=position_ids, **kwargs)
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, cache=cache, position_ids=position_ids,
                                          attention_mask=attention_mask, **kwargs)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        # residual + hidden_states, then final_layer_norm (rows are normed independently: the
        # (-1, d) reshape transformers applies before the norm commutes with it)
        residual, hidden_states = self.final_layer_norm(hidden_states, residual)
        hidden_states_shape = residual.shape
        residual = residual.reshape(-1, residual.size(-1))
        hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.activation_fn(hidden_states)
        hidden_states = self.fc2(hidden_states)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = (residual + hidden_states).view(hidden_states_shape)
        return hidden_states
    return forward


BLOCKS = (
    FusedBlock("OPTDecoderLayer", "transformers.models.opt.modeling_opt", ("final_layer_norm",), _forward,
               {"bfff061b04cd9646": "5.24.0"},
               applies=lambda block: bool(block.do_layer_norm_before)),
)
