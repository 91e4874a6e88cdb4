"""OPT (transformers `OPTModel` and every OPT head).

Pre-LN sizes (do_layer_norm_before=True: 125m, 1.3b and up). Stream: x0 = embed_positions[pos] +
embed_tokens[ids], or + project_in(embed_tokens[ids]) when word_embed_proj_dim != hidden_size
(then project_in, not the table, is the writer, and the table tied to lm_head stays untouched).
Per layer self_attn_layer_norm → q/k/v_proj and final_layer_norm → fc1 read it; self_attn.out_proj
and fc2 write. The decoder's final_layer_norm feeds project_out when present, else the heads.

Post-LN (do_layer_norm_before=False, OPT-350m): each layer computes h = LN_a(x + attn(x)),
x' = LN_f(h + fc2(act(fc1(h)))). The branches read x and h *unnormalized*, so the stream cannot be
recentred without changing them; a norm's input is zero-mean only when the norm before it emits a
zero-mean output, i.e. has no elementwise affine. So with layer_norm_elementwise_affine=False every
norm except layer 0's self_attn_layer_norm (it reads the raw embeddings) becomes an RMSNorm; with
the affine (every released OPT-350m) none can, and the report says why for each.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedConversionError
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

PRE_LN_BLOCK = BlockTemplate(
    norms=(("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
           ("final_layer_norm", ("fc1",))),
    writers=("self_attn.out_proj", "fc2"),
)
HEAD_READERS = ("lm_head", "score", "qa_outputs")

_POST_LN_ATTN = ("post-LN (do_layer_norm_before=False): the input is x + attn(x), where x ({what}) is also "
                 "read unnormalized by the attention; x is not zero-mean and cannot be recentred without "
                 "changing that read")
_POST_LN_FFN = ("post-LN (do_layer_norm_before=False): the input is h + fc2(act(fc1(h))) where h, the "
                "output γ⊙n+β of self_attn_layer_norm, is not zero-mean (elementwise affine) and is read "
                "unnormalized by fc1")


def _decoder(model: nn.Module) -> str:
    return join(base_prefix(model), "decoder")


def _check(model: nn.Module) -> None:
    cfg = model.config
    if cfg.do_layer_norm_before and get(model, _decoder(model)).final_layer_norm is None:
        raise UnsupportedConversionError(
            "this pre-LN OPT has no final LayerNorm (config._remove_final_layer_norm=True): its heads read the "
            "residual stream itself, whose per-token mean the conversion removes, so no exact RMSNorm "
            "conversion exists. Convert a checkpoint with the final layer norm.")


def _pre_ln(model: nn.Module) -> ConversionPlan:
    dec = get(model, _decoder(model))
    readers = ((join(_decoder(model), "project_out"),) if dec.project_out is not None else HEAD_READERS)
    template = StreamTemplate(
        name="decoder", root="decoder",
        sources=("project_in" if dec.project_in is not None else "embed_tokens", "embed_positions"),
        layers="layers", block=PRE_LN_BLOCK, final_norm="final_layer_norm", final_readers=readers)
    notes = []
    if dec.project_in is not None:
        notes.append("word_embed_proj_dim != hidden_size: project_in is the stream's writer (centred); the "
                     "embedding table it reads, tied to lm_head, is left as it is; project_out reads the final norm")
    return ConversionPlan(adapter="opt", streams=[template.expand(model)], notes=notes)


def _post_ln(model: nn.Module) -> ConversionPlan:
    dec_path = _decoder(model)
    layers = get(model, dec_path).layers
    paths = [join(dec_path, "layers", str(i)) for i in range(len(layers))]
    affine = bool(getattr(model.config, "layer_norm_elementwise_affine", True))
    first = "the input embeddings, project_in(embed_tokens) + embed_positions"
    later = "the previous layer's final_layer_norm output γ⊙n+β" if affine else None
    kept = [KeptNorm(join(paths[0], "self_attn_layer_norm"), _POST_LN_ATTN.format(what=first))]
    plan = ConversionPlan(adapter="opt", kept=kept)
    if affine:
        for p in paths[1:]:
            kept.append(KeptNorm(join(p, "self_attn_layer_norm"), _POST_LN_ATTN.format(what=later)))
        kept.extend(KeptNorm(join(p, "final_layer_norm"), _POST_LN_FFN) for p in paths)
        plan.notes.append("post-LN OPT with elementwise-affine LayerNorms: no norm has a provably zero-mean input, "
                          "so none is converted; the checkpoint computes the same function at the same cost")
        return plan
    # No affine: every norm emits zero-mean n, so after centring the branch writers that follow it, the
    # next norm's input (n + branch) is zero-mean. Layer 0's first norm reads the raw embeddings.
    stream = StreamPlan(name="decoder")
    for i, p in enumerate(paths):
        if i > 0:
            stream.writers.append(join(p, "self_attn.out_proj"))
            stream.norms.append(NormSite(join(p, "self_attn_layer_norm")))
        stream.writers.append(join(p, "fc2"))
        stream.norms.append(NormSite(join(p, "final_layer_norm")))
    plan.streams.append(stream)
    plan.notes.append("post-LN OPT without elementwise affine: every norm but layer 0's self_attn_layer_norm "
                      "reads (zero-mean norm output) + (centred branch) and becomes an RMSNorm")
    return plan


def plan(model: nn.Module) -> ConversionPlan:
    return _pre_ln(model) if model.config.do_layer_norm_before else _post_ln(model)


_COMMON = dict(vocab_size=97, max_position_embeddings=32, bos_token_id=2, eos_token_id=2, pad_token_id=1)
_HEADS = ("OPTModel", "OPTForCausalLM", "OPTForSequenceClassification", "OPTForQuestionAnswering")

ADAPTER = Adapter(
    name="opt", display_name="OPT", plan=plan, check=_check,
    model_types=("opt",),
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True, post_ln=True),
    examples=(
        TinyExample("pre-ln", "OPTConfig",
                    dict(_COMMON, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, ffn_dim=48,
                         word_embed_proj_dim=24), _HEADS),
        TinyExample("pre-ln-project-in-out-no-bias", "OPTConfig",
                    dict(_COMMON, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=40,
                         word_embed_proj_dim=16, enable_bias=False), ("OPTForCausalLM", "OPTForQuestionAnswering")),
        TinyExample("post-ln-no-affine-350m-style", "OPTConfig",
                    dict(_COMMON, hidden_size=24, num_hidden_layers=3, num_attention_heads=3, ffn_dim=40,
                         word_embed_proj_dim=16, do_layer_norm_before=False, layer_norm_elementwise_affine=False),
                    ("OPTForCausalLM", "OPTModel")),
    ),
)
