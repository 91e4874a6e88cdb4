"""CLIP (transformers 5's CLIPEncoderLayer, both towers): the attention output's add fused with layer_norm2.
SigLIP and SigLIP2 write their encoder layers the same way and reuse `encoder_layer_forward`."""

from __future__ import annotations

from ..blocks import FusedBlock, fusable


def encoder_layer_forward(base):
    def forward(self, hidden_states, attention_mask, **kwargs):
        if not fusable(self.layer_norm2):
            return base.forward(self, hidden_states, attention_mask, **kwargs)
        residual = hidden_states
        hidden_states = self.layer_norm1(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        residual, hidden_states = self.layer_norm2(hidden_states, residual)  # residual + ..., then layer_norm2
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states
    return forward


BLOCKS = (FusedBlock("CLIPEncoderLayer", "transformers.models.clip.modeling_clip", ("layer_norm2",),
                     encoder_layer_forward, {"d53ebe9f0bf207e6": "5.24.0"}),)
