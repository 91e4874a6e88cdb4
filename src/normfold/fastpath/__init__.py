"""Runtime fast paths for converted models: exact rewrites of how a loaded model computes,
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
- **Residual add fused with the next norm** inside transformers' blocks (`families/`: GPT-2, GPT-Neo,
  OPT Pre-LN, BLOOM, GPT-NeoX and Falcon with a sequential residual, GPT-BigCode, ViT, DeiT, DINOv2,
  CLIP / SigLIP / SigLIP2, Whisper and mBART encoder and decoder) (Liger-Kernel's pattern: the block's class is swapped for a subclass of the same name whose forward
  is transformers' own with `h = attn + residual; norm(h)` replaced by one call
  `residual, h = norm(attn, residual)`; normfold's RMSNorm / CRMSNorm take that optional residual and
  run `normfold.ops.add_rms_norm` / `add_crms_norm`: one pass, differentiable, torch.compile and
  torch.export run the registered custom op or the reference formula). Decode-sized inputs
  (≤ LN_ROUTE_MAX_NUMEL) keep the unfused pair, so `generate()` takes the same route as unfused.
  Exact: float64 ≤ 1e-12 against the unfused model (tests/test_fastpath.py, tests/fastpath/).
- **Cross-block hand-off** (`handoff.py`): the add at the END of a block (GPT-2, ViT, GPT-J, Phi,
  GPT-NeoX and Falcon, sequential and parallel: in parallel blocks it is the only add) runs the next
  norm's fused op; the block still returns the sum, and the next norm (next block's first norm, or
  the final norm), called with exactly that tensor, unchanged, returns the stashed result. Anything
  else falls back to the plain path. Links: `handoff.Stack` (layer list + final norm per model class)
  and `FusedBlock.entry`; kept outside `_modules`.

`normfold.convert(..., fast=True)` applies the same (and `refresh` after a reverse conversion);
`strip(model)` removes everything.

Layout: `padded.py` (the padded writers), `blocks.py` (the fused-block registry: a `FusedBlock` dataclass
per transformers block class), `families/` (one module per family defining its blocks, `BLOCKS`, and
hand-off stacks, `STACKS`; the family registry, normfold.adapters.families, names them and importing
`families` registers them).
"""

from __future__ import annotations

from torch import nn

from ..nn.tied import pack_tied_heads, unpack_tied_heads

from . import families  # noqa: F401  (registers the fused blocks of every family in the family registry)
from . import handoff
from .blocks import FUSED_BLOCKS, FusedBlock, fusable, fuse_block, fuse_blocks, is_fused, register, unfuse_block
from .padded import (PADDED_DTYPES, PADDED_WRITER_FAMILIES, PaddedLinear, is_padded, pad_writer, pad_writers,
                     stream_writers, unpad_writer)

__all__ = ["FUSED_BLOCKS", "handoff", "FusedBlock", "PADDED_DTYPES", "PADDED_WRITER_FAMILIES", "PaddedLinear", "apply",
           "fusable", "fuse_block", "fuse_blocks", "is_fused", "is_padded", "pad_writer", "pad_writers", "refresh",
           "register", "stream_writers", "strip", "unfuse_block", "unpad_writer"]


def strip(model: nn.Module) -> dict:
    """Remove every fast path (the model's modules get their transformers classes back)."""
    handoffs = handoff.unlink(model)
    mods = list(model.modules())
    return {"padded_writers": sum(unpad_writer(m) for m in mods), "fused_blocks": sum(unfuse_block(m) for m in mods),
            "handoffs": handoffs, "packed_tied_heads": unpack_tied_heads(model)}


def refresh(model: nn.Module, fast: bool = True) -> dict:
    """strip, then apply where it still fits (after a conversion changed the model's norms or shapes)."""
    strip(model)
    return apply(model) if fast else {"padded_writers": 0, "fused_blocks": 0, "handoffs": 0, "packed_tied_heads": 0}


def apply(model: nn.Module, *, fuse: bool = True, pad: bool = True) -> dict:
    """Every runtime fast path that applies to `model` (in place). Returns what was done."""
    out = {"padded_writers": pad_writers(model) if pad else 0, "fused_blocks": fuse_blocks(model) if fuse else 0}
    out["handoffs"] = handoff.link(model) if fuse else 0
    # tied heads: one GEMM over [E' | μ | μ | 0…] where measured to pay (normfold.nn.TiedHead.pack)
    out["packed_tied_heads"] = pack_tied_heads(model)
    return out
