"""Readable Pre-LN ViT and GPT models for the end-to-end benchmark (paper 001 §4, Table 2), and
their norm variants obtained by converting the LayerNorm model with normfold's own algebra.

    ln = build(VIT_SIZES["tiny"])                 # Pre-LN, random weights
    models = variants(ln)                   # {'layernorm', 'rmsnorm', 'crmsnorm', 'no-norm'}

'rmsnorm' is `normfold.convert(ln, adapter=adapter_for(ln))` (zero-mean stream, block norms' affines
folded into their readers, the final norm keeps its affine, LayerNorm -> normfold.nn.RMSNorm);
'crmsnorm' folds the final norm into the head as well, then keeps the first d−1
coordinates of the zero-mean stream (writers drop their last output, readers W ← W[:d−1] − W[d−1],
RMSNorm -> normfold.nn.CRMSNorm); both compute the same function as 'layernorm'. 'no-norm' drops
the norms: a different function, timed only as the floor that no norm implementation can beat.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import algebra
from ..adapters import BlockTemplate, StreamTemplate, template_adapter
from ..adapters.base import get, parent_and_leaf
from ..errors import UnsupportedConversionError
from ..nn import CRMSNorm, RMSNorm

VARIANTS = ("no-norm", "layernorm", "rmsnorm", "crmsnorm")
LABELS = {"no-norm": "no norm", "layernorm": "Pre-LN", "rmsnorm": "Pre-RMS", "crmsnorm": "Pre-CRMS"}


# ---- sizes -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ViTConfig:
    """A Vision Transformer of paper 001 Table 2 (224×224 RGB in, 1000 classes out)."""

    name: str
    dim: int
    depth: int
    heads: int
    mlp: int
    patch: int
    image: int = 224
    classes: int = 1000
    family: str = "vit"

    def inputs(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(batch, 3, self.image, self.image, generator=generator)

    def tokens(self) -> int:
        return (self.image // self.patch) ** 2 + 1


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-3 size of paper 001 §4.2 (Brown et al. 2020, Table 2.1), learned positions, vocab 50257."""

    name: str
    dim: int
    depth: int
    heads: int
    mlp: int
    seq: int = 512
    vocab: int = 50257
    context: int = 2048
    family: str = "gpt"

    def inputs(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.vocab, (batch, self.seq), generator=generator)

    def tokens(self) -> int:
        return self.seq


VIT_SIZES = {
    "tiny": ViTConfig("ViT-Ti/16", 192, 12, 3, 192 * 4, 16),
    "small": ViTConfig("ViT-S/16", 384, 12, 6, 384 * 4, 16),
    "base": ViTConfig("ViT-B/16", 768, 12, 12, 768 * 4, 16),
    "large": ViTConfig("ViT-L/16", 1024, 24, 16, 1024 * 4, 16),
    "huge": ViTConfig("ViT-H/14", 1280, 32, 16, 1280 * 4, 14),
}
GPT3_SIZES = {
    "small": GPTConfig("GPT-3 Small", 768, 12, 12, 768 * 4),
    "medium": GPTConfig("GPT-3 Medium", 1024, 24, 16, 1024 * 4),
}
CONFIGS = {**{f"vit-{k}": v for k, v in VIT_SIZES.items()}, **{f"gpt3-{k}": v for k, v in GPT3_SIZES.items()}}


# ---- modules -------------------------------------------------------------------------------------------

class Attention(nn.Module):
    """Multi-head self-attention. `width` is the residual stream's width (d, or d−1 compressed);
    the attention itself always works in `dim` = d."""

    def __init__(self, width: int, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(width, 3 * dim)
        self.proj = nn.Linear(dim, width)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, cfg, causal: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.dim, cfg.heads, causal)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg.dim, cfg.mlp)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.config = cfg
        n = (cfg.image // cfg.patch) ** 2
        self.patch_embed = nn.Conv2d(3, cfg.dim, cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg, causal=False) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.context, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, causal=True) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build(cfg, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The Pre-LN model with random weights (std 0.02) and random LayerNorm affines, in eval mode.
    The affines are random so that folding them is actually exercised."""
    torch.manual_seed(seed)
    model = (ViT if cfg.family == "vit" else GPT)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm" in f".{name}" and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias") or ".norm" in f".{name}":
                p.copy_(0.02 * torch.randn_like(p))
            else:
                p.normal_(0, 0.02)
    return model.to(dtype).eval()


# ---- conversions ------------------------------------------------------------------------------------------

def adapter_for(model: nn.Module):
    """The residual-stream description of these models, for `normfold.convert(..., adapter=...)`."""
    sources = ("patch_embed", "cls_token", "pos_embed") if isinstance(model, ViT) else ("wte", "wpe")
    stream = StreamTemplate(
        name="residual", sources=sources, layers="blocks",
        block=BlockTemplate(norms=(("norm1", ("attn.qkv",)), ("norm2", ("mlp.fc1",))),
                            writers=("attn.proj", "mlp.fc2")),
        final_norm="norm", final_readers=("head",))
    return template_adapter(f"bench-{type(model).__name__.lower()}", f"bench {type(model).__name__}", stream,
                            model_classes=(type(model).__name__,))


def to_rmsnorm(ln_model: nn.Module, fold_final: bool = False) -> nn.Module:
    """Pre-LN -> Pre-RMSNorm through normfold's converter with its defaults (what `normfold convert`
    gives users): block norms' affines folded into their readers, the final norm keeps γ/β. With
    fold_final=True the final norm is folded into the head too, which gives a bias-free head a new
    bias: an extra pass over the logits (measured 4% slower end-to-end for GPT-3 Small in bf16)."""
    from ..conversion import convert

    model, _ = convert(ln_model, to="rmsnorm", adapter=adapter_for(ln_model), verify=False,
                       fold_final=fold_final, allow_new_bias=fold_final)
    return model


def _set_param(owner: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(owner, name)
    setattr(owner, name, nn.Parameter(value.contiguous(), requires_grad=old.requires_grad))


def _compress_writer(model: nn.Module, path: str) -> None:
    obj = get(model, path)
    if isinstance(obj, nn.Parameter):
        parent, leaf = parent_and_leaf(model, path)
        _set_param(parent, leaf, obj.detach()[..., :-1])
        return
    lay = algebra.layout_of(obj)
    bias = getattr(obj, lay.bias, None) if lay.bias else None
    new_w, new_b = algebra.compress_writer(getattr(obj, lay.weight), bias, lay.out_dim)
    _set_param(obj, lay.weight, new_w)
    if bias is not None:
        _set_param(obj, lay.bias, new_b)
    for attr in ("out_features", "out_channels", "embedding_dim"):  # keep the repr honest
        if hasattr(obj, attr):
            setattr(obj, attr, getattr(obj, attr) - 1)


def _compress_reader(model: nn.Module, path: str) -> None:
    obj = get(model, path)
    lay = algebra.layout_of(obj)
    _set_param(obj, lay.weight, algebra.compress_reader(getattr(obj, lay.weight), lay.in_dim))
    obj.in_features -= 1


def to_crmsnorm(rms_model: nn.Module) -> nn.Module:
    """Pre-RMSNorm (all affines folded) -> Pre-CRMSNorm on the d−1 stream (paper 001 §3.2)."""
    model = copy.deepcopy(rms_model)
    plan = adapter_for(model).plan(model)
    for stream in plan.streams:
        for path in stream.writers:
            _compress_writer(model, path)
        for site in stream.norms:
            norm = get(model, site.path)
            if not isinstance(norm, RMSNorm) or norm.weight is not None or norm.bias is not None:
                raise UnsupportedConversionError(f"{site.path}: CRMSNorm compression needs an RMSNorm whose "
                                                 "affine was folded into its readers")
            for reader in site.readers:
                _compress_reader(model, reader)
            p = next(model.parameters())
            parent, leaf = parent_and_leaf(model, site.path)
            setattr(parent, leaf, CRMSNorm(norm.normalized_shape[0] - 1, eps=norm.eps, weight=False,
                                           device=p.device, dtype=p.dtype))
    return model.eval()


def without_norms(ln_model: nn.Module) -> nn.Module:
    """The floor: every LayerNorm replaced by the identity (not the same function)."""
    model = copy.deepcopy(ln_model)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.LayerNorm):
            parent, leaf = parent_and_leaf(model, name)
            setattr(parent, leaf, nn.Identity())
    return model.eval()


def variants(ln_model: nn.Module) -> dict[str, nn.Module]:
    """All four variants of `ln_model`, in VARIANTS order."""
    # CRMS needs every affine folded (its readers see the compressed, zero-mean normalized vector).
    built = {"no-norm": without_norms(ln_model), "layernorm": ln_model, "rmsnorm": to_rmsnorm(ln_model),
             "crmsnorm": to_crmsnorm(to_rmsnorm(ln_model, fold_final=True))}
    return {k: built[k] for k in VARIANTS}


def stream_width(model: nn.Module) -> int:
    """Width of the residual stream entering the first block."""
    first = model.blocks[0].attn.qkv
    return first.weight.shape[1]
