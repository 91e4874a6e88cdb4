"""Cross-block hand-off: the residual add at the END of a block fused with the norm
that reads its sum next (the next block's first norm, or the model's final norm after the last block).

A block's output contract stays: it returns s = delta + residual. What changes is how the sum is
formed: a linked block calls `add(self, delta, residual)`, which runs the next norm's fused op
(`ops.add_rms_norm` / `add_crms_norm`, one pass) with that norm's weights, returns s, and leaves
n = norm(s) in the norm's stash. When the norm is next called with exactly that tensor (`x is s`,
s's version counter unchanged, the same grad / inference mode, its weight and bias the same tensors
at the same versions), it returns the stashed n instead of recomputing it; the module is still
called, so its hooks run. Anything else falls back to the plain path (the norm recomputes from x),
so the model computes what the unfused model computes:

- a different tensor (a hook that returns a new output, a norm called with another input) or an
  in-place change of s (its version counter moves; views share it) → plain;
- torch.compile / torch.export / torch.jit.trace, tensor subclasses (FakeTensor, DTensor, fx Proxy)
  → no stash is made, the plain add runs (export graphs are those of the unfused blocks);
- a gradient is needed (grad mode on and any input or the norm's weight requires grad) → the plain
  add: with the hand-off, n's graph goes to delta and residual directly, not through s, so a gradient
  taken with respect to s (output_hidden_states attribution, s.retain_grad(), tensor hooks on s)
  would miss the norm's path. Training keeps the within-block fusion (normfold.train);
- decode-sized sums (≤ LN_ROUTE_MAX_NUMEL elements) → the plain add, so generate()'s decode steps
  take the same route as the unfused model (and pay no stash bookkeeping); float32 sums below
  FLOAT32_MIN_NUMEL too (a speed choice, see there: ViT-S/16 at batch 1, 197×384, stays plain in
  float32);
- inference tensors (torch.inference_mode) carry no version counter, so an in-place change cannot
  be seen on them: by default (`INFERENCE_TENSORS = False`) inference_mode takes the plain path, so
  the result never depends on how a model is called (torch.no_grad keeps the hand-off: its tensors
  have version counters). `INFERENCE_TENSORS = True` opts in under inference_mode too: a stash is then
  made only while no module forward hook of the producing block, no forward pre-hook of the next
  block or of the norm, and no global module forward (pre-)hook is registered (hooks are how code
  runs between a block and the next norm inside a model's forward), and code that calls a linked
  block by hand, changes its output in place and then calls the linked norm by hand with it would
  get the stale n.

Links (block → norm) are found by walking each registered model's layer list (`Stack`: the layer
list's and the final norm's attribute paths; each FusedBlock names its `entry` norm, the one that
first reads the block's input) and stored in the block's `__dict__` (not `_modules`): state_dict,
named_modules and `normfold.save` do not see them, deepcopy of the whole model maps them to the
copy's norms. The stash is an object whose deepcopy / pickle is an empty stash.

Memory: a pending stash holds n (one activation) from the block's return to the norm's call; one that
is never taken (a layer loop that stops early, a norm that is not called) holds it until the next
forward replaces it or `strip` removes the stash. s itself is held only weakly.

Speed (2-vCPU EPYC, one thread, CPU time, the pair alone: add + norm vs hand-off + stashed norm):
the fused op saves a pass over memory, the bookkeeping (checks, weakref, the second call's lookup)
costs about 4 µs a block; float32 197×384 30.6 vs 34.4 µs (a loss: below FLOAT32_MIN_NUMEL),
256×768 66.3 vs 63.7, 1024×768 334.7 vs 324.1; bfloat16 197×384 31.8 vs 31.7, 256×768 70.1 vs 58.7,
1024×768 247.2 vs 199.6. In whole models that is under 1 % (the norms are 1–3 % of a forward there).

Why not patch the model's layer loop instead (`for block in h: s, n = block(n, s)`)? That means
copying each family's whole model-level forward (masks, caches, position embeddings, output
collection: far more transformers code per family than one block's last line, and more of it changes
between releases), a different block calling convention that hooks on blocks and any code calling a
block directly would see, and one patch per model class rather than per block. The hand-off keeps
transformers' model code and the blocks' contract and degrades to the plain path by itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from .. import ops
from ..nn import CRMSNorm, RMSNorm
from ..ops.registry import LN_ROUTE_MAX_NUMEL

INFERENCE_TENSORS = False  # True: hand off under torch.inference_mode too (see the module docstring)
# float32 sums below this many elements add plainly: there the fused op saves less than the hand-off's
# Python bookkeeping costs (about 4 µs a block on the 2-vCPU EPYC, one thread, CPU time: add + norm vs
# hand-off, 197×384 float32 30.6 vs 34.4 µs, 256×768 66.3 vs 63.7, 1024×768 334.7 vs 324.1; bfloat16
# 31.8 vs 31.7, 70.1 vs 58.7, 247.2 vs 199.6)
FLOAT32_MIN_NUMEL = 131072

_LINK = "_normfold_handoff_link"  # in a block's __dict__: _Link
_STASH = "_normfold_handoff"  # in a norm's __dict__: _Stash (read by RMSNorm / CRMSNorm.forward)
TARGETS = (RMSNorm, CRMSNorm)  # their forward reads the stash (see _target)


@dataclass(frozen=True)
class Stack:
    """A model class whose layer list hands off: `layers` (attribute path of the nn.ModuleList) and
    `final` (attribute path of the norm applied to the last layer's output)."""

    class_name: str
    module: str
    layers: str
    final: str


STACKS: dict[str, Stack] = {}


def register_stack(spec: Stack) -> Stack:
    if spec.class_name in STACKS:
        raise ValueError(f"a hand-off stack for {spec.class_name} is already registered")
    STACKS[spec.class_name] = spec
    return spec


class _Stash:
    """The pending (s, n) of one norm. Empty when deep-copied or pickled. `hits` / `misses` count
    the norm calls that used / could not use a pending stash (tests, diagnostics)."""

    __slots__ = ("ref", "n", "key", "hits", "misses")

    def __init__(self) -> None:
        self.ref = self.n = self.key = None
        self.hits = self.misses = 0

    def __deepcopy__(self, memo):
        return _Stash()

    def __reduce__(self):
        return (_Stash, ())

    def take(self, norm: nn.Module, x: Tensor) -> Tensor | None:
        """The stashed norm(x) when it is exactly that (called by RMSNorm / CRMSNorm.forward)."""
        ref, n, key = self.ref, self.n, self.key
        self.ref = self.n = self.key = None  # one use
        if ref is None:
            return None
        if ref() is not x or torch.compiler.is_compiling():
            self.misses += 1
            return None
        w, b = norm._affine()
        if _key(x, w, b) != key:
            self.misses += 1
            return None
        self.hits += 1
        return n


class _Link:
    """block → the norm that reads its output, as `owner._modules[attr]` (looked up on each call: a norm
    replaced after linking has no stash, so the block adds plainly); `watch`: the next block (its
    forward pre-hooks run in between)."""

    def __init__(self, owner: nn.Module, attr: str, watch: tuple[nn.Module, ...]) -> None:
        self.owner, self.attr, self.watch = owner, attr, watch


def _key(x: Tensor, w, b):
    return (None if x.is_inference() else x._version, torch.is_grad_enabled(),
            None if w is None else (id(w), w._version), None if b is None else (id(b), b._version))


def _hooked(block: nn.Module, link: _Link, norm: nn.Module) -> bool:
    if block._forward_hooks or norm._forward_pre_hooks or _module._global_forward_hooks \
            or _module._global_forward_pre_hooks:
        return True
    return any(m._forward_pre_hooks for m in link.watch)


def add(block: nn.Module, delta: Tensor, residual: Tensor) -> Tensor:
    """delta + residual (the block's last add), formed by the linked norm's fused op when it may be."""
    link = None if torch.compiler.is_compiling() else block.__dict__.get(_LINK)  # compile / export: plain
    if link is None or type(delta) is not Tensor or type(residual) is not Tensor or torch.jit.is_tracing() \
            or (not INFERENCE_TENSORS and (delta.is_inference() or residual.is_inference())):
        return delta + residual  # (inference tensors: see below; checked first, inference_mode is the usual case)
    numel = delta.numel()
    if numel <= LN_ROUTE_MAX_NUMEL or (delta.dtype is torch.float32 and numel < FLOAT32_MIN_NUMEL) \
            or delta.dtype != residual.dtype or delta.shape != residual.shape:
        return delta + residual
    norm = link.owner._modules.get(link.attr)
    stash = None if norm is None else norm.__dict__.get(_STASH)
    if stash is None or delta.shape[-1] != norm.normalized_shape[0]:
        return delta + residual
    w, b = norm._affine()
    if torch.is_grad_enabled() and (delta.requires_grad or residual.requires_grad
                                    or (w is not None and w.requires_grad) or (b is not None and b.requires_grad)):
        return delta + residual
    if (delta.is_inference() or residual.is_inference()) and (not INFERENCE_TENSORS or _hooked(block, link, norm)):
        return delta + residual
    op = ops.add_crms_norm if isinstance(norm, CRMSNorm) else ops.add_rms_norm
    s, n = op(delta, residual, w, b, norm.eps)
    stash.ref, stash.n, stash.key = weakref.ref(s), n, _key(s, w, b)
    return s


def _entry(block: nn.Module) -> str | None:
    """The attribute name of the norm that first reads `block`'s input (FusedBlock.entry)."""
    from .blocks import spec_of
    spec = spec_of(block)
    for name in (spec.entry if spec is not None else ()):
        if block._modules.get(name) is not None:
            return name
    return None


def _target(norm) -> bool:
    """A norm whose forward reads the stash and whose fused op is add_(c)rms_norm: RMSNorm, CRMSNorm and
    the compressed stream's CRMSNorm when it neither pads nor decompresses (blocks.fusable)."""
    from .blocks import fusable
    return isinstance(norm, TARGETS) and not getattr(type(norm), "fuses_residual_add", False) and fusable(norm)


def link(model: nn.Module) -> int:
    """Link every fused, hand-off-capable block of each registered stack in `model` to the norm that
    reads its output. Returns the number of links."""
    from .blocks import is_fused, spec_of
    count = 0
    for m in list(model.modules()):
        spec = STACKS.get(type(m).__name__)
        if spec is None or type(m).__module__ != spec.module:
            continue
        try:
            layers = list(m.get_submodule(spec.layers))
            parent, _, name = spec.final.rpartition(".")
            final = (m.get_submodule(parent) if parent else m, name)
        except AttributeError:
            continue
        for i, blk in enumerate(layers):
            fb = spec_of(blk) if is_fused(blk) else None
            if fb is None or not fb.hands_off:
                continue
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            owner, attr = (nxt, _entry(nxt)) if nxt is not None else final
            norm = owner._modules.get(attr) if attr is not None else None
            if not _target(norm):
                continue
            watch = (nxt,) if nxt is not None else ()
            object.__setattr__(blk, _LINK, _Link(owner, attr, watch))
            if not isinstance(norm.__dict__.get(_STASH), _Stash):
                object.__setattr__(norm, _STASH, _Stash())
            count += 1
    return count


def unlink(model: nn.Module) -> int:
    """Undo link (every link and stash in `model`)."""
    count = 0
    for m in model.modules():
        if m.__dict__.pop(_LINK, None) is not None:
            count += 1
        m.__dict__.pop(_STASH, None)
    return count


def is_linked(block: nn.Module) -> bool:
    return _LINK in block.__dict__


def target(block: nn.Module) -> nn.Module | None:
    """The norm `block` hands its output's norm to (None where it is not linked)."""
    link = block.__dict__.get(_LINK)
    return None if link is None else link.owner._modules.get(link.attr)


def stats(model: nn.Module) -> dict:
    """{"links", "hits", "misses"} summed over `model`'s norms' stashes."""
    stashes = [m.__dict__[_STASH] for m in model.modules() if _STASH in m.__dict__]
    return {"links": sum(is_linked(m) for m in model.modules()), "hits": sum(s.hits for s in stashes),
            "misses": sum(s.misses for s in stashes)}
