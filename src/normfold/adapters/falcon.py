"""Falcon (transformers `FalconModel` and every Falcon head), all of whose variants use LayerNorm.

Stream: x0 = word_embeddings[ids] (rotary or alibi positions act inside attention); writers per
layer: self_attention.dense and mlp.dense_4h_to_h (FalconLinear, optionally without bias). The
norms and their readers depend on the config, exactly as FalconDecoderLayer.forward uses them:

- new_decoder_architecture (40B/180B) with num_ln_in_parallel_attn=2 (its default): ln_attn →
  self_attention.query_key_value, ln_mlp → mlp.dense_h_to_4h, both reading x (parallel block);
- new_decoder_architecture with num_ln_in_parallel_attn=1, or parallel_attn without the new
  architecture (7B): one input_layernorm read by query_key_value and dense_h_to_4h;
- parallel_attn=False (RW-1B style): input_layernorm → query_key_value, then
  post_attention_layernorm → dense_h_to_4h reading x + attn(...).

Every case is a Pre-LN stream, so every norm, ln_f included, becomes an RMSNorm. With bias=False
(the released models) β cannot be folded into the readers and stays in the RMSNorm.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedConversionError
from .base import Adapter, BlockTemplate, Capabilities, ConversionPlan, StreamTemplate, TinyExample

QKV, MLP_IN = "self_attention.query_key_value", "mlp.dense_h_to_4h"
WRITERS = ("self_attention.dense", "mlp.dense_4h_to_h")


def _two_norms(cfg) -> bool:
    # FalconDecoderLayer sets num_ln_in_parallel_attn = 2 when it is None and new_decoder_architecture.
    n = cfg.num_ln_in_parallel_attn if cfg.num_ln_in_parallel_attn is not None else 2
    return bool(cfg.new_decoder_architecture) and n == 2


def block_template(cfg) -> BlockTemplate:
    if _two_norms(cfg):
        norms = (("ln_attn", (QKV,)), ("ln_mlp", (MLP_IN,)))
    elif cfg.parallel_attn:
        norms = (("input_layernorm", (QKV, MLP_IN)),)
    else:
        norms = (("input_layernorm", (QKV,)), ("post_attention_layernorm", (MLP_IN,)))
    return BlockTemplate(norms=norms, writers=WRITERS)


def _check(model: nn.Module) -> None:
    cfg = model.config
    n = cfg.num_ln_in_parallel_attn
    if cfg.new_decoder_architecture and not cfg.parallel_attn:
        raise UnsupportedConversionError(
            "Falcon with new_decoder_architecture=True and parallel_attn=False cannot run in transformers "
            "(FalconDecoderLayer builds input/post_attention norms but its forward uses the parallel ones); "
            "fix the config (parallel_attn=True) before converting.")
    if cfg.parallel_attn and not cfg.new_decoder_architecture and n == 2:
        raise UnsupportedConversionError(
            "Falcon with num_ln_in_parallel_attn=2 but new_decoder_architecture=False cannot run in transformers "
            "(the layer builds ln_attn/ln_mlp while its forward uses input_layernorm); fix the config first.")


def plan(model: nn.Module) -> ConversionPlan:
    template = StreamTemplate(
        name="decoder", sources=("word_embeddings",), layers="h", block=block_template(model.config),
        final_norm="ln_f", final_readers=("lm_head", "score", "classifier", "qa_outputs"))
    return ConversionPlan(adapter="falcon", streams=[template.expand(model)])


_COMMON = dict(vocab_size=127, max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=3)
_HEADS = ("FalconModel", "FalconForCausalLM", "FalconForSequenceClassification", "FalconForTokenClassification",
          "FalconForQuestionAnswering")

ADAPTER = Adapter(
    name="falcon", display_name="Falcon", plan=plan, check=_check,
    model_types=("falcon",),
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True, parallel_residual=True),
    examples=(
        TinyExample("new-arch-ln-attn-mlp", "FalconConfig",
                    dict(_COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                         new_decoder_architecture=True, parallel_attn=True), _HEADS),
        TinyExample("new-arch-one-ln-bias-eps6", "FalconConfig",
                    dict(_COMMON, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, num_kv_heads=1,
                         new_decoder_architecture=True, parallel_attn=True, num_ln_in_parallel_attn=1, bias=True,
                         layer_norm_epsilon=1e-6), ("FalconForCausalLM",)),
        TinyExample("parallel-mqa-7b-style", "FalconConfig",
                    dict(_COMMON, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, multi_query=True,
                         parallel_attn=True, tie_word_embeddings=False), ("FalconForCausalLM",)),
        TinyExample("sequential-alibi-bias-rw-style", "FalconConfig",
                    dict(_COMMON, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, multi_query=False,
                         parallel_attn=False, alibi=True, bias=True, layer_norm_epsilon=1e-12),
                    ("FalconForCausalLM", "FalconForQuestionAnswering")),
    ),
)
