"""DistilBERT: a Post-LN encoder with word + position tables (no token types) and eps 1e-12.

Blocks: sa_layer_norm(x + attention.out_lin(...)), output_layer_norm(x + ffn.lin2(...)). The MLM
head's vocab_layer_norm reads a GELU output. Only the embedding LayerNorm becomes an exact RMSNorm
(see `post_ln`). With sinusoidal_pos_embds the fixed sinusoid table is centred like a learned one.
"""

from __future__ import annotations

from .base import TinyExample
from .post_ln import HeadNorm, PostLNTemplate, Sublayer, post_ln_adapter

DISTILBERT = PostLNTemplate(
    tables=("embeddings.word_embeddings", "embeddings.position_embeddings"),
    embedding_norm="embeddings.LayerNorm",
    layers="transformer.layer",
    sublayers=(
        Sublayer("attention.out_lin", "sa_layer_norm", "self-attention"),
        Sublayer("ffn.lin2", "output_layer_norm", "feed-forward"),
    ),
    head_norms=(HeadNorm("vocab_layer_norm", "activation(vocab_transform)"),),
)

_COMMON = dict(vocab_size=97, max_position_embeddings=32)
_HEADS = ("DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification",
          "DistilBertForMultipleChoice", "DistilBertForTokenClassification", "DistilBertForQuestionAnswering")

ADAPTER = post_ln_adapter(
    "distilbert", "DistilBERT", DISTILBERT,
    model_types=("distilbert",),
    examples=(
        TinyExample("base", "DistilBertConfig", dict(_COMMON, dim=32, n_layers=2, n_heads=4, hidden_dim=64), _HEADS),
        TinyExample("sinusoidal-untied", "DistilBertConfig",
                    dict(_COMMON, dim=24, n_layers=2, n_heads=3, hidden_dim=40, sinusoidal_pos_embds=True,
                         activation="relu", tie_word_embeddings=False),
                    ("DistilBertForMaskedLM", "DistilBertForQuestionAnswering")),
    ),
)
