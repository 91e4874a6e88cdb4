"""GPT-Neo (transformers 5's GPTNeoBlock): the attention output's add fused with ln_2."""

from __future__ import annotations

from ..blocks import FusedBlock, fusable


def _forward(base):
    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False, output_attentions=False,
                **kwargs):
        if not fusable(self.ln_2):  # converted back to LayerNorm since it was fused
            return base.forward(self, hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                                use_cache=use_cache, output_attentions=output_attentions, **kwargs)
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, attn_weights = self.attn(hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                                              use_cache=use_cache, output_attentions=output_attentions)
        residual, hidden_states = self.ln_2(attn_output, residual)  # attn_output + residual, then ln_2
        feed_forward_hidden_states = self.mlp(hidden_states)
        hidden_states = residual + feed_forward_hidden_states
        return hidden_states, attn_weights
    return forward


BLOCKS = (
    FusedBlock("GPTNeoBlock", "transformers.models.gpt_neo.modeling_gpt_neo", ("ln_2",), _forward,
               {"195ab5579ad28c9a": "5.24.0"}),
)
