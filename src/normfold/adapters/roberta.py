"""RoBERTa (and XLM-RoBERTa, CamemBERT, which share its modules): a Post-LN encoder.

Same layout as BERT (see `bert`); positions start after the pad id, the token-type table often has
one row, and the MLM head is `lm_head` (dense → GELU → layer_norm → decoder tied to the word table).
Only the embedding LayerNorm becomes an exact RMSNorm (see `post_ln`).
"""

from __future__ import annotations

from .base import TinyExample
from .bert import BERT_SUBLAYERS, EMBEDDING_TABLES
from .post_ln import HeadNorm, PostLNTemplate, post_ln_adapter

ROBERTA = PostLNTemplate(
    tables=EMBEDDING_TABLES,
    embedding_norm="embeddings.LayerNorm",
    layers="encoder.layer",
    sublayers=BERT_SUBLAYERS,
    head_norms=(HeadNorm("lm_head.layer_norm", "gelu(lm_head.dense)"),),
)

_COMMON = dict(vocab_size=101, max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2)
_HEADS = ("RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification", "RobertaForMultipleChoice",
          "RobertaForTokenClassification", "RobertaForQuestionAnswering")

ADAPTER = post_ln_adapter(
    "roberta", "RoBERTa", ROBERTA,
    model_types=("roberta", "xlm-roberta", "camembert"),
    examples=(
        TinyExample("base", "RobertaConfig",
                    dict(_COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         type_vocab_size=1, layer_norm_eps=1e-5),
                    _HEADS),
        TinyExample("causal-2types", "RobertaConfig",
                    dict(_COMMON, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=72,
                         type_vocab_size=2, is_decoder=True),
                    ("RobertaForCausalLM",)),
        TinyExample("xlm-roberta", "XLMRobertaConfig",
                    dict(_COMMON, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40),
                    ("XLMRobertaModel", "XLMRobertaForMaskedLM")),
        TinyExample("camembert", "CamembertConfig",
                    dict(_COMMON, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32),
                    ("CamembertForSequenceClassification",)),
    ),
)
