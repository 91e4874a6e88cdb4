"""BART (transformers `BartModel` and its generation, classification, QA and causal-LM heads).

BART is Post-LN: x_{k+1} = LN_k(x_k + F_k(x_k)), and the stream x_k that the next branch reads is
the previous LayerNorm's output γ⊙n + β. A norm can become an RMSNorm only where its input is
provably zero-mean (paper 001 App. B):

- `layernorm_embedding` (encoder and decoder): its input is embed_tokens[ids]·scale +
  embed_positions[pos]; centring both tables makes it zero-mean, so it is converted exactly,
  keeping its affine (its output is the stream). It needs no Recenter after it: the next norm is a
  LayerNorm again, which does its own centring.
- a block norm LN_k: its input is x_k + F_k(x_k). F_k's output projection can be centred, but x_k
  = γ⊙n + β is zero-mean for every input only if γ is constant and mean(β) = 0; the plan, which
  must hold for any weight values (training-time reparametrization reuses it), asks for the
  structural case: the previous norm has no affine at all (App. B's "affine disabled"). BART's
  norms always have one, so its block norms stay LayerNorms (reported with this reason); a
  hand-made affine-free norm lets the norm after it convert.

Centring the shared token table unties it from `lm_head` (and gives the encoder, decoder and
`shared` their own copies, which transformers' `tie_word_embeddings=False` loading requires): a
stock-reloadable checkpoint, larger by those copies.
"""

from __future__ import annotations

from torch import nn

from ._tower import module_path
from .base import Adapter, Capabilities, ConversionPlan, KeptNorm, NormSite, StreamPlan, TinyExample, get, join
from .mbart import seq2seq_text_inputs

# per block: (norm, the branch output projection whose output joins the stream just before it)
ENCODER_BLOCK = (("self_attn_layer_norm", "self_attn.out_proj"), ("final_layer_norm", "fc2"))
DECODER_BLOCK = (("self_attn_layer_norm", "self_attn.out_proj"), ("encoder_attn_layer_norm", "encoder_attn.out_proj"),
                 ("final_layer_norm", "fc2"))


def affine_free(ln: nn.Module) -> bool:
    """No γ and no β: the output n is zero-mean for every input and every weight value. (A constant
    γ with β = 0 would do too, but plans are structural so that they hold under training.)"""
    return getattr(ln, "weight", None) is None and getattr(ln, "bias", None) is None


def post_ln_stream(model: nn.Module, name: str, tower: str, block: tuple[tuple[str, str], ...],
                   plan: ConversionPlan) -> StreamPlan:
    stream = StreamPlan(name=name, writers=[join(tower, "embed_tokens"), join(tower, "embed_positions")])
    emb_norm = join(tower, "layernorm_embedding")
    stream.norms.append(NormSite(emb_norm))
    # the norms whose outputs may be the stream a given norm's branch reads: the previous norm; for
    # the decoder's final_layer_norm also self_attn_layer_norm (cross-attention is skipped when no
    # encoder states are given, e.g. BartForCausalLM)
    previous = [emb_norm]
    for i in range(len(get(model, join(tower, "layers")))):
        layer = join(tower, f"layers.{i}")
        for norm, writer in block:
            path = join(layer, norm)
            bad = [p for p in previous if not affine_free(get(model, p))]
            if bad:
                plan.kept.append(KeptNorm(path, (
                    f"Post-LN: its input is x + F(x) where x is the output γ⊙n + β of {bad[0]}, which is not "
                    "zero-mean (that norm has an elementwise affine), so LayerNorm ≠ RMSNorm here")))
            else:
                stream.writers.append(join(layer, writer))
                stream.norms.append(NormSite(path))
            previous = [path, join(layer, "self_attn_layer_norm")] if norm == "encoder_attn_layer_norm" else [path]
    return stream


def bart_plan(model: nn.Module) -> ConversionPlan:
    plan = ConversionPlan(adapter="bart")
    encoder = module_path(model, "BartEncoder")
    decoder = module_path(model, "BartDecoder")
    if encoder is not None:
        plan.streams.append(post_ln_stream(model, "encoder", encoder, ENCODER_BLOCK, plan))
    if decoder is not None:
        plan.streams.append(post_ln_stream(model, "decoder", decoder, DECODER_BLOCK, plan))
    plan.notes.append("BART is Post-LN: only norms whose input is provably zero-mean are converted "
                      "(layernorm_embedding after centring the embedding tables; a block norm only when the "
                      "norm before it has no elementwise affine)")
    if plan.kept:
        plan.notes.append(f"{len(plan.kept)} Post-LN block norms stay LayerNorm: expect no measurable speed-up")
    return plan


_COMMON = dict(vocab_size=99, max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
               decoder_start_token_id=2, num_labels=3)
_HEADS = ("BartModel", "BartForConditionalGeneration", "BartForSequenceClassification",
          "BartForQuestionAnswering", "BartForCausalLM")

ADAPTER = Adapter(
    name="bart", display_name="BART",
    plan=bart_plan,
    model_types=("bart",),
    example_inputs=seq2seq_text_inputs,
    capabilities=Capabilities(variants=("rmsnorm",), post_ln=True),
    examples=(
        TinyExample("d32", "BartConfig",
                    dict(_COMMON, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48),
                    _HEADS),
        TinyExample("d24-scaled-untied", "BartConfig",
                    dict(_COMMON, d_model=24, encoder_layers=3, decoder_layers=2, encoder_attention_heads=3,
                         decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=36, scale_embedding=True,
                         tie_word_embeddings=False),
                    ("BartForConditionalGeneration",)),
    ),
)
