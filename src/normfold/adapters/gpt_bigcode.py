"""GPT-BigCode / SantaCoder / StarCoder (transformers `GPTBigCodeModel` and every head).

GPT-2's layout with nn.Linear instead of Conv1D, and multi-query attention: attn.c_attn is a
fused projection of width d + 2·head_dim (one shared key/value head) when multi_query=True, of
width 3d otherwise. Stream: x0 = wte[ids] + wpe[pos] (+ wte[token_type_ids]); ln_1 → attn.c_attn,
ln_2 → mlp.c_fc; attn.c_proj and mlp.c_proj write. ln_f feeds the heads; lm_head is tied to wte.
"""

from __future__ import annotations

from .base import Capabilities, TinyExample, template_adapter
from .gpt2 import GPT2_STREAM, refuse_cross_attention

# GPT-2's module paths exactly (layouts come from the module types, so Linear vs Conv1D needs nothing).
GPT_BIGCODE_STREAM = GPT2_STREAM


_COMMON = dict(vocab_size=109, n_positions=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_HEADS = ("GPTBigCodeModel", "GPTBigCodeForCausalLM", "GPTBigCodeForSequenceClassification",
          "GPTBigCodeForTokenClassification")

ADAPTER = template_adapter(
    "gpt_bigcode", "GPT-BigCode", GPT_BIGCODE_STREAM,
    model_types=("gpt_bigcode",),
    check=refuse_cross_attention("GPT-BigCode"),
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True),
    examples=(
        TinyExample("mqa-tied", "GPTBigCodeConfig", dict(_COMMON, n_embd=24, n_layer=2, n_head=4, multi_query=True),
                    _HEADS),
        TinyExample("mha-untied-eps6", "GPTBigCodeConfig",
                    dict(_COMMON, n_embd=32, n_layer=3, n_head=4, n_inner=40, multi_query=False,
                         layer_norm_epsilon=1e-6, tie_word_embeddings=False),
                    ("GPTBigCodeForCausalLM", "GPTBigCodeForTokenClassification")),
    ),
)
