"""GPT-BigCode (transformers 5's GPTBigCodeBlock, StarCoder): the attention output's add fused with ln_2.
Blocks given encoder states (add_cross_attention) keep transformers' code."""

from __future__ import annotations

from ..blocks import FusedBlock, fusable


def _forward(base):
    def forward(self, hidden_states, encoder_hidden_states=None, layer_past=None, attention_mask=None,
                encoder_attention_mask=None, use_cache=False, output_attentions=False, **kwargs):
        if encoder_hidden_states is not None or not fusable(self.ln_2):
            return base.forward(self, hidden_states, encoder_hidden_states=encoder_hidden_states,
                                layer_past=layer_past, attention_mask=attention_mask,
                                encoder_attention_mask=encoder_attention_mask, use_cache=use_cache,
                                output_attentions=output_attentions, **kwargs)
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, _ = self.attn(hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                                   use_cache=use_cache, output_attentions=output_attentions, **kwargs)
        residual, hidden_states = self.ln_2(attn_output, residual)  # attn_output + residual, then ln_2
        feed_forward_hidden_states = self.mlp(hidden_states)
        hidden_states = residual + feed_forward_hidden_states
        return hidden_states
    return forward


BLOCKS = (
    FusedBlock("GPTBigCodeBlock", "transformers.models.gpt_bigcode.modeling_gpt_bigcode", ("ln_2",), _forward,
               {"7370ebfa908377a1": "5.24.0"}),
)
