"""CLIP (transformers 5's CLIPEncoderLayer, both towers): the attention output's add fused with layer_norm2."""

from __future__ import annotations

from ..blocks import FusedBlock, fusable, register


def _forward(base):
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


register(FusedBlock("CLIPEncoderLayer", "transformers.models.clip.modeling_clip", ("layer_norm2",), _forward,
                    ("self", "hidden_states", "attention_mask", "kwargs")))
