"""BERT (transformers `BertModel` and every BERT head): a Post-LN encoder.

Embeddings: word + position + token-type tables → embeddings.LayerNorm → stream. Each block:
LN(x + attention.output.dense(...)) then LN(x + output.dense(...)) (plus cross-attention in
decoder configs). Only the embedding LayerNorm becomes an exact RMSNorm; see `post_ln` for why
the block norms cannot, and docs/post-ln.md for the numbers.
"""

from __future__ import annotations

from .base import TinyExample
from .post_ln import HeadNorm, PostLNTemplate, Sublayer, post_ln_adapter

# BERT, and the families that copy its module layout (RoBERTa, ELECTRA) share these names.
EMBEDDING_TABLES = ("embeddings.word_embeddings", "embeddings.position_embeddings", "embeddings.token_type_embeddings")
BERT_SUBLAYERS = (
    Sublayer("attention.output.dense", "attention.output.LayerNorm", "self-attention"),
    Sublayer("crossattention.output.dense", "crossattention.output.LayerNorm", "cross-attention"),
    Sublayer("output.dense", "output.LayerNorm", "feed-forward"),
)

BERT = PostLNTemplate(
    tables=EMBEDDING_TABLES,
    embedding_norm="embeddings.LayerNorm",
    layers="encoder.layer",
    sublayers=BERT_SUBLAYERS,
    head_norms=(HeadNorm("cls.predictions.transform.LayerNorm", "cls.predictions.transform.transform_act_fn"),),
)

_COMMON = dict(vocab_size=99, max_position_embeddings=32)
_HEADS = ("BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
          "BertForSequenceClassification", "BertForMultipleChoice", "BertForTokenClassification",
          "BertForQuestionAnswering")

ADAPTER = post_ln_adapter(
    "bert", "BERT", BERT,
    model_types=("bert",),
    examples=(
        TinyExample("base", "BertConfig",
                    dict(_COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48),
                    _HEADS),
        TinyExample("decoder-untied", "BertConfig",
                    dict(_COMMON, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40,
                         type_vocab_size=3, layer_norm_eps=1e-5, hidden_act="gelu_new", is_decoder=True,
                         tie_word_embeddings=False),
                    ("BertModel", "BertLMHeadModel")),
    ),
)
