"""GPT-J (transformers `GPTJModel` and every GPT-J head).

Parallel block from one norm: x ← x + attn(ln_1(x)) + mlp(ln_1(x)). Stream: x0 = wte[ids]
(+ wte[token_type_ids]); rotary positions act inside attention, so there is no position table.
ln_1 is read by q/k/v (nn.Linear without bias) and mlp.fc_in; attn.out_proj (no bias) and
mlp.fc_out write. ln_f feeds the heads; GPT-J's lm_head is untied and has a bias.

q/k/v have no bias, so ln_1's β cannot be folded into its readers: ln_1 becomes an RMSNorm that
keeps its affine unless allow_new_bias=True.
"""

from __future__ import annotations

from .base import BlockTemplate, Capabilities, StreamTemplate, TinyExample, template_adapter

GPTJ_STREAM = StreamTemplate(
    name="decoder",
    sources=("wte",),
    layers="h",
    block=BlockTemplate(
        norms=(("ln_1", ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in")),),
        writers=("attn.out_proj", "mlp.fc_out"),
    ),
    final_norm="ln_f",
    final_readers=("lm_head", "score", "qa_outputs"),
)

_COMMON = dict(vocab_size=103, n_positions=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_HEADS = ("GPTJModel", "GPTJForCausalLM", "GPTJForSequenceClassification", "GPTJForQuestionAnswering")

ADAPTER = template_adapter(
    "gptj", "GPT-J", GPTJ_STREAM,
    model_types=("gptj",),
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True, parallel_residual=True),
    examples=(
        TinyExample("rotary4", "GPTJConfig", dict(_COMMON, n_embd=24, n_layer=2, n_head=3, rotary_dim=4), _HEADS),
        TinyExample("full-rotary-eps6", "GPTJConfig",
                    dict(_COMMON, n_embd=32, n_layer=3, n_head=4, rotary_dim=8, n_inner=40, layer_norm_epsilon=1e-6,
                         activation_function="gelu"), ("GPTJForCausalLM",)),
    ),
)
