"""CLIP (transformers 5's CLIPEncoderLayer, both towers) and SigLIP / SigLIP2 (SiglipEncoderLayer,
Siglip2EncoderLayer, written the same): the attention output's add fused with layer_norm2."""

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


for _name, _module, _sources in (
        ("CLIPEncoderLayer", "clip.modeling_clip", {"d53ebe9f0bf207e6": "5.24.0"}),
        ("SiglipEncoderLayer", "siglip.modeling_siglip", {"c90e00b5fe2da19f": "5.24.0"}),
        ("Siglip2EncoderLayer", "siglip2.modeling_siglip2", {"c90e00b5fe2da19f": "5.24.0"})):
    register(FusedBlock(_name, f"transformers.models.{_module}", ("layer_norm2",), _forward, _sources))
