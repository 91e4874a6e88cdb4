"""Independent re-implementations used to check paper 002's foldable-LayerNorm claim for BERT
(Table 7: 24 of 25 foldable, 25 of 25 with a centred embedding). Nothing here uses normfold.

- `bert_dataflow` + `algorithm1`: the paper's Algorithm 1 (a tensor is "centred" after a regulable
  module, keeps its state through dropout, is the AND of its summands after a residual add, and a
  LayerNorm whose input is centred is foldable), run over a BERT's module graph.
- `paper_recipe`: what folding those LayerNorms means (§4.3, CCWT): centre every module writing
  into a LayerNorm's input (embedding tables, attention and feed-forward output projections) and
  replace the LayerNorms by RMSNorms with the same γ, β and eps.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

# step kinds: "embedding" (a table), "regulable" (linear, or a sub-network ending with one: attention),
# "activation", "dropout", "add" (a residual sum), "layernorm"
Step = tuple  # (kind, name, input tensor names, output tensor name)


def bert_dataflow(model: nn.Module) -> list[Step]:
    """Algorithm 1's walk over a transformers BertModel (or a model with a `.bert`)."""
    bert = getattr(model, "bert", model)
    steps: list[Step] = [("embedding", f"embeddings.{t}_embeddings", (), t) for t in ("word", "position", "token_type")]
    steps += [("add", "embeddings.sum", ("word", "position", "token_type"), "e"),
              ("layernorm", "embeddings.LayerNorm", ("e",), "e_ln"),
              ("dropout", "embeddings.dropout", ("e_ln",), "x0")]
    x = "x0"
    for i in range(len(bert.encoder.layer)):
        p = f"encoder.layer.{i}"
        steps += [("regulable", f"{p}.attention", (x,), f"a{i}"),  # self-attention ends with output.dense
                  ("dropout", f"{p}.attention.output.dropout", (f"a{i}",), f"ad{i}"),
                  ("add", f"{p}.attention.residual", (x, f"ad{i}"), f"s{i}"),
                  ("layernorm", f"{p}.attention.output.LayerNorm", (f"s{i}",), f"y{i}"),
                  ("regulable", f"{p}.intermediate.dense", (f"y{i}",), f"u{i}"),
                  ("activation", f"{p}.intermediate.intermediate_act_fn", (f"u{i}",), f"g{i}"),
                  ("regulable", f"{p}.output.dense", (f"g{i}",), f"f{i}"),
                  ("dropout", f"{p}.output.dropout", (f"f{i}",), f"fd{i}"),
                  ("add", f"{p}.output.residual", (f"y{i}", f"fd{i}"), f"t{i}"),
                  ("layernorm", f"{p}.output.LayerNorm", (f"t{i}",), f"x{i + 1}")]
        x = f"x{i + 1}"
    return steps


def algorithm1(steps: list[Step], *, ln_output_centred: bool, centred_embedding: bool) -> list[str]:
    """Foldable LayerNorms per paper 002 Algorithm 1.

    `ln_output_centred`: whether a LayerNorm's output counts as centred. Algorithm 1 as printed
    marks only regulable modules' outputs as centred; Table 7's BERT count (24/25) is what it gives
    when LayerNorm outputs count as centred too. `centred_embedding`: CCWT on the embedding tables."""
    centred: dict[str, bool] = {}
    foldable = []
    for kind, name, inputs, out in steps:
        if kind == "add":
            centred[out] = all(centred[i] for i in inputs)
            continue
        incoming = all(centred[i] for i in inputs) if inputs else False
        if kind == "layernorm" and incoming:
            foldable.append(name)
        centred[out] = {"regulable": True, "dropout": incoming, "embedding": centred_embedding,
                        "layernorm": ln_output_centred}.get(kind, False)
    return foldable


class ReferenceRMSNorm(nn.Module):
    def __init__(self, ln: nn.LayerNorm):
        super().__init__()
        self.weight, self.bias, self.eps = ln.weight, ln.bias, ln.eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


def _centre_linear(lin: nn.Linear) -> None:
    with torch.no_grad():
        lin.weight -= lin.weight.mean(0, keepdim=True)  # (out, in): centre over the output axis
        lin.bias -= lin.bias.mean()


def paper_recipe(model: nn.Module, block_norms: list[str] | None = None) -> nn.Module:
    """A copy of a BERT with the embedding LayerNorm and `block_norms` (default: all 2L block norms)
    replaced by RMSNorm after centring their writers (tables; the branch's output projection)."""
    model = copy.deepcopy(model)
    bert = getattr(model, "bert", model)
    emb = bert.embeddings
    with torch.no_grad():
        for table in (emb.word_embeddings, emb.position_embeddings, emb.token_type_embeddings):
            table.weight -= table.weight.mean(-1, keepdim=True)
    emb.LayerNorm = ReferenceRMSNorm(emb.LayerNorm)
    for i, layer in enumerate(bert.encoder.layer):
        for sub in (layer.attention.output, layer.output):
            name = f"encoder.layer.{i}.{'attention.output' if sub is layer.attention.output else 'output'}.LayerNorm"
            if block_norms is None or name in block_norms:
                _centre_linear(sub.dense)
                sub.LayerNorm = ReferenceRMSNorm(sub.LayerNorm)
    return model.eval()


def block_norm_names(model: nn.Module) -> list[str]:
    bert = getattr(model, "bert", model)
    return [f"encoder.layer.{i}.{s}.LayerNorm" for i in range(len(bert.encoder.layer)) for s in ("attention.output",
                                                                                                   "output")]


def sentence_embeddings(model: nn.Module, tokens: dict) -> torch.Tensor:
    """sentence-transformers' mean pooling over the attention mask, then L2 normalization."""
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        h = model(**tokens).last_hidden_state
    mask = tokens["attention_mask"].unsqueeze(-1).to(dtype)
    pooled = (h * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=-1)
