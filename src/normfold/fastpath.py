"""Runtime fast paths for converted models (issue 24): exact rewrites of how a loaded model computes,
never of what it computes or of what its checkpoint holds.

`apply(model)` is what `normfold.load` runs (`normfold.load(path, fast=False)` skips it):

- **Padded writers on the d−1 stream** (Pre-CRMS). The linear layers that write the compressed
  residual stream have d−1 outputs (767 for GPT-2 small, 383 for ViT-S). A float32 GEMM with such an
  odd output width ran 1.11–1.22× the time of the d-wide one on the 2-vCPU EPYC (oneDNN / MKL, 197 or
  256 rows; bfloat16 1.00), so each writer's weight (and bias) is moved into a d-wide buffer whose
  last output is zero; the parameter stays the (d−1)-wide view of it, in place (the state dict,
  `normfold.save`, optimizers and `load_state_dict` see the same tensor as before), and the forward
  multiplies by the padded buffer and returns the first d−1 columns (a view: the residual add reads
  it in place). Measured: 1.03× the d-wide GEMM + add instead of 1.11–1.17×. It runs only where no
  gradient reaches the weight and not under torch.compile / torch.export (there the plain module
  runs), and only while the parameter still lives in that buffer (its data pointer is checked each
  call: `model.to(dtype)` or a reassigned `.data` silently falls back to the plain path).
  Families: GPT-2 (HF `Conv1D`) and ViT / DeiT (`nn.Linear`), whose blocks only add the writer's
  output to the stream; float32 (and float64) only: in bfloat16 the d−1 GEMMs were not slower.
- **Residual add fused with the next norm** inside transformers' `GPT2Block` and `ViTLayer`
  (Liger-Kernel's pattern: the block's class is swapped for a subclass of the same name whose forward
  is transformers' own with `h = attn + residual; norm(h)` replaced by one call
  `residual, h = norm(attn, residual)`; normfold's RMSNorm / CRMSNorm take that optional residual and
  run `normfold.ops.add_rms_norm` / `add_crms_norm`: one pass, differentiable, torch.compile and
  torch.export run the registered custom op or the reference formula). Decode-sized inputs
  (≤ LN_ROUTE_MAX_NUMEL) keep the unfused pair, so `generate()` takes the same route as unfused.
  Exact: float64 ≤ 1e-12 against the unfused model (tests/test_fastpath.py). The block's MLP add is
  not fused with the next block's norm (that would change the block's output contract).

`normfold.convert(..., fast=True)` applies the same (and `refresh` after a reverse conversion);
`strip(model)` removes everything.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .nn import CRMSNorm, RMSNorm

# model_type values whose stream writers' outputs are only ever added to the stream (a strided view
# is fine there); other families keep the plain writers until checked.
PADDED_WRITER_FAMILIES = frozenset({"gpt2", "vit", "deit"})
# where padding was measured to pay: float32 (1.11-1.22x -> 1.03x); bfloat16 GEMMs of width d-1 ran at
# 0.99-1.01x the d-wide ones, so there the strided add would only cost. float64: tests (exactness).
PADDED_DTYPES = frozenset({torch.float32, torch.float64})

_PAD_W = "_normfold_padded_weight"
_PAD_B = "_normfold_padded_bias"


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _out_dim(module: nn.Module) -> int | None:
    """Which axis of `module.weight` is its output (0 for nn.Linear, 1 for HF Conv1D)."""
    if isinstance(module, nn.Linear):
        return 0
    if _is_conv1d(module):
        return 1
    return None


def _padded_ok(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """The padded (weight, bias) when the fast path may run on this call, else None."""
    pw = module.__dict__.get(_PAD_W)
    if pw is None or _compiling():
        return None
    w = module.weight
    if (torch.is_grad_enabled() and w.requires_grad) or w.data_ptr() != pw.data_ptr() or w.dtype is not pw.dtype \
            or x.dtype is not pw.dtype or x.device != pw.device:
        return None
    pb = module.__dict__.get(_PAD_B)
    b = module.bias
    if b is None:
        return pw, None
    if pb is None or b.data_ptr() != pb.data_ptr() or b.dtype is not pb.dtype or \
            (torch.is_grad_enabled() and b.requires_grad):
        return None
    return pw, pb


class PaddedLinear(nn.Linear):
    """An nn.Linear whose (d−1)-row weight lives in a d-row buffer (see the module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        padded = _padded_ok(self, x)
        if padded is None:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, padded[0], padded[1])[..., :-1]


_CONV1D_CLASSES: dict[type, type] = {}


def _padded_conv1d_class(base: type) -> type:
    cls = _CONV1D_CLASSES.get(base)
    if cls is None:
        def forward(self, x: Tensor) -> Tensor:
            padded = _padded_ok(self, x)
            if padded is None:
                return base.forward(self, x)
            pw, pb = padded
            size_out = x.size()[:-1] + (pw.shape[1],)
            x2 = x.reshape(-1, x.size(-1))
            out = torch.mm(x2, pw) if pb is None else torch.addmm(pb, x2, pw)
            return out.view(size_out)[..., :-1]

        # the same __name__ as the base: code that recognizes HF's Conv1D by name (fix_shape_attrs,
        # adapters) must still see one
        cls = type(base.__name__, (base,), {"forward": forward, "__module__": __name__,
                                            "__qualname__": f"padded.{base.__name__}",
                                            "__doc__": "HF Conv1D with a padded weight buffer."})
        _CONV1D_CLASSES[base] = cls
    return cls


def pad_writer(module: nn.Module) -> bool:
    """Move a stream writer's (d−1)-wide output weight/bias into a d-wide zero-padded buffer, in place
    (the parameters become views of it). Returns False (nothing changed) for other module types."""
    axis = _out_dim(module)
    if axis is None or module.__dict__.get(_PAD_W) is not None or module.weight.dtype not in PADDED_DTYPES:
        return False
    w = module.weight
    shape = list(w.shape)
    shape[axis] += 1
    with torch.no_grad():
        pw = torch.zeros(shape, dtype=w.dtype, device=w.device)
        view = pw[:-1] if axis == 0 else pw[:, :-1]
        view.copy_(w)
        module.weight = nn.Parameter(view, requires_grad=w.requires_grad)
        module.__dict__[_PAD_W] = pw
        b = module.bias
        if b is not None:
            pb = torch.zeros(b.shape[0] + 1, dtype=b.dtype, device=b.device)
            pb[:-1].copy_(b)
            module.bias = nn.Parameter(pb[:-1], requires_grad=b.requires_grad)
            module.__dict__[_PAD_B] = pb
    module.__class__ = PaddedLinear if axis == 0 else _padded_conv1d_class(type(module))
    return True


def is_padded(module: nn.Module) -> bool:
    """Whether `module` runs from a padded buffer (pad_writer applied)."""
    return module.__dict__.get(_PAD_W) is not None


def stream_writers(model: nn.Module) -> list[nn.Module]:
    """The linear layers writing a compressed (d−1) residual stream: those whose output width is the
    compressed width of a StreamCRMSNorm in the model (none in an uncompressed or padded model)."""
    # the compressed stream's norms (StreamCRMSNorm) are CRMSNorms that know the uncompressed width d
    widths = {m.width - 1 for m in model.modules()
              if isinstance(m, CRMSNorm) and isinstance(getattr(m, "width", None), int) and not getattr(m, "pad", True)}
    out = []
    for m in model.modules():
        axis = _out_dim(m)
        if axis is not None and isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2 \
                and m.weight.shape[axis] in widths:
            out.append(m)
    return out


def pad_writers(model: nn.Module) -> int:
    """Pad every compressed-stream writer of a supported family (PADDED_WRITER_FAMILIES). Returns
    how many were padded."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in PADDED_WRITER_FAMILIES:
        return 0
    return sum(pad_writer(m) for m in stream_writers(model))


# ---- residual add fused with the next norm, inside the blocks (Liger-Kernel's pattern) ----------------

_NORMS = (RMSNorm, CRMSNorm)  # normfold's norms: forward(x, residual) returns (x + residual, norm(x + residual))


def _fusable(norm: nn.Module) -> bool:
    """A normfold stream norm whose forward takes the fused `residual` argument and runs it fused: RMSNorm,
    CRMSNorm, and the compressed stream's CRMSNorm (normfold.compress.runtime.StreamCRMSNorm, recognized
    by its `width` / `pad` / `decompress` attributes: this module sits below compress) when it neither pads
    nor decompresses."""
    if not isinstance(norm, _NORMS):
        return False
    if hasattr(norm, "width"):
        return not getattr(norm, "pad", True) and not getattr(norm, "decompress", True)
    return type(norm) in (RMSNorm, CRMSNorm)


def is_fused(block: nn.Module) -> bool:
    """Whether fuse_block has been applied to `block`."""
    return bool(getattr(type(block), _FUSED_MARK, False))


def _gpt2_block_forward(base):
    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):
        if encoder_hidden_states is not None:  # cross-attention blocks: transformers' own code
            return base.forward(self, hidden_states, cache=cache, attention_mask=attention_mask,
                                encoder_hidden_states=encoder_hidden_states,
                                encoder_attention_mask=encoder_attention_mask, use_cache=use_cache, **kwargs)
        if not isinstance(self.ln_2, _NORMS):  # converted back to LayerNorm since it was fused
            return base.forward(self, hidden_states, cache=cache, attention_mask=attention_mask,
                                use_cache=use_cache, **kwargs)
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, _ = self.attn(hidden_states, cache=cache, attention_mask=attention_mask, use_cache=use_cache,
                                   **kwargs)
        residual, hidden_states = self.ln_2(attn_output, residual)  # attn_output + residual, then ln_2
        return residual + self.mlp(hidden_states)
    return forward


def _vit_layer_forward(base):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if not isinstance(self.layernorm_after, _NORMS):
            return base.forward(self, hidden_states, attention_mask, **kwargs)
        residual = hidden_states
        hidden_states = self.layernorm_before(hidden_states)
        hidden_states, _ = self.attention(hidden_states, attention_mask, **kwargs)
        hidden_states = self.dropout(hidden_states)
        residual, hidden_states = self.layernorm_after(hidden_states, residual)  # + residual, then the norm
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return hidden_states + residual
    return forward


# block class name -> (its transformers module, the norm that reads the fused sum, forward factory,
# the forward's parameters the patch was written against). The patched forwards are transformers 5's
# GPT2Block / ViTLayer forwards with the first residual add moved into that norm; a transformers whose
# forward takes other parameters keeps its own code.
FUSED_BLOCKS = {
    "GPT2Block": ("transformers.models.gpt2.modeling_gpt2", "ln_2", _gpt2_block_forward,
                  ("self", "hidden_states", "cache", "attention_mask", "encoder_hidden_states",
                   "encoder_attention_mask", "use_cache", "kwargs")),
    "ViTLayer": ("transformers.models.vit.modeling_vit", "layernorm_after", _vit_layer_forward,
                 ("self", "hidden_states", "attention_mask", "kwargs")),
}
_FUSED_CLASSES: dict[type, type] = {}
_FUSED_MARK = "_normfold_fused_block"


def fuse_block(block: nn.Module) -> bool:
    """Swap `block`'s class for a subclass (same name) whose forward fuses the residual add with the
    next norm, when the block is of a supported family and that norm is a normfold stream norm."""
    spec = FUSED_BLOCKS.get(type(block).__name__)
    if spec is None or getattr(block, _FUSED_MARK, False) or type(block).__module__ != spec[0] \
            or not _fusable(getattr(block, spec[1], None)):
        return False
    base = type(block)
    cls = _FUSED_CLASSES.get(base)
    if cls is None:
        if tuple(inspect.signature(base.forward).parameters) != spec[3]:
            return False
        cls = type(base.__name__, (base,), {"forward": spec[2](base), "__module__": __name__,
                                            "__qualname__": f"fused.{base.__name__}", _FUSED_MARK: True})
        _FUSED_CLASSES[base] = cls
    block.__class__ = cls
    return True


def unfuse_block(block: nn.Module) -> bool:
    """Undo fuse_block (the block gets its transformers class back)."""
    if not getattr(type(block), _FUSED_MARK, False):
        return False
    block.__class__ = type(block).__mro__[1]
    return True


def fuse_blocks(model: nn.Module) -> int:
    return sum(fuse_block(m) for m in list(model.modules()))


def unpad_writer(module: nn.Module) -> bool:
    """Undo pad_writer: the parameters become tensors of their own again, the class transformers'."""
    if not is_padded(module):
        return False
    with torch.no_grad():
        for name, key in (("weight", _PAD_W), ("bias", _PAD_B)):
            buf, p = module.__dict__.pop(key, None), getattr(module, name, None)
            if buf is not None and isinstance(p, nn.Parameter) and p.data_ptr() == buf.data_ptr():
                setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
    cls = type(module)
    if cls is PaddedLinear or cls in _CONV1D_CLASSES.values():
        module.__class__ = cls.__mro__[1]
    return True


def strip(model: nn.Module) -> dict:
    """Remove every fast path (the model's modules get their transformers classes back)."""
    mods = list(model.modules())
    return {"padded_writers": sum(unpad_writer(m) for m in mods), "fused_blocks": sum(unfuse_block(m) for m in mods)}


def refresh(model: nn.Module, fast: bool = True) -> dict:
    """strip, then apply where it still fits (after a conversion changed the model's norms or shapes)."""
    strip(model)
    return apply(model) if fast else {"padded_writers": 0, "fused_blocks": 0}


def apply(model: nn.Module, *, fuse: bool = True, pad: bool = True) -> dict:
    """Every runtime fast path that applies to `model` (in place). Returns what was done."""
    return {"padded_writers": pad_writers(model) if pad else 0, "fused_blocks": fuse_blocks(model) if fuse else 0}
