"""BLOOM (transformers `BloomModel` and every BLOOM head).

Stream: x0 = word_embeddings_layernorm(word_embeddings[ids]) (alibi positions act inside
attention). Per block input_layernorm → self_attention.query_key_value (fused QKV) and
post_attention_layernorm → mlp.dense_h_to_4h read it; self_attention.dense and mlp.dense_4h_to_h
write. ln_f feeds the heads; lm_head is tied to word_embeddings.

The embedding norm sits *on* the stream: x0 = γ⊙n + β, whose mean Σᵢγᵢnᵢ/d + mean(β) varies per
token unless γ is constant. Centring the table makes that norm's *input* zero-mean, not its output.
Decision: recentre x0 once, with an explicit Recenter after word_embeddings_layernorm, and convert
every block norm and ln_f. The alternative, keeping all block norms as LayerNorms because x0 is not
zero-mean, would convert nothing that matters; one centring per token at the input costs next to
nothing. The Recenter is not a stock BLOOM module, but stock transformers needs none: there every
norm is a LayerNorm again, which re-centres its input, so the checkpoint stays stock-reloadable
(normfold.load replays the Recenter for its RMSNorms).

word_embeddings_layernorm itself becomes an RMSNorm (table centred) only when its table is not
shared: centring a table tied to lm_head would untie them and add vocab×d parameters (a quarter
to a half of the smaller BLOOMs) to save one norm per token. So in BloomForCausalLM with tied
embeddings it stays a LayerNorm.

apply_residual_connection_post_layernorm=True makes the residual carry each norm's output γ⊙n+β:
no block norm or ln_f then has a zero-mean input; only the embedding norm (untied table) converts.
"""

from __future__ import annotations

from torch import nn

from .base import (
    Adapter,
    BlockTemplate,
    Capabilities,
    ConversionPlan,
    KeptNorm,
    NormSite,
    StreamPlan,
    StreamTemplate,
    TinyExample,
    base_prefix,
    get,
    join,
)

BLOOM_STREAM = StreamTemplate(
    name="decoder",
    sources=(),
    layers="h",
    block=BlockTemplate(
        norms=(("input_layernorm", ("self_attention.query_key_value",)),
               ("post_attention_layernorm", ("mlp.dense_h_to_4h",))),
        writers=("self_attention.dense", "mlp.dense_4h_to_h"),
    ),
    final_norm="ln_f",
    final_readers=("lm_head", "score", "classifier", "qa_outputs"),
)

_TIED = ("its input is the word-embedding table, which is tied to lm_head: centring the table would untie "
         "them and add vocab×hidden parameters to save one norm per token; it stays a LayerNorm (its output "
         "is recentred explicitly)")
_POST_RESIDUAL = ("apply_residual_connection_post_layernorm=True: the residual carries {what} γ⊙n+β, which is "
                  "not zero-mean, so this norm's input is not zero-mean")


def _is_shared(model: nn.Module, path: str) -> bool:
    weight = get(model, path).weight
    return sum(p is weight for _, p in model.named_parameters(remove_duplicate=False)) > 1


def plan(model: nn.Module) -> ConversionPlan:
    base = base_prefix(model)
    table, emb_ln = join(base, "word_embeddings"), join(base, "word_embeddings_layernorm")
    plan = ConversionPlan(adapter="bloom")
    embed = StreamPlan(name="decoder")
    if _is_shared(model, table):
        plan.kept.append(KeptNorm(emb_ln, _TIED))
    else:
        embed.writers.append(table)
        embed.norms.append(NormSite(emb_ln))  # its output is the stream: the affine stays in the RMSNorm
    if model.config.apply_residual_connection_post_layernorm:
        _keep_post_residual(model, plan)
        if embed.norms:
            plan.streams.append(embed)
        if plan.kept and not plan.streams:
            plan.notes.append("no BLOOM norm has a provably zero-mean input in this configuration; nothing "
                              "is converted and the checkpoint computes the same function at the same cost")
        return plan
    stream = BLOOM_STREAM.expand(model)
    stream.writers[:0] = embed.writers
    stream.norms[:0] = embed.norms
    stream.recenter_after.append(emb_ln)
    plan.streams.append(stream)
    plan.notes.append("word_embeddings_layernorm's output γ⊙n+β is not zero-mean: it is recentred once by an "
                      "explicit Recenter so that every block norm and ln_f become RMSNorms; stock transformers "
                      "needs no Recenter (its LayerNorms re-centre their input) and reloads the checkpoint")
    return plan


def _keep_post_residual(model: nn.Module, plan: ConversionPlan) -> None:
    base = base_prefix(model)
    n = len(get(model, join(base, "h")))
    for i in range(n):
        blk = join(base, "h", str(i))
        first = "word_embeddings_layernorm's output" if i == 0 else f"layer {i - 1}'s post_attention_layernorm output"
        plan.kept.append(KeptNorm(join(blk, "input_layernorm"), _POST_RESIDUAL.format(what=first)))
        plan.kept.append(KeptNorm(join(blk, "post_attention_layernorm"),
                                  _POST_RESIDUAL.format(what="this layer's input_layernorm output")))
    plan.kept.append(KeptNorm(join(base, "ln_f"),
                              _POST_RESIDUAL.format(what="the last layer's post_attention_layernorm output")))


_COMMON = dict(vocab_size=101, bos_token_id=1, eos_token_id=2, pad_token_id=3)
_HEADS = ("BloomModel", "BloomForCausalLM", "BloomForSequenceClassification", "BloomForTokenClassification",
          "BloomForQuestionAnswering")

ADAPTER = Adapter(
    name="bloom", display_name="BLOOM", plan=plan,
    model_types=("bloom",),
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True),
    examples=(
        TinyExample("tied", "BloomConfig", dict(_COMMON, hidden_size=24, n_layer=2, n_head=3), _HEADS),
        TinyExample("untied-eps6-tp2", "BloomConfig",
                    dict(_COMMON, hidden_size=32, n_layer=3, n_head=4, layer_norm_epsilon=1e-6, pretraining_tp=2,
                         slow_but_exact=True, tie_word_embeddings=False), ("BloomForCausalLM",)),
        TinyExample("residual-post-layernorm", "BloomConfig",
                    dict(_COMMON, hidden_size=24, n_layer=2, n_head=2, apply_residual_connection_post_layernorm=True,
                         tie_word_embeddings=False), ("BloomForCausalLM", "BloomModel")),
    ),
)
