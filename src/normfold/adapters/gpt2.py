"""GPT-2 (transformers `GPT2Model` and every GPT-2 head).

Stream: x0 = wte[ids] + wpe[pos] (+ wte[token_type_ids]); per block, ln_1 → attn.c_attn and
ln_2 → mlp.c_fc read it, attn.c_proj and mlp.c_proj write to it (HF Conv1D, (in, out) layout);
ln_f feeds the model output and the heads. lm_head is tied to wte: centring wte unties them.
"""

from __future__ import annotations

from ..errors import UnsupportedConversionError
from .base import BlockTemplate, Capabilities, StreamTemplate, TinyExample, template_adapter

GPT2_STREAM = StreamTemplate(
    name="decoder",
    sources=("wte", "wpe"),
    layers="h",
    block=BlockTemplate(
        norms=(("ln_1", ("attn.c_attn",)), ("ln_2", ("mlp.c_fc",))),
        writers=("attn.c_proj", "mlp.c_proj"),
    ),
    final_norm="ln_f",
    final_readers=("lm_head", "score", "classifier", "qa_outputs", "multiple_choice_head.summary"),
)


def refuse_cross_attention(family: str):
    """check(): configs with add_cross_attention read an external encoder stream we do not describe."""

    def check(model) -> None:
        if getattr(model.config, "add_cross_attention", False):
            raise UnsupportedConversionError(
                f"{family} with add_cross_attention=True reads an external encoder stream through "
                f"ln_cross_attn/crossattention; normfold's {family} adapter does not describe that stream. "
                f"Convert a decoder-only {family} checkpoint instead.")

    return check


_COMMON = dict(vocab_size=97, n_positions=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_HEADS = ("GPT2Model", "GPT2LMHeadModel", "GPT2DoubleHeadsModel", "GPT2ForSequenceClassification",
          "GPT2ForTokenClassification", "GPT2ForQuestionAnswering")

ADAPTER = template_adapter(
    "gpt2", "GPT-2", GPT2_STREAM,
    model_types=("gpt2",),
    check=refuse_cross_attention("GPT-2"),
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True),
    examples=(
        TinyExample("tied", "GPT2Config", dict(_COMMON, n_embd=24, n_layer=2, n_head=3), _HEADS),
        TinyExample("untied-inv-idx", "GPT2Config",
                    dict(_COMMON, n_embd=32, n_layer=3, n_head=4, layer_norm_epsilon=1e-6, tie_word_embeddings=False,
                         scale_attn_by_inverse_layer_idx=True), ("GPT2LMHeadModel",)),
    ),
)
