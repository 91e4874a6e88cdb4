"""ELECTRA (discriminator and generator heads): a Post-LN encoder with BERT's module names.

When embedding_size != hidden_size, `embeddings_project` (a Linear) alone reads the embedding
LayerNorm: that norm becomes an RMSNorm whose γ/β fold into the projection (no affine left). The
projection's output is the stream that block 0's attention reads directly, so it cannot be centred
and the block norms stay LayerNorm, as in BERT (see `post_ln`). The generator's
generator_predictions.LayerNorm reads a GELU output: kept.
"""

from __future__ import annotations

from .base import TinyExample
from .bert import BERT_SUBLAYERS, EMBEDDING_TABLES
from .post_ln import HeadNorm, PostLNTemplate, post_ln_adapter

ELECTRA = PostLNTemplate(
    tables=EMBEDDING_TABLES,
    embedding_norm="embeddings.LayerNorm",
    embedding_readers=("embeddings_project",),
    layers="encoder.layer",
    sublayers=BERT_SUBLAYERS,
    head_norms=(HeadNorm("generator_predictions.LayerNorm", "generator_predictions.activation"),),
)

_COMMON = dict(vocab_size=89, max_position_embeddings=32)
_HEADS = ("ElectraModel", "ElectraForPreTraining", "ElectraForMaskedLM", "ElectraForSequenceClassification",
          "ElectraForMultipleChoice", "ElectraForTokenClassification", "ElectraForQuestionAnswering")

ADAPTER = post_ln_adapter(
    "electra", "ELECTRA", ELECTRA,
    model_types=("electra",),
    examples=(
        TinyExample("projected", "ElectraConfig",
                    dict(_COMMON, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64),
                    _HEADS),
        TinyExample("square-causal", "ElectraConfig",
                    dict(_COMMON, embedding_size=24, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                         intermediate_size=48, layer_norm_eps=1e-6, is_decoder=True),
                    ("ElectraModel", "ElectraForCausalLM")),
    ),
)
