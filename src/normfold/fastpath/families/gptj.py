"""GPT-J (transformers 5's GPTJBlock): a parallel block, `attn(ln_1(x)) + mlp(ln_1(x)) + x`, whose only add is
the last one: handed off to the next block's ln_1 / ln_f (normfold.fastpath.handoff). Fused (class swapped)
only where ln_1 is a normfold stream norm (a converted model)."""

from __future__ import annotations

from .. import handoff
from ..blocks import FusedBlock, fusable
from ..handoff import Stack


def _forward(base):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, _ = self.attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                   use_cache=use_cache, **kwargs)
        feed_forward_hidden_states = self.mlp(hidden_states)
        # attn_output + feed_forward_hidden_states + residual, the last add maybe with the next norm
        return handoff.add(self, attn_output + feed_forward_hidden_states, residual)
    return forward


BLOCKS = (
    FusedBlock("GPTJBlock", "transformers.models.gptj.modeling_gptj", (), _forward,
               {"5185d3c372aace88": "5.24.0"},
               applies=lambda block: fusable(block.ln_1), hands_off=True, entry=("ln_1",)),
)
STACKS = (
    Stack("GPTJModel", "transformers.models.gptj.modeling_gptj", "h", "ln_f"),
)
