"""Phi-1 / Phi-1.5 / Phi-2 (transformers `PhiModel` and every Phi head).

Parallel block from one norm: x ← x + attn(ln(x)) + mlp(ln(x)), partial rotary inside attention
(no position table). Stream: x0 = embed_tokens[ids]; input_layernorm is read by q/k/v_proj and
mlp.fc1 (all with bias); self_attn.dense and mlp.fc2 write. final_layernorm feeds the heads;
lm_head has a bias and is untied by default.

With qk_layernorm=True, q_layernorm / k_layernorm normalize each head of q_proj / k_proj's output,
not the residual stream: they stay LayerNorms (see `_QK_REASON`).
"""

from __future__ import annotations

from torch import nn

from .base import Adapter, BlockTemplate, Capabilities, ConversionPlan, KeptNorm, StreamTemplate, TinyExample

PHI_STREAM = StreamTemplate(
    name="decoder",
    sources=("embed_tokens",),
    layers="layers",
    block=BlockTemplate(
        norms=(("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1")),),
        writers=("self_attn.dense", "mlp.fc2"),
    ),
    final_norm="final_layernorm",
    final_readers=("lm_head", "score"),
)

_QK_REASON = ("qk_layernorm: normalizes each attention head of {proj}'s output, not the residual stream; "
              "that input is not zero-mean (and its affine feeds rotary/attention, not a linear layer), "
              "so it stays a LayerNorm")


def plan(model: nn.Module) -> ConversionPlan:
    stream = PHI_STREAM.expand(model)
    kept = []
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.LayerNorm) and leaf in ("q_layernorm", "k_layernorm"):
            proj = "q_proj" if leaf == "q_layernorm" else "k_proj"
            kept.append(KeptNorm(name, _QK_REASON.format(proj=proj), on_stream=False))
    notes = ["q/k LayerNorms (qk_layernorm=True) are kept: they are not on the residual stream"] if kept else []
    return ConversionPlan(adapter="phi", streams=[stream], kept=kept, notes=notes)


_COMMON = dict(vocab_size=113, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_HEADS = ("PhiModel", "PhiForCausalLM", "PhiForSequenceClassification", "PhiForTokenClassification")

ADAPTER = Adapter(
    name="phi", display_name="Phi", plan=plan,
    model_types=("phi",),
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True, parallel_residual=True),
    examples=(
        TinyExample("partial-rotary", "PhiConfig",
                    dict(_COMMON, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         partial_rotary_factor=0.5), _HEADS),
        TinyExample("qk-layernorm-eps6", "PhiConfig",
                    dict(_COMMON, hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=3,
                         partial_rotary_factor=0.25, qk_layernorm=True, layer_norm_eps=1e-6,
                         tie_word_embeddings=True), ("PhiForCausalLM", "PhiForTokenClassification")),
    ),
)
