"""GPT-2 (transformers 5's GPT2Block): the attention output's add fused with ln_2; the MLP add handed off
to the next block's ln_1 / ln_f (normfold.fastpath.handoff)."""

from __future__ import annotations

from .. import handoff
from ..blocks import FusedBlock, fusable
from ..handoff import Stack


def _forward(base):
    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):
        if encoder_hidden_states is not None:  # cross-attention blocks: transformers' own code
            return base.forward(self, hidden_states, cache=cache, attention_mask=attention_mask,
                                encoder_hidden_states=encoder_hidden_states,
                                encoder_attention_mask=encoder_attention_mask, use_cache=use_cache, **kwargs)
        if not fusable(self.ln_2):  # converted back to LayerNorm since it was fused
            return base.forward(self, hidden_states, cache=cache, attention_mask=attention_mask,
                                use_cache=use_cache, **kwargs)
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, _ = self.attn(hidden_states, cache=cache, attention_mask=attention_mask, use_cache=use_cache,
                                   **kwargs)
        residual, hidden_states = self.ln_2(attn_output, residual)  # attn_output + residual, then ln_2
        return handoff.add(self, self.mlp(hidden_states), residual)  # residual + mlp, maybe with the next norm
    return forward


BLOCKS = (
    FusedBlock("GPT2Block", "transformers.models.gpt2.modeling_gpt2", ("ln_2",), _forward,
               {"a2aefcd4b720b74b": "5.24.0"}, hands_off=True, entry=("ln_1",)),
)
STACKS = (
    Stack("GPT2Model", "transformers.models.gpt2.modeling_gpt2", "h", "ln_f"),
)
