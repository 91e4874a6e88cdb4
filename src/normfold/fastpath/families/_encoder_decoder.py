"""Pre-LN encoder-decoder layers written alike in transformers 5 (WhisperEncoderLayer / WhisperDecoderLayer,
MBartEncoderLayer / MBartDecoderLayer): every residual add that a norm of the same layer reads is fused
with that norm. Encoder: self-attention's add with final_layer_norm. Decoder: self-attention's add with
encoder_attn_layer_norm (encoder states given) or final_layer_norm (none: a decoder-only use such as
WhisperForCausalLM / MBartForCausalLM), cross-attention's add with final_layer_norm. The MLP's add
stays (it is the layer's output)."""

from __future__ import annotations

import torch
from torch import nn

from ..blocks import fusable
from ._cache_kwarg import renames_past_key_values

def encoder_forward(base):
    def forward(self, hidden_states, attention_mask, **kwargs):
        if not fusable(self.final_layer_norm):
            return base.forward(self, hidden_states, attention_mask, **kwargs)
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        residual, hidden_states = self.final_layer_norm(hidden_states, residual)  # residual + ..., then the norm
        hidden_states = self.activation_fn(self.fc1(hidden_states))
        hidden_states = nn.functional.dropout(hidden_states, p=self.activation_dropout, training=self.training)
        hidden_states = self.fc2(hidden_states)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        if hidden_states.dtype == torch.float16:
            clamp_value = torch.finfo(hidden_states.dtype).max - 1000
            hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)
        return hidden_states
    return forward


def decoder_forward(base):
    @renames_past_key_values(base)
    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                cache=None, use_cache=True, **kwargs):
        cross = encoder_hidden_states is not None
        if not fusable(self.final_layer_norm) or (cross and not fusable(self.encoder_attn_layer_norm)):
            return base.forward(self, hidden_states, attention_mask=attention_mask,
                                encoder_hidden_states=encoder_hidden_states,
                                encoder_attention_mask=encoder_attention_mask, cache=cache, use_cache=use_cache,
                                **kwargs)
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, cache=cache, attention_mask=attention_mask,
                                          **kwargs)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        if cross:
            # residual + self-attention, then encoder_attn_layer_norm
            residual, hidden_states = self.encoder_attn_layer_norm(hidden_states, residual)
            hidden_states, _ = self.encoder_attn(hidden_states=hidden_states, key_value_states=encoder_hidden_states,
                                                 attention_mask=encoder_attention_mask, cache=cache, **kwargs)
            hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        # residual + (cross- or self-) attention, then final_layer_norm
        residual, hidden_states = self.final_layer_norm(hidden_states, residual)
        hidden_states = self.activation_fn(self.fc1(hidden_states))
        hidden_states = nn.functional.dropout(hidden_states, p=self.activation_dropout, training=self.training)
        hidden_states = self.fc2(hidden_states)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        return hidden_states
    return forward
