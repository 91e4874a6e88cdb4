"""Shared description of Post-LN encoders (BERT, RoBERTa, DistilBERT, ELECTRA, ...).

A Post-LN block computes x_{l+1} = LN(x_l + F(x_l)); before block 0 the embedding tables are
summed and normalized. Which LayerNorms can become an *exact* RMSNorm (paper 001 App. B)?

- The embedding LayerNorm: its input is a sum of tables that nothing else reads, so centring every
  table makes that input zero-mean (its output is unchanged, so nothing downstream changes).
- A block LayerNorm, only when the stream x_l entering it is zero-mean by construction; then its
  branch writer F is centred too. x_l is the previous norm's output γ⊙n + β, whose per-token mean
  γ·n/d + mean(β) is zero for every input only if γ is constant across channels and mean(β) = 0.
  That holds by construction only for a norm without elementwise affine (n itself is zero-mean).
  With a learned affine, x_l is also read directly by the next branch (query/key/value or the
  feed-forward input), so it cannot be recentred by editing weights, only by an explicit centring
  that costs what LayerNorm's own centring costs. Such norms stay LayerNorm.
- A head norm after an activation (the MLM "transform" norm) reads a non-zero-mean input: kept.

The plan is structural (it holds for every value of the weights), so it also serves training-time
reparametrization; a norm whose learned γ happens to be constant is still kept.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .base import Adapter, Capabilities, ConversionPlan, KeptNorm, NormSite, StreamPlan, base_prefix, exists, get, join


@dataclass(frozen=True)
class Sublayer:
    """One residual branch of a block: its output projection and the Post-LN norm after the add."""

    writer: str  # relative to the block
    norm: str  # relative to the block
    what: str  # "self-attention", "feed-forward", ... (for the report)


@dataclass(frozen=True)
class HeadNorm:
    """A LayerNorm in a head that reads an activation's output (path and activation from the model root)."""

    path: str
    reads: str


@dataclass(frozen=True)
class PostLNTemplate:
    """A Post-LN encoder, paths relative to the base model (`bert.`, `roberta.`, ...) unless noted.

    `tables`: embedding tables summed into `embedding_norm` (the ones a model lacks are skipped).
    `embedding_readers`: linear layers that alone read the embedding norm's output (ELECTRA's
    `embeddings_project` when embedding_size != hidden_size): the norm's affine folds into them.
    `sublayers`: per block, in execution order; those a block lacks (cross-attention) are skipped.
    """

    tables: tuple[str, ...]
    embedding_norm: str
    layers: str
    sublayers: tuple[Sublayer, ...]
    embedding_readers: tuple[str, ...] = ()
    head_norms: tuple[HeadNorm, ...] = ()

    def plan(self, model: nn.Module, adapter: str) -> ConversionPlan:
        base = base_prefix(model)
        stream = StreamPlan(name="encoder", writers=[join(base, t) for t in self.tables if exists(model, join(base, t))])
        plan = ConversionPlan(adapter=adapter, streams=[stream])
        emb_norm = join(base, self.embedding_norm)
        readers = tuple(join(base, r) for r in self.embedding_readers if exists(model, join(base, r)))
        stream.norms.append(NormSite(emb_norm, readers))
        if readers:
            # The stream is the projection's output, which block 0's branch also reads directly.
            prev, why_not = readers[0], _projection_reason(readers[0])
            zero_mean = False
        else:
            prev, zero_mean = emb_norm, affine_free(get(model, emb_norm))
            why_not = None
        layers = get(model, join(base, self.layers))
        for i in range(len(layers)):
            blk = join(base, self.layers, str(i))
            for sub in self.sublayers:
                norm, writer = join(blk, sub.norm), join(blk, sub.writer)
                if not exists(model, norm):
                    continue
                if zero_mean:
                    stream.writers.append(writer)
                    stream.norms.append(NormSite(norm))  # its output is the stream: the affine stays
                else:
                    plan.kept.append(KeptNorm(norm, why_not or _residual_reason(prev, sub.what)))
                prev, zero_mean, why_not = norm, affine_free(get(model, norm)), None
        for head in self.head_norms:
            if exists(model, head.path):
                plan.kept.append(KeptNorm(head.path, (
                    f"reads the output of the activation {head.reads}, which is not zero-mean; "
                    "RMSNorm would not be exact")))
        plan.notes += _notes(model, plan, join(base, self.tables[0]))
        return plan


def affine_free(norm: nn.Module) -> bool:
    """True for a LayerNorm without elementwise affine: its output n is zero-mean for every input."""
    return getattr(norm, "weight", None) is None and getattr(norm, "bias", None) is None


def _residual_reason(prev: str, what: str) -> str:
    return (f"Post-LN: its input is the {what} branch plus the residual output of {prev}, γ⊙n + β, whose "
            "per-token mean γ·n/d + mean(β) is nonzero for a learned per-channel γ; the next branch reads that "
            "residual directly, so no weight edit can recentre it. RMSNorm would not be exact")


def _projection_reason(proj: str) -> str:
    return (f"Post-LN: its input adds the output of {proj}, which the first block's self-attention also "
            "reads directly, so no weight edit can centre it. RMSNorm would not be exact")


def _notes(model: nn.Module, plan: ConversionPlan, word_table: str) -> list[str]:
    total = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    sites = plan.streams[0].norms
    folded = f"; its affine folds into {', '.join(sites[0].readers)}" if sites[0].readers else ""
    notes = [f"Post-LN encoder: LayerNorms converted to exact RMSNorms: {len(sites)} of {total}: {sites[0].path} "
             f"(its input, the sum of the embedding tables, is made zero-mean by centring them{folded})"
             + (f" and {len(sites) - 1} block norm(s) fed by a norm without affine" if len(sites) > 1 else "")
             + ". The others stay LayerNorm (see kept). A converted norm saves one mean per token: expect "
             "no measurable speed-up."]
    word = get(model, word_table)
    weight = getattr(word, "weight", None)
    if weight is not None:
        tied = [n for n, p in model.named_parameters(remove_duplicate=False)
                if p is weight and not n.startswith(word_table + ".")]
        if tied:
            notes.append(f"{word_table} is tied to {', '.join(tied)}; centring it unties them, so the "
                         "checkpoint stores a second vocabulary x hidden matrix.")
    notes.append("inputs_embeds passed by the caller must be rows of the (centred) word table.")
    return notes


def post_ln_adapter(name: str, display_name: str, template: PostLNTemplate, **kwargs) -> Adapter:
    return Adapter(name=name, display_name=display_name, plan=lambda model: template.plan(model, name),
                   example_inputs=encoder_inputs,
                   capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True, post_ln=True), **kwargs)


# ---- example inputs ---------------------------------------------------------------------------

def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def encoder_inputs(model: nn.Module, generator: torch.Generator, batch: int = 2, seq: int = 12) -> dict:
    """Token ids avoiding the pad id, both token types, and a padded second row (attention mask).

    Multiple-choice heads get (batch, 3 choices, seq) tensors."""
    cfg = model.config
    pad = getattr(cfg, "pad_token_id", None)
    # RoBERTa-style positions start after the pad id: leave room for them.
    seq = max(4, min(seq, cfg.max_position_embeddings - (pad or 0) - 2))
    shape = (batch, 3, seq) if type(model).__name__.endswith("ForMultipleChoice") else (batch, seq)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=generator)
    if pad is not None:
        ids = torch.where(ids == pad, (ids + 1) % cfg.vocab_size, ids)
    mask = torch.ones(shape, dtype=torch.long)
    mask[1, ..., seq - 3:] = 0
    if pad is not None:
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
    inputs = {"input_ids": ids, "attention_mask": mask}
    if _accepts(model, "token_type_ids") and getattr(cfg, "type_vocab_size", 1) > 1:
        types = torch.zeros(shape, dtype=torch.long)
        types[..., seq // 2:] = 1
        inputs["token_type_ids"] = types
    return inputs
