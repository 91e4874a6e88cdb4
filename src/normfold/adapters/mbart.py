"""mBART (transformers `MBartModel` and its generation, classification, QA and causal-LM heads).

Pre-LN encoder-decoder with a LayerNorm on each stream right after the embeddings:

- encoder: x0 = layernorm_embedding(embed_tokens[ids]·scale + embed_positions[pos]). The tables are
  centred, so layernorm_embedding's input is zero-mean and it becomes an RMSNorm; its affine output
  is the stream, so an explicit Recenter follows it (as CLIP's pre_layrnorm: see
  `_tower.embedding_norm_on_stream`). Blocks: self_attn_layer_norm → self_attn.{q,k,v}_proj,
  final_layer_norm → fc1; writers self_attn.out_proj, fc2. The final `encoder.layer_norm` gives
  encoder_last_hidden_state, read by every decoder cross-attention's k_proj / v_proj.
- decoder: the same embedding part; blocks add encoder_attn_layer_norm → encoder_attn.q_proj and the
  writer encoder_attn.out_proj; `decoder.layer_norm` feeds the heads (lm_head, tied to the shared
  table: centring untie them; classification_head.dense; qa_outputs).
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch
from torch import nn

from ._tower import embedding_norm_on_stream, expand_at, module_path, present
from .base import Adapter, Capabilities, ConversionPlan, NormSite, TinyExample, join
from .whisper import DECODER, ENCODER, cross_attention_readers

# Whisper's block layout (same module names); mBART's encoder starts from embedding tables
MBART_ENCODER = replace(ENCODER, sources=("embed_tokens", "embed_positions"))
DECODER_HEADS = ("lm_head", "classification_head.dense", "qa_outputs")


def mbart_plan(model: nn.Module) -> ConversionPlan:
    plan = ConversionPlan(adapter="mbart")
    encoder = module_path(model, "MBartEncoder")
    decoder = module_path(model, "MBartDecoder")
    if encoder is not None:
        stream = expand_at(MBART_ENCODER, model, encoder)
        plan.notes.append(embedding_norm_on_stream(model, stream, join(encoder, "layernorm_embedding")))
        stream.norms.append(NormSite(join(encoder, "layer_norm"), cross_attention_readers(model, decoder), final=True))
        plan.streams.append(stream)
    if decoder is not None:
        stream = expand_at(DECODER, model, decoder)
        plan.notes.append(embedding_norm_on_stream(model, stream, join(decoder, "layernorm_embedding")))
        stream.norms.append(NormSite(join(decoder, "layer_norm"),
                                     tuple(r for r in DECODER_HEADS if present(model, r)), final=True))
        plan.streams.append(stream)
    return plan


def seq2seq_text_inputs(model: nn.Module, generator: torch.Generator, batch: int = 2, seq: int = 7) -> dict:
    """input_ids ending in </s> (the classification heads pool there; the decoder inputs default to
    input_ids shifted right)."""
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=generator)
    ids[ids == cfg.eos_token_id] = 3
    ids[:, -1] = cfg.eos_token_id
    params = inspect.signature(model.forward).parameters
    return {"input_ids": ids} if "input_ids" in params else {}


_COMMON = dict(vocab_size=99, max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
               decoder_start_token_id=2, num_labels=3)
_HEADS = ("MBartModel", "MBartForConditionalGeneration", "MBartForSequenceClassification",
          "MBartForQuestionAnswering", "MBartForCausalLM")

ADAPTER = Adapter(
    name="mbart", display_name="mBART",
    plan=mbart_plan,
    model_types=("mbart",),
    example_inputs=seq2seq_text_inputs,
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True),
    examples=(
        TinyExample("d32-scaled", "MBartConfig",
                    dict(_COMMON, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, scale_embedding=True),
                    _HEADS),
        TinyExample("d24-3x2-untied", "MBartConfig",
                    dict(_COMMON, d_model=24, encoder_layers=3, decoder_layers=2, encoder_attention_heads=3,
                         decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=36,
                         tie_word_embeddings=False, activation_function="relu"),
                    ("MBartForConditionalGeneration",)),
    ),
)
