"""BLOOM (transformers 5's BloomBlock): the attention output's add fused with post_attention_layernorm.

BloomAttention adds the residual itself (its last line is `dropout_add(output, residual, ...)`, i.e.
`residual + dropout(output)`). The fused block passes it `_NO_RESIDUAL`, an object whose `+` returns
the other operand unchanged, so the attention returns its dropped-out output itself (the very tensor,
no extra pass), and post_attention_layernorm adds the real residual in its fused kernel: the same sum
as transformers', computed once. Blocks with apply_residual_connection_post_layernorm keep transformers'
code (normfold keeps their norms LayerNorm anyway), and so does torch.compile (dynamo cannot trace the
object's `+`: transformers' add and the norm are left to inductor); torch.export (non-strict) traces
the fused form."""

from __future__ import annotations

import torch

from ..blocks import FusedBlock, fusable


class _NoResidual:
    """`_NO_RESIDUAL + t` and `t + _NO_RESIDUAL` are `t` (BloomAttention's residual argument)."""

    def __add__(self, other):
        return other

    __radd__ = __add__

    def __repr__(self):
        return "normfold.fastpath.families.bloom._NO_RESIDUAL"


_NO_RESIDUAL = _NoResidual()

def _applies(block) -> bool:
    """Pre-LN residual (the stream, not the norm's output). The attention's code (it adds the residual it is
    given) is watched with the block's: `sources` covers BloomAttention.forward too."""
    return not block.apply_residual_connection_post_layernorm


def _forward(base):
    def forward(self, hidden_states, alibi, attention_mask, layer_past=None, use_cache=False, output_attentions=False,
                **kwargs):
        if self.apply_residual_connection_post_layernorm or not fusable(self.post_attention_layernorm) \
                or torch.compiler.is_compiling():  # dynamo cannot trace `_NO_RESIDUAL + tensor`
            return base.forward(self, hidden_states, alibi, attention_mask, layer_past=layer_past, use_cache=use_cache,
                                output_attentions=output_attentions, **kwargs)
        layernorm_output = self.input_layernorm(hidden_states)
        residual = hidden_states
        attention_output, attn_weights = self.self_attention(
            layernorm_output, _NO_RESIDUAL, layer_past=layer_past, attention_mask=attention_mask, alibi=alibi,
            use_cache=use_cache, output_attentions=output_attentions)
        # attention_output + residual (the add BloomAttention would have done), then post_attention_layernorm
        residual, layernorm_output = self.post_attention_layernorm(attention_output, residual)
        output = self.mlp(layernorm_output, residual)
        return output, attn_weights
    return forward


BLOCKS = (
    FusedBlock("BloomBlock", "transformers.models.bloom.modeling_bloom", ("post_attention_layernorm",), _forward,
               sources={"e2a44ac3903265d3": "5.24.0"},
               watches=("BloomBlock.forward", "BloomAttention.forward"), applies=_applies),
)
