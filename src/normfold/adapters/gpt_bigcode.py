"""GPT-BigCode / SantaCoder / StarCoder (transformers `GPTBigCodeModel` and every head).

GPT-2's layout with nn.Linear instead of Conv1D, and multi-query attention: attn.c_attn is a
fused projection of width d + 2·head_dim (one shared key/value head) when multi_query=True, of
width 3d otherwise. Stream: x0 = wte[ids] + wpe[pos] (+ wte[token_type_ids]); ln_1 → attn.c_attn,
ln_2 → mlp.c_fc; attn.c_proj and mlp.c_proj write. ln_f feeds the heads; lm_head is tied to wte.
"""

from __future__ import annotations

from ..errors import UnsupportedConversionError
from .base import BlockTemplate, Capabilities, StreamTemplate, TinyExample, template_adapter

GPT_BIGCODE_STREAM = StreamTemplate(
    name="decoder",
    sources=("wte", "wpe"),
    layers="h",
    block=BlockTemplate(
        norms=(("ln_1", ("attn.c_attn",)), ("ln_2", ("mlp.c_fc",))),
        writers=("attn.c_proj", "mlp.c_proj"),
    ),
    final_norm="ln_f",
    final_readers=("lm_head", "score", "classifier"),
)


def _check(model) -> None:
    if getattr(model.config, "add_cross_attention", False):
        raise UnsupportedConversionError(
            "GPT-BigCode with add_cross_attention=True reads an external encoder stream through "
            "ln_cross_attn/crossattention; normfold's GPT-BigCode adapter does not describe that stream. "
            "Convert a decoder-only GPT-BigCode checkpoint instead.")


_COMMON = dict(vocab_size=109, n_positions=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_HEADS = ("GPTBigCodeModel", "GPTBigCodeForCausalLM", "GPTBigCodeForSequenceClassification",
          "GPTBigCodeForTokenClassification")

ADAPTER = template_adapter(
    "gpt_bigcode", "GPT-BigCode", GPT_BIGCODE_STREAM,
    model_types=("gpt_bigcode",),
    check=_check,
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
