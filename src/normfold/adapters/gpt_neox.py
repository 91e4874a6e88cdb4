"""GPT-NeoX / Pythia (transformers `GPTNeoXModel` and every GPT-NeoX head).

Stream: x0 = embed_in[ids]; rotary positions act inside attention. Per layer, input_layernorm →
attention.query_key_value (fused QKV) and post_attention_layernorm → mlp.dense_h_to_4h read it;
attention.dense and mlp.dense_4h_to_h write to it. The same description covers both residual
forms: with use_parallel_residual=True post_attention_layernorm reads x (x ← x + attn + mlp),
with False it reads x + attn(...); both are sums of centred writers, hence zero-mean.
final_layer_norm feeds the heads; lm_head is untied by default (tied when tie_word_embeddings).
"""

from __future__ import annotations

from .base import BlockTemplate, Capabilities, StreamTemplate, TinyExample, template_adapter

GPT_NEOX_STREAM = StreamTemplate(
    name="decoder",
    sources=("embed_in",),
    layers="layers",
    block=BlockTemplate(
        norms=(("input_layernorm", ("attention.query_key_value",)),
               ("post_attention_layernorm", ("mlp.dense_h_to_4h",))),
        writers=("attention.dense", "mlp.dense_4h_to_h"),
    ),
    final_norm="final_layer_norm",
    final_readers=("lm_head", "score", "classifier", "qa_outputs"),
)

_COMMON = dict(vocab_size=107, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_HEADS = ("GPTNeoXModel", "GPTNeoXForCausalLM", "GPTNeoXForSequenceClassification",
          "GPTNeoXForTokenClassification", "GPTNeoXForQuestionAnswering")

ADAPTER = template_adapter(
    "gpt_neox", "GPT-NeoX / Pythia", GPT_NEOX_STREAM,
    model_types=("gpt_neox",),
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True, parallel_residual=True),
    examples=(
        TinyExample("parallel", "GPTNeoXConfig",
                    dict(_COMMON, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=48,
                         use_parallel_residual=True), _HEADS),
        TinyExample("sequential-no-bias-eps6", "GPTNeoXConfig",
                    dict(_COMMON, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=40,
                         use_parallel_residual=False, attention_bias=False, layer_norm_eps=1e-6,
                         tie_word_embeddings=True), ("GPTNeoXForCausalLM", "GPTNeoXForTokenClassification")),
    ),
)
