"""Tiny models, batches and a plain training loop shared by the training-equivalence tests.

The reference is always the untouched LayerNorm model trained by the same loop from the same θ on
the same batches (and the same dropout masks: both runs re-seed the RNG before every step).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from helpers import add_mean_offsets, perturb_biases, perturb_norms


@dataclass
class Family:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[nn.Module, torch.Generator], dict]


def _lm_batch(vocab: int, seq: int = 12):
    def batch(model, g):
        ids = torch.randint(0, vocab, (2, seq), generator=g)
        return {"input_ids": ids, "labels": ids}

    return batch


def _realistic(model: nn.Module) -> nn.Module:
    perturb_norms(model)
    perturb_biases(model)
    add_mean_offsets(model)
    return model


def gpt2(dropout: float = 0.0, **kw) -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=24, n_layer=2, n_head=3, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **kw)
    return _realistic(transformers.GPT2LMHeadModel(cfg))


def neox(dropout: float = 0.0) -> nn.Module:
    import transformers

    cfg = transformers.GPTNeoXConfig(vocab_size=107, max_position_embeddings=32, hidden_size=24, num_hidden_layers=2,
                                     num_attention_heads=3, intermediate_size=48, use_parallel_residual=True,
                                     hidden_dropout=dropout, attention_dropout=dropout, bos_token_id=0, eos_token_id=0)
    return _realistic(transformers.GPTNeoXForCausalLM(cfg))


def vit(dropout: float = 0.0) -> nn.Module:
    import transformers

    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=24, num_hidden_layers=2,
                                 num_attention_heads=3, intermediate_size=48, num_labels=5,
                                 hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    m = _realistic(transformers.ViTForImageClassification(cfg))
    with torch.no_grad():  # a common offset on every writer of x0
        m.vit.embeddings.cls_token.add_(1.5)
        m.vit.embeddings.position_embeddings.add_(1.0)
        m.vit.embeddings.patch_embeddings.projection.bias.add_(2.0)
    return m


def vit_batch(model, g):
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 5, (2,), generator=g)}


def whisper(dropout: float = 0.0) -> nn.Module:
    import transformers

    cfg = transformers.WhisperConfig(vocab_size=99, num_mel_bins=8, max_source_positions=12, max_target_positions=16,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
                                     begin_suppress_tokens=None, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                     decoder_ffn_dim=48, dropout=dropout, attention_dropout=dropout,
                                     activation_dropout=0.0)
    return _realistic(transformers.WhisperForConditionalGeneration(cfg))


def whisper_batch(model, g):
    return {"input_features": torch.randn(2, 8, 24, generator=g),
            "labels": torch.randint(4, 99, (2, 7), generator=g)}


FAMILIES = {
    "gpt2": Family("gpt2", gpt2, _lm_batch(97)),
    "gpt_neox": Family("gpt_neox", neox, _lm_batch(107)),
    "vit": Family("vit", vit, vit_batch),
    "whisper": Family("whisper", whisper, whisper_batch),
}


def outlier_gpt2() -> nn.Module:
    """GPT-2 whose writers put ×1e3 weight on residual channels 3 and 11 (massive activations)."""
    m = gpt2()
    with torch.no_grad():
        m.transformer.wte.weight[:, [3, 11]] *= 1e3
        m.transformer.wpe.weight[:, [3, 11]] *= 1e3
        for block in m.transformer.h:
            block.attn.c_proj.weight[:, [3, 11]] *= 1e3  # Conv1D (in, out): output channels
            block.mlp.c_proj.weight[:, [3, 11]] *= 1e3
    return m


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    per_step_params: list[dict[str, torch.Tensor]] = field(default_factory=list)


def make_optimizer(kind: str, model: nn.Module):
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return opt, None
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), fused=kind == "adamw_fused")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=20, pct_start=0.25)
    return opt, sched


def train(model: nn.Module, family: Family, optimizer: str = "adamw", steps: int = 20, accumulate: int = 1,
          seed: int = 0, clip: float | None = 1.0, keep_steps: bool = False, dtype=None,
          autocast: bool = False, loss64: bool = False) -> Run:
    """A plain loop: forward, backward (with `accumulate` micro-batches), clip_grad_norm_, step, scheduler."""
    opt, sched = make_optimizer(optimizer, model)
    g = torch.Generator().manual_seed(seed)
    run = Run()
    model.train()
    dtype = dtype or next(model.parameters()).dtype
    for step in range(steps):
        total = 0.0
        for _ in range(accumulate):
            batch = family.batch(model, g)
            if not autocast:
                batch = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}
            torch.manual_seed(1000 * step + _)  # the same dropout masks in both runs
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if loss64:  # HF's loss upcasts logits to float32 only; this one stays float64
                    labels = batch.pop("labels")
                    logits = model(**batch).logits
                    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
                else:
                    loss = model(**batch).loss
                loss = loss / accumulate
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        run.losses.append(total)
        if keep_steps:
            run.per_step_params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (relative to the tensor's scale)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def worst_param_error(a: dict, b: dict) -> tuple[float, str]:
    assert list(a) == list(b)
    errs = [(rel(a[n], b[n]), n) for n in b]
    return max(errs)


def loss_error(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def pair(family: Family, dtype=torch.float64, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    ln = family.build().to(dtype)
    return ln, copy.deepcopy(ln)


class NaiveRMSNorm(nn.Module):
    """The naive swap: RMSNorm with the LayerNorm's γ/β on the uncentred stream."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__()
        self.weight, self.bias, self.eps = ln.weight, ln.bias, ln.eps

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, x.shape[-1:], self.weight, self.eps) + self.bias


def naive_swap(model: nn.Module) -> nn.Module:
    for name, m in list(model.named_modules()):
        for cname, child in list(m.named_children()):
            if isinstance(child, nn.LayerNorm):
                setattr(m, cname, NaiveRMSNorm(child))
    return model
