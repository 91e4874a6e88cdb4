"""Whisper (transformers `WhisperModel`, `WhisperForConditionalGeneration`,
`WhisperForAudioClassification`, `WhisperForCausalLM`).

Two streams:

- encoder: x0 = gelu(conv2(gelu(conv1(features)))) + embed_positions. The GELU after conv2 is a
  functional call (no module to hook after) and its output is not zero-mean for any choice of conv
  weights, so an explicit Recenter is put on the input of `encoder.layers[0]` (`recenter_before`);
  with it, the stem and the position table need no edits. Pre-LN blocks (self_attn_layer_norm →
  self_attn.{q,k,v}_proj, final_layer_norm → fc1; writers self_attn.out_proj, fc2). The final
  `encoder.layer_norm` gives encoder_last_hidden_state, read by every decoder layer's cross-attention
  `encoder_attn.{k,v}_proj` (and by the audio classifier's `projector`).
- decoder: x0 = embed_tokens[ids] + embed_positions[pos]; blocks with self_attn_layer_norm →
  self_attn.{q,k,v}_proj, encoder_attn_layer_norm → encoder_attn.q_proj, final_layer_norm → fc1;
  writers self_attn.out_proj, encoder_attn.out_proj, fc2; `decoder.layer_norm` → `proj_out`, which
  is tied to embed_tokens (centring the table unties them).

The Recenter is for normfold's RMSNorms: stock transformers reloads the checkpoint without it (its
LayerNorms re-centre their input). In float16 the encoder layers clamp the stream to the finite
range; the clamp is only active where float16 already overflows (and then it sees the stream with
the stem's mean under a stock load, without it under normfold.load).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..errors import UnsupportedConversionError
from ._tower import expand_at, module_path, present
from .base import (
    Adapter,
    BlockTemplate,
    Capabilities,
    ConversionPlan,
    NormSite,
    StreamTemplate,
    TinyExample,
    get,
    join,
)

ENCODER = StreamTemplate(
    name="encoder",
    sources=(),  # conv stem + positions: recentred explicitly before layers.0
    layers="layers",
    block=BlockTemplate(
        norms=(("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
               ("final_layer_norm", ("fc1",))),
        writers=("self_attn.out_proj", "fc2"),
    ),
)
DECODER = StreamTemplate(
    name="decoder",
    sources=("embed_tokens", "embed_positions"),
    layers="layers",
    block=BlockTemplate(
        norms=(("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
               ("encoder_attn_layer_norm", ("encoder_attn.q_proj",)),
               ("final_layer_norm", ("fc1",))),
        writers=("self_attn.out_proj", "encoder_attn.out_proj", "fc2"),
    ),
)


def _keys_cancel_beta(site: NormSite) -> NormSite:
    """The encoder self-attention k_proj has no bias: β's term βW_k adds the same vector to every key, so
    q·(βW_k) is constant along each softmax row (no RoPE, no key norm; the encoder's mask, if any, is
    additive) and is dropped: γ and β fold into q/k/v and the norm keeps no affine."""
    if not site.path.endswith("self_attn_layer_norm"):
        return site
    keys = tuple(r for r in site.readers if r.endswith("self_attn.k_proj"))
    return NormSite(site.path, site.readers, final=site.final, beta_cancels=keys)


def cross_attention_readers(model: nn.Module, decoder: str | None) -> tuple[str, ...]:
    """Every decoder layer's cross-attention key/value projection reads the encoder's final norm."""
    if decoder is None:
        return ()
    n = len(get(model, join(decoder, "layers")))
    return tuple(join(decoder, f"layers.{i}.encoder_attn.{p}") for i in range(n) for p in ("k_proj", "v_proj"))


def whisper_plan(model: nn.Module) -> ConversionPlan:
    plan = ConversionPlan(adapter="whisper")
    encoder = module_path(model, "WhisperEncoder")
    decoder = module_path(model, "WhisperDecoder")
    if encoder is not None:
        stream = expand_at(ENCODER, model, encoder)
        stream.norms = [_keys_cancel_beta(site) for site in stream.norms]
        stream.recenter_before.append(join(encoder, "layers.0"))
        readers = cross_attention_readers(model, decoder) + tuple(r for r in ("projector",) if present(model, r))
        stream.norms.append(NormSite(join(encoder, "layer_norm"), readers, final=True))
        plan.streams.append(stream)
        plan.notes.append(
            f"the encoder stem ends in a functional GELU whose output is not zero-mean: an explicit Recenter "
            f"acts on the input of {join(encoder, 'layers.0')} (one O(d) op per audio frame); normfold.load "
            "restores it, stock transformers needs none (its LayerNorms re-centre their input)")
    if decoder is not None:
        stream = expand_at(DECODER, model, decoder)
        stream.norms.append(NormSite(join(decoder, "layer_norm"),
                                     tuple(r for r in ("proj_out",) if present(model, r)), final=True))
        plan.streams.append(stream)
    return plan


def _check(model: nn.Module) -> None:
    cfg = model.config
    if type(model).__name__ == "WhisperForAudioClassification" and getattr(cfg, "use_weighted_layer_sum", False):
        raise UnsupportedConversionError(
            "WhisperForAudioClassification with use_weighted_layer_sum=True feeds a weighted sum of the encoder's "
            "raw residual-stream hidden states to its projector, so the per-token mean that the conversion "
            "removes would change its logits. Convert a model with use_weighted_layer_sum=False (it reads the "
            "encoder's final norm), or keep this one as LayerNorm.")


def whisper_inputs(model: nn.Module, generator: torch.Generator, batch: int = 2, seq: int = 6) -> dict:
    cfg = model.config
    params = inspect.signature(model.forward).parameters
    inputs = {}
    if "input_features" in params:
        frames = 2 * cfg.max_source_positions  # conv2 has stride 2; Whisper checks the exact length
        inputs["input_features"] = torch.randn(batch, cfg.num_mel_bins, frames, generator=generator)
    ids = torch.randint(0, cfg.vocab_size, (batch, min(seq, cfg.max_target_positions)), generator=generator)
    if "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = ids
    elif "input_features" not in params:
        # WhisperForCausalLM, the decoder alone: give its cross-attention encoder states to read
        inputs["input_ids"] = ids
        inputs["encoder_outputs"] = torch.randn(batch, 5, cfg.d_model, generator=generator)
    return inputs


_COMMON = dict(vocab_size=99, num_mel_bins=8, max_source_positions=12, max_target_positions=16, pad_token_id=0,
               bos_token_id=1, eos_token_id=2, decoder_start_token_id=3, begin_suppress_tokens=None,
               classifier_proj_size=20, num_labels=3)

ADAPTER = Adapter(
    name="whisper", display_name="Whisper",
    plan=whisper_plan,
    model_types=("whisper",),
    check=_check,
    example_inputs=whisper_inputs,
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True),
    examples=(
        TinyExample("d32", "WhisperConfig",
                    dict(_COMMON, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48),
                    ("WhisperModel", "WhisperForConditionalGeneration", "WhisperForAudioClassification")),
        TinyExample("d24-untied-3x2", "WhisperConfig",
                    dict(_COMMON, d_model=24, encoder_layers=3, decoder_layers=2, encoder_attention_heads=3,
                         decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=36, num_mel_bins=5,
                         max_source_positions=7, tie_word_embeddings=False, activation_function="gelu_new"),
                    ("WhisperForCausalLM", "WhisperForConditionalGeneration")),
    ),
)
