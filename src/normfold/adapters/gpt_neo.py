"""GPT-Neo (transformers `GPTNeoModel` and every GPT-Neo head).

Stream: x0 = wte[ids] + wpe[pos] (+ wte[token_type_ids]); per block, ln_1 → the attention's
q/k/v projections (nn.Linear without bias) and ln_2 → mlp.c_fc read it; attn.attention.out_proj
and mlp.c_proj write to it. Local and global attention layers have the same residual layout.
ln_f feeds the model output and the heads; lm_head is tied to wte (centring wte unties it).

The q/k/v projections have no bias, so ln_1's β cannot be folded into them: ln_1 becomes an
RMSNorm that keeps its affine (pass allow_new_bias=True to fold it and grow biases instead).
"""

from __future__ import annotations

from .base import BlockTemplate, Capabilities, StreamTemplate, TinyExample, template_adapter

HEAD_READERS = ("lm_head", "score", "classifier", "qa_outputs")

GPT_NEO_STREAM = StreamTemplate(
    name="decoder",
    sources=("wte", "wpe"),
    layers="h",
    block=BlockTemplate(
        norms=(("ln_1", ("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj")),
               ("ln_2", ("mlp.c_fc",))),
        writers=("attn.attention.out_proj", "mlp.c_proj"),
    ),
    final_norm="ln_f",
    final_readers=HEAD_READERS,
)

_COMMON = dict(vocab_size=101, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_HEADS = ("GPTNeoModel", "GPTNeoForCausalLM", "GPTNeoForSequenceClassification", "GPTNeoForTokenClassification",
          "GPTNeoForQuestionAnswering")

ADAPTER = template_adapter(
    "gpt_neo", "GPT-Neo", GPT_NEO_STREAM,
    model_types=("gpt_neo",),
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True),
    examples=(
        # local attention with a window shorter than the test sequence, so both layer kinds matter
        TinyExample("global-local-tied", "GPTNeoConfig",
                    dict(_COMMON, hidden_size=24, num_layers=2, num_heads=3, attention_types=[[["global", "local"], 1]],
                         window_size=5), _HEADS),
        TinyExample("local-untied-eps6", "GPTNeoConfig",
                    dict(_COMMON, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48,
                         attention_types=[[["local"], 3]], window_size=4, layer_norm_epsilon=1e-6,
                         tie_word_embeddings=False), ("GPTNeoForCausalLM", "GPTNeoForSequenceClassification")),
    ),
)
